"""Zip members as stored: read a member's compressed bytes, compare members.

``zipfile`` only hands out decompressed data; the assemble route copies the
official wheel's members without recompressing them, and the wheel check
compares them without inflating them, so both read the stored stream.
"""

from __future__ import annotations

import struct
import zipfile

# A local file header (APPNOTE 4.3.7), up to the name and extra field.
LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")


def raw_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """A member's compressed bytes, read past its local header."""
    fp = archive.fp
    assert fp is not None
    fp.seek(info.header_offset)
    header = LOCAL_HEADER.unpack(fp.read(LOCAL_HEADER.size))
    fp.seek(header[-2] + header[-1], 1)  # name and extra field
    return fp.read(info.compress_size)


def same_member(
    a: zipfile.ZipFile, b: zipfile.ZipFile, name: str, name_in_b: str | None = None
) -> bool:
    """Whether member ``name`` of ``a`` has the contents of ``name_in_b``
    (default: the same name) of ``b``.

    Equal compressed streams under one method inflate to equal contents, so a
    member copied raw from the other archive is settled without inflating
    it; any other pair with matching size and CRC is compared inflated.
    """
    other = name if name_in_b is None else name_in_b
    ia, ib = a.getinfo(name), b.getinfo(other)
    if (ia.file_size, ia.CRC) != (ib.file_size, ib.CRC):
        return False
    if (ia.compress_type, ia.compress_size) == (
        ib.compress_type,
        ib.compress_size,
    ) and raw_member(a, ia) == raw_member(b, ib):
        return True
    return a.read(name) == b.read(other)
