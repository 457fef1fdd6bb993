"""The assemble route: the official wheel with the patched files swapped in.

vLLM's python-only build (``build.MODES``'s "python-only") copies the
official wheel's compiled members and packs the tree's Python around them;
this route gets the same member contents without torch, setup.py or
recompressing anything: every unchanged member's compressed bytes are
copied as they are, only the files the series, overlay and manifest touch
are packed from the tree, and the dist-info is the official one with the
overlay version and tag, plus the notice of the changed files (notice.py)
beside vLLM's LICENSE. A test builds both routes and compares every member
(tests/test_real_release.py), so a drift in vLLM's build shows up.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import struct
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay import notice
from vllm_overlay.errors import OverlayError
from vllm_overlay.manifest import MODULE as MANIFEST_MODULE
from vllm_overlay.pin import Pin
from vllm_overlay.wheelcheck import VERSION_FILE
from vllm_overlay.zipmember import LOCAL_HEADER, raw_member

_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")
_MADE_BY = (3 << 8) | 20  # unix, zip 2.0, as setuptools' wheels are
_ZIP32_LIMIT = 0xFFFFFFFF
_NEW_FILE_ATTR = 0o100644 << 16  # a regular file, rw-r--r--


@dataclass(frozen=True)
class _Entry:
    name: str
    crc: int
    compressed_size: int
    size: int
    external_attr: int
    offset: int


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def _dos_time(epoch: int) -> tuple[int, int]:
    t = time.gmtime(max(epoch, 315532800))  # zip dates start in 1980
    return (
        t.tm_hour << 11 | t.tm_min << 5 | t.tm_sec // 2,
        (t.tm_year - 1980) << 9 | t.tm_mon << 5 | t.tm_mday,
    )


def overlay_version_file(official: str, pin: Pin) -> str:
    """``vllm/_version.py`` as setuptools-scm writes it for the overlay
    version (VLLM_VERSION_OVERRIDE leaves no commit id)."""
    parts = [int(p) for p in pin.version.split(".")]
    replacements = (
        (
            r"^__version__ = version = .*$",
            f"__version__ = version = {pin.overlay_version!r}",
        ),
        (
            r"^__version_tuple__ = version_tuple = .*$",
            f"__version_tuple__ = version_tuple = {(*parts, pin.local_label)!r}",
        ),
        (r"^__commit_id__ = commit_id = .*$", "__commit_id__ = commit_id = None"),
    )
    text = official
    for pattern, line in replacements:
        text, count = re.subn(pattern, line, text, count=1, flags=re.M)
        if count != 1:
            raise OverlayError(
                f"the official {VERSION_FILE} has no line matching {pattern!r}",
                "setuptools-scm's template changed: update "
                "assemble.overlay_version_file, or build with --python-only",
            )
    return text


class _HashingFile:
    """A file written front to back, hashed as it is written: the sha256 that
    dist/ publishes beside the wheel, without reading 300 MB again."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("wb")
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> None:
        self._file.write(data)
        self.sha256.update(data)

    def tell(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        self._file.close()


class _RawZipWriter:
    """Just enough of a zip writer to copy compressed members unchanged."""

    def __init__(self, path: Path, epoch: int) -> None:
        self._out = _HashingFile(path)
        self._time, self._date = _dos_time(epoch)
        self._entries: list[_Entry] = []

    def _header(self, name: bytes, crc: int, csize: int, size: int) -> None:
        self._out.write(
            LOCAL_HEADER.pack(
                0x04034B50,
                20,
                0,
                zipfile.ZIP_DEFLATED,
                self._time,
                self._date,
                crc,
                csize,
                size,
                len(name),
                0,
            )
        )
        self._out.write(name)

    def copy(self, name: str, info: zipfile.ZipInfo, raw: bytes) -> None:
        self._add(name, info.CRC, raw, info.file_size, info.external_attr)

    def write(self, name: str, data: bytes, external_attr: int) -> None:
        compressor = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, -15)
        raw = compressor.compress(data) + compressor.flush()
        self._add(name, zlib.crc32(data), raw, len(data), external_attr)

    def _add(self, name: str, crc: int, raw: bytes, size: int, attr: int) -> None:
        offset = self._out.tell()
        if max(offset, size, len(raw)) >= _ZIP32_LIMIT:
            raise OverlayError(
                f"{name}: the wheel outgrew a plain zip",
                "build with --python-only (zip64 is not written by the assemble route)",
            )
        encoded = name.encode()
        self._header(encoded, crc, len(raw), size)
        self._out.write(raw)
        self._entries.append(_Entry(name, crc, len(raw), size, attr, offset))

    def close(self) -> None:
        start = self._out.tell()
        for e in self._entries:
            encoded = e.name.encode()
            self._out.write(
                _CENTRAL.pack(
                    0x02014B50,
                    _MADE_BY,
                    20,
                    0,
                    zipfile.ZIP_DEFLATED,
                    self._time,
                    self._date,
                    e.crc,
                    e.compressed_size,
                    e.size,
                    len(encoded),
                    0,
                    0,
                    0,
                    0,
                    e.external_attr,
                    e.offset,
                )
            )
            self._out.write(encoded)
        size = self._out.tell() - start
        self._out.write(
            _END.pack(
                0x06054B50, 0, 0, len(self._entries), len(self._entries), size, start, 0
            )
        )
        self._out.close()

    @property
    def sha256(self) -> str:
        return self._out.sha256.hexdigest()


