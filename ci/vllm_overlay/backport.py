"""Backport: carry a change of one main-series patch into another target.

Every change to the main series goes to the other targets' series too, and
they are on other releases, so the patch itself cannot be re-applied there.
What moves is the difference between the main patch's old version (as git
has it at ``--from``, HEAD by default) and its version in the checkout: the
files it touches are laid from the main release with the earlier main
patches and the old version (the merge base) or the new one (the other
side), and ``git merge-file`` merges that difference into the same files
of the target's workspace, leaving conflict markers where both changed the
same lines. Nothing is committed: the maintainer reads the result and
folds it into the target's patch commit.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from vllm_overlay import apply, rebase, workspace
from vllm_overlay.errors import OverlayError
from vllm_overlay.fetch import fetch
from vllm_overlay.paths import Layout
from vllm_overlay.pin import load_pin
from vllm_overlay.series import Patch, load_series, parse_header, parse_targets


def _main_patch(main: Layout, number: str) -> tuple[list[Patch], Patch]:
    patches = load_series(main.patches)
    for i, patch in enumerate(patches):
        if patch.name == number or patch.name.startswith(f"{number}-"):
            return patches[:i], patch
    raise OverlayError(
        f"{number}: no patch of {main.patches / 'series'} is named so",
        "name it by its number, e.g. 0002, or its file name",
    )


def _old_version(main: Layout, patch: Patch, rev: str, scratch: Path) -> Patch:
    rel = patch.path.relative_to(main.root).as_posix()
    shown = subprocess.run(
        ["git", "-C", str(main.root), "show", f"{rev}:{rel}"],
        capture_output=True,
        text=True,
    )
    if shown.returncode != 0:
        raise OverlayError(
            f"git has no {rel} at {rev}: {shown.stderr.strip()}",
            "name a commit that has the old version with --from REV",
        )
    if shown.stdout == patch.path.read_text():
        raise OverlayError(
            f"{rel} is the same at {rev} as in the checkout: nothing to backport",
            f"name the commit before the change: `--from {rev}~1`",
        )
    path = scratch / patch.name
    path.write_text(shown.stdout)
    return Patch(
        patch.name, path, parse_header(shown.stdout), parse_targets(shown.stdout)
    )


def _lay(tree: Path, sdist: Path, patches: list[Patch], files: set[str]) -> None:
    rebase.extract_files(sdist, files, tree)
    for patch in patches:
        apply.apply_patch(tree, patch)


def backport(main: Layout, target: Layout, number: str, rev: str) -> str:
    """Merge the change of main patch ``number`` since ``rev`` into the
    target's workspace; raise naming the files with conflict markers."""
    ws = target.workspace
    state = workspace.State.load(ws) if (ws / ".git").is_dir() else None
    earlier, new = _main_patch(main, number)
    if state is None:
        raise OverlayError(
            f"{ws} is not a workspace",
            f"make it, stopped after the patch: `{target.command} workspace "
            f"--upto {new.name}`",
        )
    if dirty := workspace.git(ws, "status", "--porcelain"):
        raise OverlayError(
            f"{ws} has uncommitted changes ({dirty.splitlines()[0].strip()}, ...): "
            "the merge writes into its files",
            f"commit them first (`git -C {ws} add -A && git -C {ws} commit -q "
            f"--amend --no-edit`), or discard them: `git -C {ws} checkout -- .`",
        )
    sdist = fetch(load_pin(main.pin).sdist, main.downloads)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        old = _old_version(main, new, rev, scratch)
        files = {t for p in [*earlier, old, new] for t in p.targets}
        _lay(scratch / "base", sdist, [*earlier, old], files)
        _lay(scratch / "theirs", sdist, [*earlier, new], files)
        changed = [
            f
            for f in sorted(files)
            if _read(scratch / "base" / f) != _read(scratch / "theirs" / f)
        ]
        conflicted = []
        for rel in changed:
            ours = ws / rel
            if not ours.exists():
                ours.parent.mkdir(parents=True, exist_ok=True)
                ours.write_bytes(b"")
            for side in ("base", "theirs"):
                (scratch / side / rel).parent.mkdir(parents=True, exist_ok=True)
                (scratch / side / rel).touch()
            merged = subprocess.run(
                [
                    "git",
                    "merge-file",
                    "--diff3",
                    "-L",
                    f"{target.target or 'main'} workspace",
                    "-L",
                    f"{new.name} at {rev}",
                    "-L",
                    f"{new.name} now",
                    str(ours),
                    str(scratch / "base" / rel),
                    str(scratch / "theirs" / rel),
                ],
                capture_output=True,
                text=True,
            )
            if merged.returncode < 0 or merged.returncode > 127:
                raise OverlayError(
                    f"git merge-file {rel} failed: {merged.stderr.strip()}",
                    "check the workspace's file, then run the command again",
                )
            if merged.returncode > 0:
                conflicted.append(rel)
            if not _read(ours) and not (scratch / "theirs" / rel).stat().st_size:
                ours.unlink()  # the new version removes the file
    subject = workspace.git(ws, "log", "-1", "--format=%s").strip()
    fold = (
        f"`git -C {ws} add -A && git -C {ws} commit -q --amend --no-edit`"
        if subject == new.name
        else f"`git -C {ws} add -A && git -C {ws} commit -q --fixup=:/^{new.name} && "
        f"GIT_SEQUENCE_EDITOR=true git -C {ws} rebase -q -i --autosquash "
        f"{workspace.git(ws, 'rev-list', '--max-parents=0', 'HEAD').split()[0]}`"
    )
    then = f"{fold}, then `{target.command} workspace --continue --dir {ws}` and " + (
        f"`{target.command} export`"
    )
    if conflicted:
        raise OverlayError(
            f"merged the change of {new.name} since {rev} into {ws}; conflict "
            f"markers in {', '.join(conflicted)}",
            f"resolve them, then {then}",
        )
    return (
        f"merged the change of {new.name} since {rev} into {ws} "
        f"({', '.join(changed)}); look at `git -C {ws} diff`, then {then}"
    )


def _read(path: Path) -> bytes:
    return path.read_bytes() if path.is_file() else b""
