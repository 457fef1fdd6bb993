"""The maintainer round trip: series -> git workspace -> series, and the
ways it must never lose work."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import (
    LINES,
    REPO,
    as_maintainer,
    hint_commands,
    make_patch,
    set_commit_short,
    write_series,
)
from vllm_overlay import apply, series, source, workspace
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout
from vllm_overlay.pin import load_pin

FIRST = make_patch(LINES, LINES.replace("line 5\n", "line five\n"))
SECOND = make_patch(
    LINES.replace("line 5\n", "line five\n"),
    LINES.replace("line 5\n", "line five\n").replace(
        "line 25\n", "line 25\nline 25.5\n"
    ),
)
# Three independent patches of three files, for the series-keeping tests.
THREE = {
    f"000{i}-p{i}.patch": make_patch(
        LINES, LINES.replace("line 10\n", f"line ten {i}\n"), path=f"pkg/f{i}.py"
    )
    for i in (1, 2, 3)
}


def _workspace(layout: Layout, upto: str | None = None) -> Path:
    pin = load_pin(layout.pin)
    source.fresh_dir(layout.workspace)
    source.lay_scratch_tree(layout.root, pin, layout.downloads, layout.workspace)
    workspace.make_workspace(
        layout.workspace, series.load_series(layout.patches), upto, layout.patches
    )
    return layout.workspace


def _upstream(layout: Layout, files: dict[str, str] | str) -> None:
    """A synthetic upstream/ checkout (pkg/mod.py, or the given files), pinned."""
    if isinstance(files, str):
        files = {"mod.py": files}
    repo = layout.root / "upstream"
    (repo / "pkg").mkdir(parents=True)
    for name, text in files.items():
        (repo / "pkg" / name).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "v0"], check=True)
    head = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    set_commit_short(layout, head[:9])


def with_tooling(layout: Layout) -> Layout:
    """Give a synthetic checkout its own copy of the tooling, so commands
    printed as ``ci/overlay ...`` run in it exactly as printed."""
    shutil.copytree(
        REPO.root / "ci" / "vllm_overlay",
        layout.root / "ci" / "vllm_overlay",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    shutil.copy2(REPO.root / "ci" / "overlay", layout.root / "ci" / "overlay")
    return layout


def sh(layout: Layout, command: str, ok: bool = True) -> subprocess.CompletedProcess:
    """Run a printed command line in the checkout, as a maintainer would."""
    return as_maintainer(command, layout.root, ok)


def _export_is_identity(layout: Layout) -> None:
    before = {p.name: p.read_bytes() for p in layout.patches.iterdir()}
    _workspace(layout)
    workspace.export(layout.workspace)
    after = {p.name: p.read_bytes() for p in layout.patches.iterdir()}
    assert after == before


def test_round_trip_is_byte_identical(checkout: Layout) -> None:
    _upstream(checkout, LINES)
    write_series(checkout, {"0001-first.patch": FIRST, "0002-second.patch": SECOND})
    _workspace(checkout)
    workspace.export(checkout.workspace)  # normalise once
    shutil.rmtree(checkout.workspace)
    _export_is_identity(checkout)
    for patch in series.load_series(checkout.patches):
        assert series.header_problems(patch) == []


def test_export_refreshes_an_offset_patch(checkout: Layout) -> None:
    _upstream(checkout, "a new first line\n" + LINES)
    write_series(checkout, {"0001-first.patch": FIRST})
    (patch,) = series.load_series(checkout.patches)
    tree = checkout.build / "probe"
    source.lay_scratch_tree(
        checkout.root, load_pin(checkout.pin), checkout.downloads, tree
    )
    assert apply.classify(tree, patch).fit is apply.Fit.OFFSET
    workspace.export(_workspace(checkout))
    (patch,) = series.load_series(checkout.patches)
    assert apply.classify(tree, patch).fit is apply.Fit.CLEAN
    assert patch.header["Description"] == "test patch"


def test_new_patch_joins_the_series(checkout: Layout) -> None:
    _upstream(checkout, LINES)
    write_series(checkout, {"0001-first.patch": FIRST})
    ws = _workspace(checkout)
    (ws / "pkg" / "mod.py").write_text((ws / "pkg" / "mod.py").read_text() + "end\n")
    workspace.new_patch(ws, "0002-append.patch")
    workspace.export(ws)
    names = [p.name for p in series.load_series(checkout.patches)]
    assert names == ["0001-first.patch", "0002-append.patch"]
    (_, new) = series.load_series(checkout.patches)
    assert "template text" in " ".join(series.header_problems(new))
    assert (checkout.patches / "series").read_text().startswith("# test series\n")


def test_new_refuses_a_taken_name_before_touching_anything(checkout: Layout) -> None:
    _upstream(checkout, LINES)
    write_series(checkout, {"0001-first.patch": FIRST})
    ws = _workspace(checkout)
    (ws / "pkg" / "mod.py").write_text("edited\n")
    with pytest.raises(OverlayError, match="0001-first.patch is taken") as e:
        workspace.new_patch(ws, "0001-first.patch")
    assert "ci/overlay new 0002-first.patch" in e.value.next_step
    assert (ws / "pkg" / "mod.py").read_text() == "edited\n"


def test_the_refresh_hint_as_printed_keeps_the_whole_series(checkout: Layout) -> None:
    """Defect 1: the build's hint for a patch that needs fuzz, run as
    printed, gives back every patch of the series, refreshed."""
    with_tooling(checkout)
    fuzzed = LINES.replace("line 12\n", "line twelve\n")  # context of p2's hunk
    _upstream(checkout, {"f1.py": LINES, "f2.py": fuzzed, "f3.py": LINES})
    write_series(checkout, THREE)
    tree = checkout.build / "probe"
    source.lay_scratch_tree(
        checkout.root, load_pin(checkout.pin), checkout.downloads, tree
    )
    with pytest.raises(OverlayError, match="0002-p2.patch: does not apply") as e:
        apply.apply_series(tree, series.load_series(checkout.patches))
    commands = hint_commands(e.value.next_step)
    assert commands == ["ci/overlay workspace", "ci/overlay export"]
    for command in commands:
        sh(checkout, command)
    assert series.read_series(checkout.patches) == list(THREE)
    shutil.rmtree(tree)
    source.lay_scratch_tree(
        checkout.root, load_pin(checkout.pin), checkout.downloads, tree
    )
    apply.apply_series(tree, series.load_series(checkout.patches))  # zero fuzz now


def test_export_never_shortens_the_series_unless_told(checkout: Layout) -> None:
    _upstream(checkout, {"f1.py": LINES, "f2.py": LINES, "f3.py": LINES})
    write_series(checkout, THREE)
    ws = _workspace(checkout, upto="0001-p1.patch")
    with pytest.raises(OverlayError, match="not applied 0002-p2.patch, 0003-p3"):
        workspace.export(ws)
    workspace.continue_workspace(ws, skip=False)
    workspace.git(ws, "reset", "-q", "--hard", "HEAD~1")  # the last commit gone
    with pytest.raises(OverlayError, match="would remove 0003-p3.patch") as e:
        workspace.export(ws)
    assert hint_commands(e.value.next_step)[-1] == (
        f"ci/overlay export --dir {ws} --drop 0003-p3.patch"
    )
    assert series.read_series(checkout.patches) == list(THREE)
    workspace.export(ws, drop=["0003-p3.patch"])
    assert series.read_series(checkout.patches) == ["0001-p1.patch", "0002-p2.patch"]


def test_workspace_refuses_to_discard_work(checkout: Layout) -> None:
    """Defect 2: remaking the workspace names what it would lose."""
    with_tooling(checkout)
    _upstream(checkout, {"f1.py": LINES, "f2.py": LINES, "f3.py": LINES})
    write_series(checkout, THREE)
    sh(checkout, "ci/overlay workspace")
    ws = checkout.workspace
    (ws / "pkg" / "f1.py").write_text("uncommitted edit\n")
    (ws / "pkg" / "new.py").write_text("new file\n")
    refused = sh(checkout, "ci/overlay workspace", ok=False)
    assert refused.returncode == 1
    assert "uncommitted: M pkg/f1.py" in refused.stderr
    assert "uncommitted: ?? pkg/new.py" in refused.stderr
    assert (ws / "pkg" / "new.py").exists()
    amend, new, export, force = hint_commands(refused.stderr.split("next:")[1])
    assert (new, export) == ("ci/overlay new NNNN-name.patch", "ci/overlay export")
    assert force == "ci/overlay workspace --force"
    sh(checkout, amend)  # as printed
    refused = sh(checkout, "ci/overlay workspace", ok=False)
    assert "unexported commit: 0003-p3.patch" in refused.stderr
    assert hint_commands(refused.stderr.split("next:")[1]) == [export, force]
    assert (ws / "pkg" / "new.py").exists()
    sh(checkout, "ci/overlay export")
    sh(checkout, "ci/overlay workspace")  # everything saved: no refusal
    (ws / "pkg" / "f1.py").write_text("throw me away\n")
    sh(checkout, "ci/overlay workspace --force")
    assert (ws / "pkg" / "f1.py").read_text() != "throw me away\n"


def _stop_at_p2(checkout: Layout) -> subprocess.CompletedProcess:
    """`ci/overlay workspace` on THREE where upstream changed the very line
    0002's hunk changes: it stops there."""
    with_tooling(checkout)
    _upstream(
        checkout,
        {
            "f1.py": LINES,
            "f2.py": LINES.replace("line 10\n", "LINE 10\n"),
            "f3.py": LINES,
        },
    )
    write_series(checkout, THREE)
    return sh(checkout, "ci/overlay workspace", ok=False)


