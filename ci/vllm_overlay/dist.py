"""Publish a checked wheel into ``dist/`` in one atomic step."""

from __future__ import annotations

import ctypes
import os
import shutil
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


def publish(wheel: Path, dist: Path, staging_root: Path) -> Path:
    """Make ``dist`` hold exactly ``wheel`` and its ``.sha256``.

    The new contents are assembled next to ``dist`` and swapped in with one
    rename, so an interrupted build leaves ``dist`` as it was.
    """
    staging = staging_root / "dist.new"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    target = staging / wheel.name
    shutil.copy2(wheel, target)
    (staging / f"{wheel.name}.sha256").write_text(
        f"{sha256_of(target)}  {wheel.name}\n"
    )
    dist = dist.absolute()
    if dist.exists():
        _exchange(staging, dist)
        shutil.rmtree(staging)  # now holds the previous dist/
    else:
        staging.rename(dist)
    return dist / wheel.name
