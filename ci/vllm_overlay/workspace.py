"""The maintainer's workspace: the series as git commits, and back.

``make_workspace`` lays the pinned tree in ``build/workspace`` as a git
repository: one base commit, then one commit per patch whose message is the
patch's file name, a blank line and its DEP-3 header. Maintainers edit those
commits with ordinary git (amend, ``rebase -i``, new commits); ``export``
writes every commit after the base back to ``patches/`` and rewrites
``series`` in commit order. The export format is fixed (no ``index`` lines,
three lines of context, ``a/`` and ``b/`` prefixes), so importing and
exporting an unchanged series gives the same bytes on any machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vllm_overlay import apply
from vllm_overlay.errors import OverlayError
from vllm_overlay.series import Patch, header_text, load_series

BASE_MESSAGE = "upstream"
_ENV = {
    "GIT_AUTHOR_NAME": "vllm-overlay",
    "GIT_AUTHOR_EMAIL": "vllm-overlay@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_NAME": "vllm-overlay",
    "GIT_COMMITTER_EMAIL": "vllm-overlay@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}
HEADER_TEMPLATE = """\
Description: <what the patch changes and why, in a few lines>
Author: <name and address>
Forwarded: <upstream PR URL, or not-needed and why>
Bug: <issue URL, if there is one>
Last-Update: <YYYY-MM-DD>
---
"""


def git(repo: Path, *args: str, input: str | None = None) -> str:
    result = subprocess.run(
        ["git", "-C", str(repo), "-c", "core.autocrlf=false", "-c", "gc.auto=0", *args],
        capture_output=True,
        text=True,
        input=input,
        env={**os.environ, **_ENV},
    )
    if result.returncode != 0:
        raise OverlayError(
            f"git {' '.join(args[:2])} in {repo} failed: {result.stderr.strip()}",
            "fix the workspace with git, then run the command again",
        )
    return result.stdout


def _commit(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(
        repo,
        "commit",
        "-q",
        "--allow-empty",
        "--cleanup=verbatim",
        "-F",
        "-",
        input=message,
    )


def make_workspace(tree: Path, patches: list[Patch], upto: str | None) -> None:
    """Turn the fresh upstream ``tree`` into the workspace repository."""
    git(tree, "init", "-q", "-b", "workspace")
    _commit(tree, BASE_MESSAGE + "\n")
    for patch in patches:
        report = apply.classify(tree, patch)
        if report.fit in (apply.Fit.CONFLICT, apply.Fit.TARGET_GONE):
            pending = tree / ".git" / "PENDING_HEADER"
            pending.write_text(f"{patch.name}\n\n{header_text(patch.path.read_text())}")
            raise OverlayError(
                f"{patch.name} does not apply to the workspace ({report.fit.value}: "
                f"{report.detail})",
                f"in {tree}: `patch -p1 --merge < {patch.path}`, resolve, then "
                f"`git commit -a --cleanup=verbatim -F .git/PENDING_HEADER`, apply "
                "the later patches the same way, and `ci/overlay export`",
            )
        apply.apply_loosely(tree, patch)
        _commit(tree, f"{patch.name}\n\n{header_text(patch.path.read_text())}")
        note = "" if report.fit is apply.Fit.CLEAN else f" ({report.fit.value})"
        print(f"  committed {patch.name}{note}", file=sys.stderr)
        if patch.name == upto:
            break


def new_patch(workspace: Path, name: str) -> None:
    """Commit the workspace's changes as a new patch with a header template."""
    if not name.endswith(".patch") or "/" in name:
        raise OverlayError(
            f"{name!r} is not a patch file name", "use NNNN-short-name.patch"
        )
    if not git(workspace, "status", "--porcelain"):
        raise OverlayError(
            f"{workspace} has no changes to put in {name}", "edit the files first"
        )
    _commit(workspace, f"{name}\n\n{HEADER_TEMPLATE}")


def _diff(repo: Path, commit: str) -> str:
    raw = git(
        repo,
        "diff",
        "--no-color",
        "--no-ext-diff",
        "--no-renames",
        "--src-prefix=a/",
        "--dst-prefix=b/",
        "-U3",
        f"{commit}^",
        commit,
    )
    return "".join(
        line for line in raw.splitlines(keepends=True) if not line.startswith("index ")
    )


def export(workspace: Path, patches_dir: Path) -> list[str]:
    """Write the workspace's commits to ``patches_dir``; return the names."""
    commits = git(workspace, "rev-list", "--reverse", "HEAD").split()
    base, *patch_commits = commits
    if git(workspace, "log", "-1", "--format=%B", base) != BASE_MESSAGE + "\n\n":
        raise OverlayError(
            f"{workspace}: first commit is not the upstream base",
            "make the workspace again with `ci/overlay workspace`",
        )
    if git(workspace, "status", "--porcelain"):
        raise OverlayError(
            f"{workspace} has uncommitted changes",
            "commit them into a patch commit first",
        )
    names: list[str] = []
    texts: dict[str, str] = {}
    for commit in patch_commits:
        # %B prints the message verbatim plus one newline of git log's own.
        message = git(workspace, "log", "-1", "--format=%B", commit)[:-1]
        name, _, header = message.partition("\n\n")
        name = name.strip()
        if not name.endswith(".patch") or "/" in name or name in texts:
            raise OverlayError(
                f"commit {commit[:12]}: first line {name!r} is not a new patch "
                "file name",
                "reword the commit: first line NNNN-short-name.patch, blank line, "
                "DEP-3 header",
            )
        texts[name] = header + _diff(workspace, commit)
        names.append(name)
    for old in patches_dir.glob("*.patch"):
        if old.name not in texts:
            old.unlink()
    for name, text in texts.items():
        (patches_dir / name).write_text(text)
    series = patches_dir / "series"
    comments = (
        [line for line in series.read_text().splitlines() if line.startswith("#")]
        if series.exists()
        else []
    )
    series.write_text("\n".join([*comments, *names]) + "\n")
    load_series(patches_dir)  # the result must be a valid series
    return names
