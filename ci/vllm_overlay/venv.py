"""Virtual environments under the cache, keyed by what goes into them.

A venv is reused only when its ``.complete`` stamp exists, which is written
last: an interrupted bootstrap is removed and made again. Checkouts and
worktrees share one cache, so a venv is made under an exclusive lock beside
it: a second process that wants the same venv waits for the first instead of
deleting the half-made venv under it.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from vllm_overlay.proc import run_logged


def venv_dir(
    cache_dir: Path, name: str, requirements: list[str], requirement_file: Path
) -> Path:
    spec = "\n".join([*requirements, requirement_text(requirement_file), sys.version])
    return cache_dir / f"{name}-{hashlib.sha256(spec.encode()).hexdigest()[:16]}"


def requirement_text(requirement_file: Path) -> str:
    """The file's text with that of each file it includes (``-r FILE``,
    relative to it), as pip reads them."""
    texts = [requirement_file.read_text()]
    for line in texts[0].splitlines():
        if line.startswith("-r "):
            texts.append(requirement_text(requirement_file.parent / line[3:].strip()))
    return "\n".join(texts)


def ensure_venv(
    cache_dir: Path,
    name: str,
    requirements: list[str],
    requirement_file: Path,
    log: Path,
) -> Path:
    """Return the python of a venv with ``requirements`` and the contents of
    ``requirement_file`` installed.

    The venv is keyed by what goes into it (the file's text, not its path),
    so checkouts that share a cache share their venvs.
    """
    return stamped_venv(
        venv_dir(cache_dir, name, requirements, requirement_file),
        lambda python: pip_install(
            python, [*requirements, "-r", str(requirement_file)], log
        ),
        log,
    )


def tool_venv(cache_dir: Path, name: str, requirement: str, log: Path) -> Path:
    """Return the python of a venv that holds only ``requirement`` (one
    pinned tool, e.g. ``ruff==0.17.2``), keyed by it and this Python."""
    spec = f"{requirement}\n{sys.version}"
    env = cache_dir / f"{name}-{hashlib.sha256(spec.encode()).hexdigest()[:16]}"
    return stamped_venv(
        env, lambda python: pip_install(python, [requirement], log), log
    )


def stamped_venv(
    env: Path, fill: Callable[[Path], None], log: Path, creator: Path | None = None
) -> Path:
    """Return the python of the venv at ``env``, made first (``creator -m
    venv``, this interpreter by default, then ``fill(python)``) unless its
    stamp says an earlier bootstrap completed."""
    python = env / "bin" / "python"
    stamp = env / ".complete"
    if stamp.exists():
        return python
    env.parent.mkdir(parents=True, exist_ok=True)
    with (env.parent / f"{env.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists():  # made by the process that held the lock
            return python
        if env.exists():
            shutil.rmtree(env)
        print(f"  creating {env.name}", file=sys.stderr)
        run_logged([str(creator or sys.executable), "-m", "venv", str(env)], log)
        fill(python)
        stamp.write_text(env.name)
    return python


def pip_install(python: Path, args: list[str], log: Path) -> None:
    run_logged([str(python), "-m", "pip", "install", "--quiet", *args], log)
