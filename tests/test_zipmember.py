"""Comparing zip members without inflating those that were copied raw."""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

from vllm_overlay.zipmember import raw_member, same_member

DATA = b"".join(b"line %d of a module\n" % i for i in range(2000))


def _zip(path: Path, members: dict[str, bytes], level: int) -> zipfile.ZipFile:
    with zipfile.ZipFile(
        path, "w", zipfile.ZIP_DEFLATED, compresslevel=level
    ) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return zipfile.ZipFile(path)


def test_same_stream_same_contents(tmp_path: Path) -> None:
    a = _zip(tmp_path / "a.zip", {"m.py": DATA}, 6)
    b = _zip(tmp_path / "b.zip", {"m.py": DATA}, 6)
    assert raw_member(a, a.getinfo("m.py")) == raw_member(b, b.getinfo("m.py"))
    assert same_member(a, b, "m.py")


def test_recompressed_member_is_compared_inflated(tmp_path: Path) -> None:
    a = _zip(tmp_path / "a.zip", {"m.py": DATA}, 1)
    b = _zip(tmp_path / "b.zip", {"m.py": DATA}, 9)
    assert raw_member(a, a.getinfo("m.py")) != raw_member(b, b.getinfo("m.py"))
    assert same_member(a, b, "m.py")


def test_other_contents_differ(tmp_path: Path) -> None:
    a = _zip(tmp_path / "a.zip", {"m.py": DATA}, 6)
    b = _zip(tmp_path / "b.zip", {"m.py": DATA.replace(b"line 7 ", b"line 8 ")}, 6)
    assert a.getinfo("m.py").file_size == b.getinfo("m.py").file_size
    assert not same_member(a, b, "m.py")


def test_raw_member_inflates_to_the_contents(tmp_path: Path) -> None:
    a = _zip(tmp_path / "a.zip", {"first.py": b"x" * 10, "m.py": DATA}, 6)
    assert zlib.decompress(raw_member(a, a.getinfo("m.py")), -15) == DATA
