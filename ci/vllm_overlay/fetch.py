"""Fetch a pinned release file into the download cache and verify it.

Files come from the Python package index through its standard simple API
(PEP 691 JSON): the index pip itself uses (``PIP_INDEX_URL``, pip's
configuration, or pip's default), so no host name is written down here. A
file is written to the cache only after its sha256 matched, and checked
again on every use.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from vllm_overlay.errors import OverlayError
from vllm_overlay.pin import PinnedFile

_SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
_CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# pip's configuration keys for the index, most specific first: the
# environment, then the download command's section, then the global one.
_INDEX_KEYS = (":env:.index-url", "download.index-url", "global.index-url")
# pip's built-in default, asked of pip itself so no host name is written here.
_PIP_DEFAULT = "from pip._internal.models.index import PyPI; print(PyPI.simple_url)"


def _pip(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *args],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    if proc.returncode != 0:
        raise OverlayError(
            f"{sys.executable} -m pip {' '.join(args[:2])} failed: "
            f"{proc.stderr.strip()[-500:]}",
            "install pip for this Python (python3 -m ensurepip), or set "
            "PIP_INDEX_URL to the package index",
        )
    return proc.stdout


def default_index_url() -> str:
    """The index pip itself would use: ``PIP_INDEX_URL``, else pip's
    configuration (``pip config list``: its files and ``PIP_*`` variables),
    else pip's default. pip runs as a program, so this module stays stdlib."""
    if url := os.environ.get("PIP_INDEX_URL"):
        return url.rstrip("/")
    configured = dict(
        line.split("=", 1)
        for line in _pip("config", "list").splitlines()
        if "=" in line
    )
    for key in _INDEX_KEYS:
        if key in configured:
            return configured[key].strip().strip("'\"").rstrip("/")
    return _pip_default_index()


def _pip_default_index() -> str:
    proc = subprocess.run(
        [sys.executable, "-c", _PIP_DEFAULT], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise OverlayError(
            f"cannot ask pip for its default index: {proc.stderr.strip()[-500:]}",
            "install pip for this Python (python3 -m ensurepip), or set "
            "PIP_INDEX_URL to the package index",
        )
    return proc.stdout.strip().rstrip("/")


def list_files(index_url: str, project: str) -> list[dict[str, Any]]:
    """The index's file entries for ``project`` (filename, url, hashes)."""
    request = urllib.request.Request(
        f"{index_url}/{project}/", headers={"Accept": _SIMPLE_JSON}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            listing = json.load(response)
    except OSError as e:
        raise OverlayError(
            f"cannot read the package index for {project!r} at {index_url}: {e}",
            "check network access to the package index, or place the file in "
            "the download cache by hand (it is verified against pin.toml)",
        ) from None
    return list(listing.get("files", []))


def _find_file_url(index_url: str, project: str, filename: str) -> str:
    for entry in list_files(index_url, project):
        if entry.get("filename") == filename:
            return str(entry["url"])
    raise OverlayError(
        f"{filename} is not listed by the package index for {project!r}",
        "check the file name in pin.toml",
    )


def verify(path: Path, pinned: PinnedFile) -> Path:
    actual = sha256_of(path)
    if actual != pinned.sha256:
        raise OverlayError(
            f"{path}: sha256 {actual} does not match pin.toml ({pinned.sha256})",
            f"the file is truncated or tampered with: delete {path} and run again "
            "to download it afresh",
        )
    return path


def fetch(pinned: PinnedFile, cache_dir: Path, index_url: str | None = None) -> Path:
    """Return the verified path of ``pinned`` in ``cache_dir``."""
    target = cache_dir / pinned.filename
    if target.exists():
        return verify(target, pinned)

    cache_dir.mkdir(parents=True, exist_ok=True)
    url = _find_file_url(
        index_url or default_index_url(), pinned.project, pinned.filename
    )
    print(f"  downloading {pinned.filename}", file=sys.stderr)
    partial = target.with_name(target.name + ".part")
    try:
        with (
            urllib.request.urlopen(url, timeout=600) as response,
            partial.open("wb") as out,
        ):
            while chunk := response.read(_CHUNK):
                out.write(chunk)
        verify(partial, pinned)
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise OverlayError(
            f"download of {pinned.filename} failed: {e}", "run again"
        ) from None
    except OverlayError as e:
        partial.unlink(missing_ok=True)
        raise OverlayError(
            f"downloaded {pinned.filename} does not match pin.toml: {e.what}",
            "the index served a different file: check pin.toml's sha256",
        ) from None
    partial.replace(target)
    return target


def cache_local(path: Path, expected_name: str, cache_dir: Path) -> PinnedFile:
    """Put a release file from disk (a release candidate, a local build, a
    release the index does not serve) into the download cache under its
    release name, pinned by its own sha256: every later ``fetch`` of it
    (the rebase's build, its test gate) then finds it there and never asks
    an index."""
    if not path.is_file():
        raise OverlayError(
            f"{path} is not a file", "give the path of the release's file"
        )
    if path.name != expected_name:
        raise OverlayError(
            f"{path} is not named {expected_name}, the name the pin will record",
            "copy it under that name (`"
            + shlex.join(["cp", "-n", str(path), str(path.with_name(expected_name))])
            + "`) and give that path",
        )
    pinned = PinnedFile(expected_name, sha256_of(path))
    target = cache_dir / expected_name
    if target.exists():
        if sha256_of(target) != pinned.sha256:
            raise OverlayError(
                f"{target} already holds another file named {expected_name}",
                "move it aside if nothing pins it (`"
                + shlex.join(["mv", "-n", str(target), f"{target}.old"])
                + "`), then run again",
            )
        return pinned
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    shutil.copyfile(path, partial)
    partial.replace(target)
    return pinned
