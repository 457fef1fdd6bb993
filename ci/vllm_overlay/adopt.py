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

import hashlib
import json
import shlex
import shutil
from pathlib import Path

from vllm_overlay import gitrun, source, workspace
from vllm_overlay.dist import remove_path
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout
from vllm_overlay.pin import load_pin
from vllm_overlay.series import load_series, read_series

SOURCE_RECORD = "source.json"


def version_dir(layout: Layout, version: str) -> Path:
    """Where ``rebase-check --write`` works on ``version`` for this target."""
    return layout.build / "rebase" / version


def owned(layout: Layout) -> list[Path]:
    """The target's own paths: its pin, series folder and overlay folder."""
    return [layout.pin, layout.patches, layout.overlay]


def files_digest(layout: Layout) -> dict[str, str]:
    """sha256 of every file of the target's own paths, by checkout-relative
    path."""
    root = layout.root
    digests: dict[str, str] = {}
    for top in owned(layout):
        files = [top] if top.is_file() else sorted(top.rglob("*"))
        for path in files:
            if path.is_file():
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                digests[path.relative_to(root).as_posix()] = digest
    return digests


def record_source(layout: Layout, version: str) -> None:
    """What ``--write`` rebased: adopt refuses if the checkout moved on."""
    record = version_dir(layout, version) / SOURCE_RECORD
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(files_digest(layout), indent=2, sort_keys=True))


def _git(root: Path, *args: str) -> str:
    return gitrun.git(
        root,
        *args,
        next_step="adopt works in a git checkout of the project (it refuses to "
        "replace uncommitted work, and git says what there is)",
    )


def _pathspecs(layout: Layout) -> list[str]:
    """git pathspecs of the target's own paths."""
    return ["--", *(p.relative_to(layout.root).as_posix() for p in owned(layout))]


def check_result(layout: Layout, rebased: Path, command: str) -> list[Path]:
    """The result's paths, in the order of ``owned``, after checking they
    form a target that names the same folders as this one."""
    pin = rebased / "pin.toml"
    patches = rebased / "patches"
    overlay = rebased / "overlay"
    if not (patches / "series").is_file():
        raise OverlayError(
            f"{patches / 'series'} does not exist: there is no exported rebase",
            f"finish the rebase first: `{command} export --dir "
            f"{rebased.parent / 'workspace'}`",
        )
    load_series(patches)
    new, old = load_pin(pin), load_pin(layout.pin)
    if (new.series, new.overlay) != (old.series, old.overlay):
        raise OverlayError(
            f"{pin} names series {new.series!r} and overlay {new.overlay!r}, "
            f"{layout.pin} {old.series!r} and {old.overlay!r}",
            f"adopt replaces the folders in place: set series and overlay in {pin} "
            "as the current pin has them",
        )
    return [pin, patches, overlay]


def adopt(layout: Layout, version: str) -> str:
    """Replace the target's pin, series and overlay with the rebase of
    ``version``; return the ``git diff --stat`` to commit."""
    work = version_dir(layout, version)
    rebased = work / "rebased"
    sources = check_result(layout, rebased, layout.command)
    record = work / SOURCE_RECORD
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
    now = files_digest(layout)
    if moved := sorted(
        p for p in then.keys() | now.keys() if then.get(p) != now.get(p)
    ):
        raise OverlayError(
            f"changed since `rebase-check {version} --write` took the series "
            f"to rebase: {', '.join(moved)}",
            f"rebase the current files: `mv {work} {work}.old && {layout.command} "
            f"rebase-check {version} --write`",
        )
    replace(layout, sources)
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


def unexported(layout: Layout, version: str) -> list[str]:
    """What of the rebase workspace of ``version`` ``rebased/patches`` does
    not hold as exported: patch names, and "series" for their order."""
    work = version_dir(layout, version)
    patches = work / "rebased" / "patches"
    texts = workspace.exported_texts(work / "workspace")
    have = (
        {p.name: p.read_text() for p in patches.glob("*.patch")}
        if (patches / "series").is_file()
        else {}
    )
    order = read_series(patches) if have else []
    return sorted(
        n for n in texts.keys() | have.keys() if texts.get(n) != have.get(n)
    ) or (["series"] if order != list(texts) else [])


def check_exported(layout: Layout, version: str) -> Path:
    """The rebase workspace of ``version``, after checking that its commits
    are what ``rebased/patches`` holds (the checks run on the workspace)."""
    work = version_dir(layout, version)
    ws = work / "workspace"
    patches = work / "rebased" / "patches"
    if not (ws / ".git").is_dir():
        raise OverlayError(
            f"{ws} is not a workspace: no rebase onto {version} to adopt",
            f"`{layout.command} rebase-check {version} --write`",
        )
    if differ := unexported(layout, version):
        raise OverlayError(
            f"{patches} is not what {ws} holds: {', '.join(differ)} differ",
            f"`{layout.command} export --dir {ws}`, then adopt again",
        )
    return ws


def _stage(dest: Path, source: Path) -> Path:
    """``source`` laid next to ``dest``."""
    staged = dest.with_name(f".{dest.name}.adopt-new")
    remove_path(staged)
    if source.is_file():
        shutil.copy2(source, staged)
    else:
        shutil.copytree(source, staged, symlinks=True)
    return staged


def replace(layout: Layout, sources: list[Path]) -> None:
    """Put ``sources`` (a result's pin, series, overlay) in place of the
    target's own; all or nothing.
    The test gate lays its copy of the checkout with it too."""
    # A target without an overlay folder has none in its result either.
    pairs = [(d, s) for d, s in zip(owned(layout), sources, strict=True) if s.exists()]
    targets = [d for d, _ in pairs]
    for dest in targets:
        aside = dest.with_name(f".{dest.name}.adopt-old")
        if aside.exists():
            raise OverlayError(
                f"{aside} is left from an adopt that was cut off",
                f"compare it with {dest}; keep the one you want as {dest} and "
                f"remove the other, then adopt again",
            )
    staged = [_stage(dest, source) for dest, source in pairs]
    done: list[tuple[Path, Path]] = []  # (dest, its old one aside)
    try:
        for dest, new in zip(targets, staged, strict=True):
            aside = dest.with_name(f".{dest.name}.adopt-old")
            if dest.exists():
                dest.rename(aside)
            done.append((dest, aside))
            new.rename(dest)
    except BaseException:
        for dest, aside in reversed(done):
            if aside.exists():
                remove_path(dest)
                aside.rename(dest)
        for new in staged:
            remove_path(new)
        raise
    for _, aside in done:
        remove_path(aside)
