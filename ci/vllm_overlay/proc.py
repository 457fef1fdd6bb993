"""Running a tool with its output in a log file."""

from __future__ import annotations

import subprocess
from pathlib import Path

from vllm_overlay.errors import OverlayError


def run_logged(
    cmd: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> None:
    """Run ``cmd``; on failure raise with the log's last lines."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        result = subprocess.run(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd
        )
    _check(cmd, result.returncode, log)


def output_of(cmd: list[str], log: Path, env: dict[str, str], cwd: Path) -> str:
    """``cmd``'s stdout, logged after its stderr at the end of ``log``; on
    failure raise with the log's last lines."""
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        result = subprocess.run(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=out, text=True
        )
        out.write(result.stdout)
    _check(cmd, result.returncode, log)
    return result.stdout


def _check(cmd: list[str], returncode: int, log: Path) -> None:
    if returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise OverlayError(
            f"`{' '.join(cmd[:4])} ...` failed (exit {returncode}); last "
            f"lines of {log}:\n{tail}",
            f"read {log}, fix the cause and run again",
        )
