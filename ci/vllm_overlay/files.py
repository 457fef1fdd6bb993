"""File-system steps every part of the build line takes the same way."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory``: the folder holding dist/,
    which dist.publish's swap does not replace (two targets publishing at
    once each keep the other's wheel); .cache/pristine, for two builds
    laying trees."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def remove_path(path: Path) -> None:
    """Remove a file, symlink or folder, if there is one."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
