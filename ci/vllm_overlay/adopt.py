"""Adopt a rebase's result: one target's series, pin and overlay, replaced.

``rebase-check VERSION --write`` leaves ``rebased/`` (``patches/``,
``pin.toml``, ``overlay/``) under the target's ``build/rebase/VERSION/``;
``adopt`` puts it in place of the target's own three (each target's are
its own: ``targets/NAME/`` holds another target's), and nothing outside
them is written but, for the main target, ``.gitmodules``' branch.

Every new folder and file is first laid next to the one it replaces
(``.NAME.adopt-new``), then each goes in by two renames (old aside, new in);
a failure part-way renames back what went in, so the checkout holds either
the old three or the new three. It refuses, before anything is written,
when git reports uncommitted changes in the three paths, or when any of
them changed since ``--write`` took the series it rebased (``source.json``),
since adopting would then lose that work.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from vllm_overlay import gitrun, rebase_state, source
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout
from vllm_overlay.pin import load_pin


def _git(root: Path, *args: str) -> str:
    return gitrun.git(
        root,
        *args,
        next_step="adopt works in a git checkout of the project (it refuses to "
        "replace uncommitted work, and git says what there is)",
    )


def _pathspecs(layout: Layout) -> list[str]:
    """git pathspecs of the target's own paths."""
    return [
        "--",
        *(p.relative_to(layout.root).as_posix() for p in rebase_state.owned(layout)),
    ]


def adopt(layout: Layout, version: str) -> str:
    """Replace the target's pin, series and overlay with the rebase of
    ``version``; return the ``git diff --stat`` to commit."""
    work = rebase_state.version_dir(layout, version)
    rebased = rebase_state.rebased_dir(layout, version)
    sources = rebase_state.check_result(layout, rebased, layout.command)
    record = work / rebase_state.SOURCE_RECORD
    if not record.is_file():
        raise OverlayError(
            f"{record} does not exist, so what {rebased} was rebased from is unknown",
            f"make the rebase again: `mv {work} {work}.old && {layout.command} "
            f"rebase-check {version} --write`",
        )
    specs = _pathspecs(layout)
    if dirty := _git(layout.root, "status", "--porcelain", "-uall", *specs):
        raise OverlayError(
            "uncommitted changes in what adopt replaces: "
            + "; ".join(line.strip() for line in dirty.splitlines()),
            "commit them or put them aside (`git stash -u`), then adopt again",
        )
    then = json.loads(record.read_text())
    now = rebase_state.files_digest(layout)
    if moved := sorted(
        p for p in then.keys() | now.keys() if then.get(p) != now.get(p)
    ):
        raise OverlayError(
            f"changed since `rebase-check {version} --write` took the series "
            f"to rebase: {', '.join(moved)}",
            f"rebase the current files: `mv {work} {work}.old && {layout.command} "
            f"rebase-check {version} --write`",
        )
    rebase_state.replace(layout, sources)
    root = layout.root
    # The overlay tests' node ids may have moved with the rebase (the gate
    # said which); they are committed with it, and the submodule's branch
    # with the main pin.
    also = ["ci/overlay-tests.txt"]
    if not layout.target and (root / ".gitmodules").is_file():
        source.track_tag(root, load_pin(layout.pin).tag)
        also.append(".gitmodules")
    stat = _git(root, "diff", "--stat=200", *specs, *also)
    new = _git(root, "ls-files", "--others", "--exclude-standard", *specs).split()
    add = ["git", "add", "-A", *specs, *also]
    commit = ["git", "commit", "-q", "-m", f"Rebase onto vLLM {version}"]
    return (
        f"adopted {rebased}:\n{stat}"
        + "".join(f" new file: {n}\n" for n in new)
        + f"commit it: `{shlex.join(add)} && {shlex.join(commit)}`"
    )