def assemble_wheel(
    official: Path, tree: Path, touched: set[str], pin: Pin, out_dir: Path, epoch: int
) -> tuple[Path, str]:
    """Write the overlay wheel of ``tree`` into ``out_dir``; return it and
    its sha256."""
    for stamped in (MANIFEST_MODULE, notice.NAME):
        if not (tree / stamped).is_file():
            raise OverlayError(
                f"{tree / stamped} is missing: the tree was not stamped",
                "run ./build.sh again: it stamps the tree before building",
            )
    old_info = f"{pin.distribution}-{pin.version}.dist-info/"
    new_info = f"{pin.distribution}-{pin.overlay_version}.dist-info/"
    target = out_dir / pin.overlay_wheel_name
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    writer = _RawZipWriter(partial, epoch)
    records: list[list[str]] = []
    try:
        with zipfile.ZipFile(official) as archive:
            official_records = {
                row[0]: row
                for row in csv.reader(
                    io.StringIO(archive.read(old_info + "RECORD").decode())
                )
            }
            names = set(archive.namelist())
            package = [
                i for i in archive.infolist() if not i.filename.startswith(old_info)
            ]
            dist_info = [
                i
                for i in archive.infolist()
                if i.filename.startswith(old_info)
                and not i.filename.endswith("/RECORD")
            ]
            for info in package:
                name = info.filename
                if name == VERSION_FILE:
                    data = overlay_version_file(
                        archive.read(name).decode(), pin
                    ).encode()
                elif name in touched:
                    data = (tree / name).read_bytes()
                else:
                    if name not in official_records:
                        raise OverlayError(
                            f"{official}: its RECORD has no row for {name!r} (a "
                            "name with a comma must be quoted there, as CSV "
                            "quotes it)",
                            f"download the official wheel again: remove {official} "
                            "and run ./build.sh",
                        )
                    writer.copy(name, info, raw_member(archive, info))
                    records.append(official_records[name])
                    continue
                writer.write(name, data, info.external_attr)
                records.append([name, _record_hash(data), str(len(data))])
            for name in sorted(
                t for t in touched if t.startswith("vllm/") and t not in names
            ):
                data = (tree / name).read_bytes()
                writer.write(name, data, _NEW_FILE_ATTR)
                records.append([name, _record_hash(data), str(len(data))])
            for info in dist_info:
                data = archive.read(info)
                short = info.filename[len(old_info) :]
                if short == "METADATA":
                    data = _replace_header(data, "Version", pin.overlay_version)
                    data = add_licence_file(data, notice.NAME)
                elif short == "WHEEL":
                    data = _replace_header(data, "Tag", pin.wheel_tag)
                name = new_info + short
                writer.write(name, data, info.external_attr)
                records.append([name, _record_hash(data), str(len(data))])
        # Where setuptools puts a license-files entry (build.py declares it).
        name = f"{new_info}licenses/{notice.NAME}"
        data = (tree / notice.NAME).read_bytes()
        writer.write(name, data, _NEW_FILE_ATTR)
        records.append([name, _record_hash(data), str(len(data))])
        records.append([f"{new_info}RECORD", "", ""])
        record = io.StringIO()
        csv.writer(record, lineterminator="\n").writerows(records)
        writer.write(new_info + "RECORD", record.getvalue().encode(), _NEW_FILE_ATTR)
        writer.close()
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    partial.replace(target)
    return target, writer.sha256


def _replace_header(data: bytes, field: str, value: str) -> bytes:
    text, count = re.subn(
        rf"^{field}: .*$", f"{field}: {value}", data.decode(), count=1, flags=re.M
    )
    if count != 1:
        raise OverlayError(
            f"the official dist-info has no {field} header", "build with --python-only"
        )
    return text.encode()


def add_licence_file(metadata: bytes, name: str) -> bytes:
    """METADATA with ``License-File: name`` after its last License-File
    field, where setuptools writes a further license-files entry."""
    head, sep, body = metadata.decode().partition("\n\n")
    lines = head.split("\n")
    found = [i for i, line in enumerate(lines) if line.startswith("License-File: ")]
    if not found:
        raise OverlayError(
            "the official METADATA names no License-File",
            "vLLM stopped shipping its licence in the wheel: add it from the "
            "sdist before building (Apache-2.0 section 4(a))",
        )
    lines.insert(found[-1] + 1, f"License-File: {name}")
    return ("\n".join(lines) + sep + body).encode()