def test_conflict_then_continue_then_export(checkout: Layout) -> None:
    """Defect 3: stop at a conflict with markers in the file, resolve,
    `--continue` applies the rest, export gives the whole series."""
    stopped = _stop_at_p2(checkout)
    assert stopped.returncode == 1
    assert "0002-p2.patch does not apply" in stopped.stderr
    assert "conflict markers in pkg/f2.py" in stopped.stderr
    ws = checkout.workspace
    assert "<<<<<<<" in (ws / "pkg" / "f2.py").read_text()
    (hint,) = [line for line in stopped.stderr.splitlines() if "next:" in line]
    commands = hint_commands(hint)
    assert commands[-1] == f"ci/overlay workspace --continue --dir {ws}"
    early = sh(checkout, commands[-1], ok=False)  # markers still there
    assert "still has conflict markers" in early.stderr
    (ws / "pkg" / "f2.py").write_text(
        LINES.replace("line 10\n", "line ten 2\n")
    )  # the resolution
    sh(checkout, commands[-1])
    assert (ws / "pkg" / "f3.py").read_text() != LINES  # 0003 applied too
    sh(checkout, "ci/overlay export")
    assert series.read_series(checkout.patches) == list(THREE)
    (p2,) = [
        p for p in series.load_series(checkout.patches) if p.name == "0002-p2.patch"
    ]
    assert "-LINE 10\n+line ten 2\n" in p2.path.read_text()
    assert p2.header["Description"] == "test patch"


