"""fetch.py against a real HTTP index on 127.0.0.1 speaking the simple API."""

from __future__ import annotations

import ast
import hashlib
import http.server
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_overlay import fetch
from vllm_overlay.errors import OverlayError
from vllm_overlay.pin import PinnedFile

CONTENT = b"pretend sdist\n" * 1000
PINNED = PinnedFile("vllm-0.0.1.tar.gz", hashlib.sha256(CONTENT).hexdigest())


class _Index(http.server.BaseHTTPRequestHandler):
    served = CONTENT

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        port = self.server.server_address[1]
        if self.path == "/simple/vllm/":
            body = json.dumps(
                {
                    "files": [
                        {
                            "filename": PINNED.filename,
                            "url": f"http://127.0.0.1:{port}/files/{PINNED.filename}",
                        }
                    ]
                }
            ).encode()
        elif self.path == f"/files/{PINNED.filename}":
            body = type(self).served
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def index() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Index)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    server.shutdown()
    _Index.served = CONTENT


def test_download_is_verified_and_cached(tmp_path: Path, index: str) -> None:
    path = fetch.fetch(PINNED, tmp_path, index)
    assert path.read_bytes() == CONTENT
    _Index.served = b"changed on the server"
    assert fetch.fetch(PINNED, tmp_path, index) == path  # from the cache


def test_tampered_download_leaves_nothing(tmp_path: Path, index: str) -> None:
    _Index.served = CONTENT[:-10]  # truncated in transit
    with pytest.raises(OverlayError, match="does not match pin.toml") as e:
        fetch.fetch(PINNED, tmp_path, index)
    assert PINNED.filename in e.value.what
    assert list(tmp_path.iterdir()) == []


def test_tampered_cache_is_refused(tmp_path: Path, index: str) -> None:
    fetch.fetch(PINNED, tmp_path, index)
    cached = tmp_path / PINNED.filename
    cached.write_bytes(b"x" + CONTENT[1:])
    with pytest.raises(OverlayError, match="does not match pin.toml") as e:
        fetch.fetch(PINNED, tmp_path, index)
    assert str(cached) in e.value.what
    assert f"delete {cached}" in e.value.next_step


def test_file_not_on_index(tmp_path: Path, index: str) -> None:
    with pytest.raises(OverlayError, match="not listed by the package index"):
        fetch.fetch(PinnedFile("vllm-9.9.9.tar.gz", "0" * 64), tmp_path, index)


@pytest.mark.parametrize("section", ["global", "download"])
def test_index_from_pip_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, section: str
) -> None:
    """Without PIP_INDEX_URL, the index is the one pip's configuration names."""
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[{section}]\nindex-url = http://127.0.0.1:9/simple/\n")
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    assert fetch.default_index_url() == "http://127.0.0.1:9/simple"
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:8/simple")
    assert fetch.default_index_url() == "http://127.0.0.1:8/simple"


def test_the_build_line_imports_only_the_standard_library() -> None:
    """README, "Build": the tooling needs Python alone (pip runs as a program)."""
    package = Path(fetch.__file__).parent
    foreign = set()
    for source in package.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            foreign |= {
                f"{source.name}: {n}"
                for n in names
                if n.split(".")[0] not in sys.stdlib_module_names
                and n.split(".")[0] not in ("vllm_overlay", "__future__")
            }
    assert not foreign
