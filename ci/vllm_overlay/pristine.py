"""The pinned sdist's tree, unpacked once into the cache and laid by hard links.

Unpacking the ~47 MB sdist (8,500 files) was most of a warm build's time,
so ``.cache/pristine/<sdist sha256>/tree`` keeps it, unpacked from the
verified sdist, and a build lays ``build/tree`` from it: folders made
afresh, the files the series patches copied, every other file hard-linked.
Nothing the build does writes into a linked file: GNU patch only writes
the copied files (and would replace, not write through, a linked one: it
writes a new file and renames it), ``copy_overlay`` and the manifest add
new files only. ``build/workspace`` and ``build/pristine`` are unpacked from
the sdist as before and share nothing with the cache.

A person or a test can still write in place into a linked file of
``build/tree`` (an editor that keeps the inode), which changes the cached
file too. So the cache is verified on every use: ``record`` holds a digest
of every entry's path, mode, size, inode, symlink target and status-change
time (ctime), taken right after the last lay. A write, chmod or ``touch``
moves a file's ctime, which no user-space call can set back, so a changed,
added or removed file fails the check and the tree is unpacked again from
the sdist (checked against pin.toml's sha256). Linking and unlinking move
ctime as well: the record is retaken after each lay and checked before the
old ``build/tree`` is removed, and removing a tree in between (``rm -rf
build/tree``) only costs an unpack. The check is blind only to a write in
the same clock tick (a few ms) as a build's own lay, by a process running
alongside it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import sys
from collections.abc import Callable
from pathlib import Path

from vllm_overlay.fetch import fetch
from vllm_overlay.files import remove_path
from vllm_overlay.pin import Pin

# Raise when what the record covers changes, so an old record never passes.
_FORMAT = "vllm-overlay pristine 1"


def cache_entry(cache_dir: Path, pin: Pin) -> Path:
    """The cache folder of ``pin``'s sdist, keyed by its pinned sha256."""
    return cache_dir / "pristine" / pin.sdist.sha256


# Every entry under a folder: relative path, lstat, symlink target ("" if
# none), sorted by path.
Entries = list[tuple[str, os.stat_result, str]]


def _entries(root: Path) -> Entries:
    found: Entries = []
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(root / rel if rel else root) as it:
            for entry in it:
                path = f"{rel}/{entry.name}" if rel else entry.name
                st = entry.stat(follow_symlinks=False)
                link = os.readlink(entry.path) if entry.is_symlink() else ""
                found.append((path, st, link))
                if stat.S_ISDIR(st.st_mode):
                    stack.append(path)
    found.sort(key=lambda e: e[0])
    return found


def _digest(sdist_sha256: str, entries: Entries) -> str:
    digest = hashlib.sha256(f"{_FORMAT}\n{sdist_sha256}\n".encode())
    for path, st, link in entries:
        digest.update(
            f"{path}\0{st.st_mode:o}\0{st.st_size}\0{st.st_ino}\0"
            f"{st.st_ctime_ns}\0{link}\n".encode()
        )
    return digest.hexdigest()


def _record(entry: Path) -> Path:
    return entry / "record"


def write_record(entry: Path, sdist_sha256: str) -> None:
    """Take the record of the cached tree as it is now (atomically)."""
    partial = entry / "record.partial"
    partial.write_text(_digest(sdist_sha256, _entries(entry / "tree")) + "\n")
    partial.replace(_record(entry))


def intact_entries(entry: Path, sdist_sha256: str) -> Entries | None:
    """The cached tree's entries if it is exactly as its last record saw
    it, else None."""
    record = _record(entry)
    if not record.is_file() or not (entry / "tree").is_dir():
        return None
    entries = _entries(entry / "tree")
    if record.read_text().strip() != _digest(sdist_sha256, entries):
        return None
    return entries


def ensure(
    pin: Pin,
    cache_dir: Path,
    downloads: Path,
    extract: Callable[[Path, Path], None],
) -> tuple[Path, Entries]:
    """The verified cached tree of ``pin``'s sdist and its entries, unpacked
    (again) when it is missing or fails its record. ``extract(sdist, dest)``
    unpacks."""
    entry = cache_entry(cache_dir, pin)
    if (entries := intact_entries(entry, pin.sdist.sha256)) is not None:
        return entry / "tree", entries
    if entry.exists():
        print(
            f"  {entry} changed since its record (a file of build/tree "
            "written in place or removed moves the cached file's ctime): "
            "unpacking the sdist again",
            file=sys.stderr,
        )
    sdist = fetch(pin.sdist, downloads)
    staging = entry.with_name(entry.name + ".partial")
    remove_path(staging)
    extract(sdist, staging / "tree")
    remove_path(entry)
    staging.rename(entry)
    write_record(entry, pin.sdist.sha256)
    return entry / "tree", _entries(entry / "tree")


def _wanted(
    st: os.stat_result, want: tuple[os.stat_result, str] | None, copied: bool
) -> bool:
    """Whether an existing entry of the tree being laid already is what the
    lay would make: a folder where the cache has one, or the cached file
    itself (same inode), which the cache's check has just verified."""
    if want is None:
        return False
    cached, target = want
    if stat.S_ISDIR(cached.st_mode):
        return stat.S_ISDIR(st.st_mode)
    return (
        not target
        and not copied
        and stat.S_ISREG(st.st_mode)
        and (st.st_ino, st.st_dev) == (cached.st_ino, cached.st_dev)
    )


def lay(cached: Path, entries: Entries, dest: Path, copied: set[str] | None) -> None:
    """Make ``dest`` the cached tree (``entries``, as verified): folders made
    (with the cache's modes), symlinks recreated, the files in ``copied``
    copied (the series replaces them, and unlinking a cached file would move
    its ctime), every other file hard-linked (copied where the two are on
    different file systems). ``copied=None`` copies every file: for a tree
    that a foreign build (vLLM's setup.py) writes into.

    An earlier build's tree at ``dest`` is reused, not removed (removing
    8,500 files took longer than the rest of a warm build): what is already
    the cached file or folder stays, everything else goes, then what is
    missing is laid, so the result is the same as on an empty ``dest``."""
    wanted = {path: (st, target) for path, st, target in entries}
    dest.mkdir(parents=True, exist_ok=True)
    kept: set[str] = set()
    gone: set[str] = set()  # folders removed with everything in them
    for path, st, _ in _entries(dest):
        if path.rpartition("/")[0] in gone:
            gone.add(path)
        elif _wanted(st, wanted.get(path), copied is None or path in copied):
            kept.add(path)
        elif stat.S_ISDIR(st.st_mode):
            shutil.rmtree(dest / path)
            gone.add(path)
        else:
            os.unlink(dest / path)
    link: Callable[[str, str], object] = os.link
    src_root, dest_root = str(cached), str(dest)
    for path, (st, target) in wanted.items():
        src, out = f"{src_root}/{path}", f"{dest_root}/{path}"
        if stat.S_ISDIR(st.st_mode):
            if path not in kept:
                os.mkdir(out)
            os.chmod(out, stat.S_IMODE(st.st_mode))
        elif path in kept:
            continue
        elif target:
            os.symlink(target, out)
        elif copied is None or path in copied:
            shutil.copy2(src, out)
        else:
            try:
                link(src, out)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
                link = shutil.copy2
                link(src, out)
