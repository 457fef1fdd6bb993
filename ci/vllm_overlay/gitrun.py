"""The one way the tools run git: ``git -C REPO ARGS``, its output as text.

Callers add what is theirs: the workspace its identity and config
(workspace.py), a maintainer's identity in the walkthrough; each failure
names the command, the repository, git's own message and what to do next.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from vllm_overlay.errors import OverlayError


def run(
    repo: Path, *args: str, input: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``git -C repo args``, whatever its exit status; ``env`` adds to this
    process's environment."""
    return subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        input=input,
        env={**os.environ, **env} if env else None,
    )


def git(
    repo: Path,
    *args: str,
    input: str | None = None,
    env: dict[str, str] | None = None,
    next_step: str = "fix the repository with git, then run the command again",
) -> str:
    """The output of ``git -C repo args``, which must succeed."""
    result = run(repo, *args, input=input, env=env)
    if result.returncode != 0:
        raise OverlayError(
            f"git {' '.join(args[:2])} in {repo} failed: {result.stderr.strip()}",
            next_step,
        )
    return result.stdout
