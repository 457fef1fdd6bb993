"""The maintainer guide's walkthrough, run as written (docs/maintainers.md,
recipes 1 and 3 to 5): every line of each
``<!-- walkthrough: NAME -->`` block runs in a copy of this checkout, in
order, on the real pinned release and the real 0.32.0 sdist (fetched and
sha256-checked by the tooling, as a maintainer's run would). A ``#`` line is
a human step: the test does it (an edit, a conflict resolution) and says
how below. So the documentation cannot drift from the tools."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import REPO
from vllm_overlay import series
from vllm_overlay.paths import Layout, copy_checkout

pytestmark = pytest.mark.real_release
_BLOCK = re.compile(r"<!-- walkthrough: (\w+) -->\n```sh\n(.*?)```", re.S)
_IDENTITY = {
    "GIT_AUTHOR_NAME": "Maintainer",
    "GIT_AUTHOR_EMAIL": "maintainer@example.invalid",
    "GIT_COMMITTER_NAME": "Maintainer",
    "GIT_COMMITTER_EMAIL": "maintainer@example.invalid",
}
FILLED_HEADER = """\
Description: note which overlay built this tree
Author: Maintainer <maintainer@example.invalid>
Forwarded: not-needed, the walkthrough's own example
Last-Update: 2026-12-01
---
"""


GUIDE = REPO.root / "docs" / "maintainers.md"


def walkthrough_blocks() -> dict[str, list[str]]:
    blocks = _BLOCK.findall(GUIDE.read_text())
    names = [name for name, _ in blocks]
    assert len(set(names)) == len(names), f"{GUIDE}: a walkthrough name twice"
    return {name: body.splitlines() for name, body in blocks}


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
        result = subprocess.run(
            line,
            shell=True,
            cwd=layout.root,
            capture_output=True,
            text=True,
            env={**os.environ, **_IDENTITY, "GIT_EDITOR": f"{sys.executable} {editor}"},
        )
        if "# stops" not in line:
            assert result.returncode == 0, f"{line}\n{result.stdout}{result.stderr}"
        results.append(result)
    assert human == [], f"block {name} has fewer human steps than the test"
    return results


def take_the_patch_side(tree: Path) -> list[str]:
    """Resolve every conflict in ``tree`` as the patch has it: keep the lines
    between ``=======`` and ``>>>>>>>`` (patch --merge's markers)."""
    files = subprocess.run(
        ["git", "-C", str(tree), "diff", "--name-only"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
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
    return copy_checkout(REPO, tmp_path / "checkout", REPO.cache)


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
    assert walkthrough_blocks().keys() == {"add", "refresh", "conflict", "rebase"}
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

    # Add: a new file, committed as 0007 with the header filled in.
    note = ws / "vllm" / "overlay_walkthrough_note.py"
    run_block(
        checkout,
        "add",
        [lambda: note.write_text('NOTE = "built with the overlay series"\n')],
        editor,
    )
    after_add = series.load_series(checkout.patches)
    assert [p.name for p in after_add] == [*names, "0007-short-name.patch"]
    assert after_add[-1].header["Description"].startswith("note which overlay")
    assert after_add[-1].targets == ("vllm/overlay_walkthrough_note.py",)
    for name in names:
        assert (checkout.patches / name).read_bytes() == original[name]

    # Rebase to the real 0.32.0: --write stops at 0002's conflict with the
    # later patches unapplied; the human resolves (patch's side), continues,
    # exports, leaves the torch fields as they are, adopts; then the new
    # series applies to 0.32.0 with zero fuzz.
    rebase_ws = checkout.build / "rebase" / "0.32.0" / "workspace"
    written, *_ = run_block(
        checkout,
        "rebase",
        [lambda: take_the_patch_side(rebase_ws), lambda: None],
        editor,
    )
    assert f"{names[1]}: conflict" in written.stdout
    assert "vllm/v1/core/block_pool.py  @@ " in written.stdout
    assert f"stopped: {names[1]} does not apply" in written.stderr
    # the patches after 0002, the added one included, unrefreshed
    assert f"{len(names) - 1} later patches wait" in written.stderr
    rebased = series.load_series(checkout.patches)
    assert [p.name for p in rebased] == [*names, "0007-short-name.patch"]
    assert 'version = "0.32.0"' in checkout.pin.read_text()
    assert (checkout.tree / "vllm" / "overlay_walkthrough_note.py").is_file()