def test_skip_leaves_a_patch_out_only_when_told(checkout: Layout) -> None:
    _upstream(checkout, {"f1.py": LINES, "f3.py": LINES})  # f2.py gone upstream
    write_series(checkout, THREE)
    with pytest.raises(OverlayError, match="target file gone"):
        _workspace(checkout)
    ws = checkout.workspace
    with pytest.raises(OverlayError, match="has no changes for 0002-p2.patch"):
        workspace.continue_workspace(ws, skip=False)
    workspace.continue_workspace(ws, skip=True)
    workspace.export(ws)
    assert series.read_series(checkout.patches) == ["0001-p1.patch", "0003-p3.patch"]


def test_fuzz_is_quilts_two_at_most_and_each_use_is_named(
    checkout: Layout, capsys: pytest.CaptureFixture[str]
) -> None:
    """One changed context line: the hunk goes in with fuzz 1 and a warning
    naming its file and header."""
    write_series(checkout, {"0001-five.patch": FIRST})
    _upstream(checkout, LINES.replace("line 2\n", "line two\n"))
    _workspace(checkout)
    assert (
        "  warning: 0001-five.patch: pkg/mod.py @@ -2,7 +2,7 @@: applied at line 2 "
        "with fuzz 1" in capsys.readouterr().err
    )


def test_a_hunk_without_its_context_stops(checkout: Layout) -> None:
    """Every context line above the change changed: fuzz 3 would land the
    hunk by its line number alone; the workspace stops at it instead."""
    write_series(checkout, {"0001-five.patch": FIRST})
    moved = LINES
    for n in (2, 3, 4):
        moved = moved.replace(f"line {n}\n", f"moved {n}\n")
    _upstream(checkout, moved)
    with pytest.raises(
        OverlayError, match=r"0001-five.patch does not apply .*conflict"
    ):
        _workspace(checkout)


def test_export_never_reverts_a_change_it_did_not_make(checkout: Layout) -> None:
    """A patch changed in patches/ after the workspace was made (a hand
    edit, a git pull): export refuses, naming it, and writes nothing;
    --force overwrites it with the workspace's version."""
    write_series(checkout, THREE)
    _upstream(checkout, {f"f{i}.py": LINES for i in (1, 2, 3)})
    ws = _workspace(checkout)
    pulled = checkout.patches / "0002-p2.patch"
    pulled.write_text(pulled.read_text().replace("test patch", "a pulled fix"))
    before = {p.name: p.read_bytes() for p in checkout.patches.iterdir()}
    with pytest.raises(OverlayError, match=r"0002-p2.patch changed since") as e:
        workspace.export(ws)
    assert "0001" not in e.value.what and "--force" in e.value.next_step
    assert {p.name: p.read_bytes() for p in checkout.patches.iterdir()} == before
    workspace.export(ws, force=True)
    assert pulled.read_text() == workspace.exported_texts(ws)["0002-p2.patch"]
    # what export wrote is what the next export compares with
    workspace.export(ws)


