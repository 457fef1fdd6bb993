"""One rebase's state, for every command of its cycle: where it lives, what
was rebased, what passed, and how its result is laid over a checkout.

``rebase-check VERSION --write`` (rebase.py) makes ``build/rebase/VERSION/``
of the target: ``workspace/`` (the series as git commits on the release),
``rebased/`` (``pin.toml``, ``patches/``, ``overlay/``: what adopt puts in
place) and ``source.json`` (the target's files it rebased). The static
check (rebase.py) records ``check.json`` for the workspace it passed on;
the test gate (gate.py) records ``test.json`` for the ``rebased/`` its tests
ran on; ``adopt`` (adopt.py) refuses unless both hold for what it would put
in place. Those three read this module, never each other.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
from pathlib import Path

from vllm_overlay import workspace
from vllm_overlay.errors import OverlayError
from vllm_overlay.files import remove_path
from vllm_overlay.paths import Layout
from vllm_overlay.pin import load_pin
from vllm_overlay.series import load_series, read_series

SOURCE_RECORD = "source.json"
CHECK_RECORD = "check.json"
TEST_RECORD = "test.json"


def version_dir(layout: Layout, version: str) -> Path:
    """Where ``rebase-check --write`` works on ``version`` for this target."""
    return layout.build / "rebase" / version


def workspace_dir(layout: Layout, version: str) -> Path:
    """The series as git commits on the release, where a maintainer resolves
    stops and export reads."""
    return version_dir(layout, version) / "workspace"


def rebased_dir(layout: Layout, version: str) -> Path:
    """What adopt puts in place: ``pin.toml``, ``patches/``, ``overlay/``."""
    return version_dir(layout, version) / "rebased"


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


def refuse_to_overwrite(layout: Layout, version: str) -> None:
    """``--write`` never deletes earlier work: a result, or a workspace with
    anything not yet exported."""
    rebased = rebased_dir(layout, version)
    ws = workspace_dir(layout, version)
    lost = workspace.unsaved_work(ws) if ws.exists() else []
    if rebased.exists() or lost:
        what = [str(rebased)] if rebased.exists() else []
        moved = version_dir(layout, version)
        raise OverlayError(
            f"--write would replace earlier work: {', '.join(what + lost)}",
            "finish it (docs/maintainers.md, recipe 5) or move it away: `"
            + shlex.join(["mv", "-n", str(moved), f"{moved}.old"])
            + "`",
        )


def record_source(layout: Layout, version: str) -> None:
    """What ``--write`` rebased: adopt refuses if the checkout moved on."""
    record = version_dir(layout, version) / SOURCE_RECORD
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(files_digest(layout), indent=2, sort_keys=True))


def unexported(layout: Layout, version: str) -> list[str]:
    """What of the rebase workspace of ``version`` ``rebased/patches`` does
    not hold as exported: patch names, and "series" for their order."""
    patches = rebased_dir(layout, version) / "patches"
    texts = workspace.exported_texts(workspace_dir(layout, version))
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
    ws = workspace_dir(layout, version)
    patches = rebased_dir(layout, version) / "patches"
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


def workspace_state(ws: Path) -> str:
    """What the static check ran on: the workspace's commit and its
    uncommitted changes, as one digest."""
    head = workspace.git(ws, "rev-parse", "HEAD")
    status = workspace.git(ws, "status", "--porcelain", "-uall")
    diff = workspace.git(ws, "diff", "HEAD")
    return hashlib.sha256(f"{head}\n{status}\n{diff}".encode()).hexdigest()


def record_check(layout: Layout, version: str) -> None:
    """The static check passed on the workspace as it is now."""
    work = version_dir(layout, version)
    state = workspace_state(workspace_dir(layout, version))
    (work / CHECK_RECORD).write_text(json.dumps({"workspace": state}) + "\n")


def checked(layout: Layout, version: str) -> bool:
    """Whether the static check passed on the workspace as it is now."""
    work = version_dir(layout, version)
    record = work / CHECK_RECORD
    if not record.is_file():
        return False
    recorded = json.loads(record.read_text()).get("workspace")
    return bool(recorded == workspace_state(workspace_dir(layout, version)))


def record_path(layout: Layout, version: str) -> Path:
    return version_dir(layout, version) / TEST_RECORD


def rebased_digest(rebased: Path) -> str:
    """sha256 over every file of ``rebased/`` (pin, series, overlay) with its
    path: what adopt would put in place."""
    digest = hashlib.sha256()
    for path in sorted(p for p in rebased.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(rebased).as_posix()}\n".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def fix_hint(layout: Layout, version: str) -> str:
    """Where a failure of the overlay's tests on a rebase is fixed: in the
    series, or in the rebase's copy of the overlay's tests (whose edits
    rebased_digest covers and adopt puts in place)."""
    ws = workspace_dir(layout, version)
    tests = rebased_dir(layout, version) / "overlay" / "tests"
    return (
        f"fix the series in {ws} and `{layout.command} export --dir {ws}`, or "
        f"the overlay's tests in {tests} "
        "(a new or renamed test's node id goes into ci/overlay-tests.txt)"
    )


def require_pass(layout: Layout, version: str) -> None:
    """Refuse unless the overlay's tests passed on exactly this rebase."""
    rebased = rebased_dir(layout, version)
    record = record_path(layout, version)
    rerun = f"`{layout.command} rebase-test {version}`"
    if not record.is_file():
        raise OverlayError(
            f"{record} does not exist: the overlay's tests have not run on the "
            f"rebase in {rebased}",
            f"run them (the new release's wheel, minutes): {rerun}, then adopt again",
        )
    result = json.loads(record.read_text())
    if result.get("rebased_sha256") != rebased_digest(rebased):
        raise OverlayError(
            f"{rebased} changed since the overlay's tests ran on it ({record})",
            f"test what would be adopted: {rerun}, then adopt again",
        )
    if not result.get("passed"):
        raise OverlayError(
            f"the overlay's tests failed on the rebase in {rebased}: "
            f"{result.get('summary', '')} (log: {result.get('log')})",
            f"{fix_hint(layout, version)}, then {rerun}",
        )
    if not result.get("complete"):
        raise OverlayError(
            f"{record} ran {len(result.get('tests', []))} of the overlay's test "
            "files (--tests); adopt needs them all",
            f"run them all: {rerun}, then adopt again",
        )


def passed(layout: Layout, version: str) -> bool:
    """Whether adopt would accept the overlay's tests' record of this rebase."""
    try:
        require_pass(layout, version)
    except OverlayError:
        return False
    return True


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