def test_patch_leftovers_are_no_work(checkout: Layout) -> None:
    """The .orig and .rej files GNU patch leaves do not block export and
    are not committed by `new`."""
    write_series(checkout, {"0001-five.patch": FIRST})
    _upstream(checkout, LINES)
    ws = _workspace(checkout)
    workspace.export(ws)  # the fixture's patch, in export format
    (ws / "pkg" / "mod.py.orig").write_text(LINES)
    (ws / "pkg" / "mod.py.rej").write_text("--- a hunk\n")
    assert workspace.unsaved_work(ws) == []
    workspace.export(ws)
    (ws / "pkg" / "new.py").write_text("NEW = 1\n")
    workspace.new_patch(ws, "0002-new.patch")
    workspace.export(ws)
    assert series.load_series(checkout.patches)[-1].targets == ("pkg/new.py",)


def test_workspace_git_never_starts_housekeeping(checkout: Layout) -> None:
    """The workspace repository's own config, read by any git command run
    in it (the README's `commit --amend` too), turns automatic gc and
    maintenance off."""
    write_series(checkout, {"0001-five.patch": FIRST})
    _upstream(checkout, LINES)
    ws = _workspace(checkout)

    def config(key: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ws), "config", "--local", key],
            capture_output=True,
            text=True,
        ).stdout.strip()

    assert (config("gc.auto"), config("maintenance.auto")) == ("0", "false")


def test_remaking_reuses_the_tree_and_waits_for_git(checkout: Layout) -> None:
    """`workspace --force` on a workspace of the same release resets it in
    place (the untouched files keep their inodes: nothing unpacked again)
    and gives the same workspace; while a git process holds a lock there it
    refuses, naming the lock, and leaves the workspace as it is."""
    with_tooling(checkout)
    _upstream(checkout, {f"f{i}.py": LINES for i in (1, 2, 3, 4)})
    write_series(checkout, THREE)
    sh(checkout, "ci/overlay workspace")
    ws = checkout.workspace
    head = workspace.git(ws, "rev-parse", "HEAD")
    untouched = (ws / "pkg" / "f4.py").stat().st_ino  # no patch changes it
    (ws / "pkg" / "f2.py").write_text("an edit to discard\n")
    (ws / "pkg" / "stray.py").write_text("stray\n")
    lock = ws / ".git" / "index.lock"
    lock.write_text("")
    refused = sh(checkout, "ci/overlay workspace --force", ok=False)
    assert refused.returncode == 1
    assert f"a git process is working in {ws} (it holds {lock})" in refused.stderr
    assert (ws / "pkg" / "stray.py").exists()
    lock.unlink()
    remade = sh(checkout, "ci/overlay workspace --force")
    assert "reused the upstream/ at" in remade.stderr
    assert (ws / "pkg" / "f4.py").stat().st_ino == untouched
    assert not (ws / "pkg" / "stray.py").exists()
    assert workspace.git(ws, "rev-parse", "HEAD") == head
    assert workspace.git(ws, "status", "--porcelain") == ""


@pytest.mark.parametrize("edited", [False, True], ids=["as-stopped", "edited"])
def test_the_skip_hint_works_as_printed_after_a_conflict(
    checkout: Layout, edited: bool
) -> None:
    """The stop's `--skip` hint, pasted, leaves the conflicting patch out
    (the markers the stop wrote go with it); after a human's edit it
    refuses, and its own hint, pasted, gets there too."""
    stopped = _stop_at_p2(checkout)
    skip = hint_commands(stopped.stderr.split("next:")[1])[0]
    assert skip.endswith(" --skip")
    ws = checkout.workspace
    if edited:
        (ws / "pkg" / "f1.py").write_text("a human's edit\n")
        refused = sh(checkout, skip, ok=False)
        assert "would throw away edits made in" in refused.stderr
        for command in hint_commands(refused.stderr.split("next:")[1])[:2]:
            sh(checkout, command)
    else:
        sh(checkout, skip)
    sh(checkout, "ci/overlay export --drop 0002-p2.patch")
    assert series.read_series(checkout.patches) == ["0001-p1.patch", "0003-p3.patch"]
    assert "<<<<<<<" not in (ws / "pkg" / "f2.py").read_text()
