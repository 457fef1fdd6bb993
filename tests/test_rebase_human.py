"""The forward rebase's human steps (``overlay_harness.walkthrough``) and the
start the rebase benchmark gives them (ci/bench/bench_rebase.py): on small
real git workspaces, and on a copy of this checkout. The whole rebase with
them is the benchmark's run; the guide's block as written is
tests/test_walkthrough.py's."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

from conftest import REPO, git, load_bench
from overlay_harness import walkthrough


def _workspace(root: Path, files: dict[str, dict[str, str]]) -> Path:
    """A workspace as ``ci/overlay workspace`` makes one: an ``upstream``
    commit, then one commit per patch (``files``: name -> {path: text})."""
    root.mkdir(parents=True)
    (root / "a.py").write_text("A = 0\n")
    (root / "b.py").write_text("B = 0\n")
    walkthrough.commit_all(root)
    git(root, "commit", "-q", "--amend", "-m", "upstream")
    for name, changes in files.items():
        for rel, text in changes.items():
            (root / rel).write_text(text)
        git(root, "commit", "-q", "-a", "-m", name)
    return root


def test_take_what_differs_takes_only_the_patch_that_differs(tmp_path: Path) -> None:
    # 0002 merged clean onto the release but differs from the other series'
    # 0002: its file is taken, as the other series has it after 0002, into
    # the work tree for the guide's --fixup line; 0001 is left alone.
    ours = _workspace(
        tmp_path / "ws",
        {"0001-a.patch": {"a.py": "A = 1\n"}, "0002-b.patch": {"b.py": "B = 1\n"}},
    )
    theirs = _workspace(
        tmp_path / "theirs",
        {"0001-a.patch": {"a.py": "A = 1\n"}, "0002-b.patch": {"b.py": "B = 2\n"}},
    )
    human = walkthrough.RebaseHuman(
        ours, theirs, "", lambda line: subprocess.CompletedProcess(line, 0)
    )
    assert human.take_what_differs() == ["0002-b.patch"]
    assert git(ours, "status", "--porcelain").split() == ["M", "b.py"]
    assert (ours / "b.py").read_text() == "B = 2\n"


def test_take_tests_puts_the_sources_tests_and_node_ids_in_place(
    tmp_path: Path,
) -> None:
    checkout = tmp_path / "checkout"
    ws = checkout / "build" / "rebase" / "9.9.9" / "workspace"
    old = ws.parent / "rebased" / "overlay" / "tests"
    (old / "v1").mkdir(parents=True)
    (old / "v1" / "test_gone.py").write_text("def test_gone(): pass\n")
    (checkout / "ci").mkdir()
    (checkout / "ci" / "overlay-tests.txt").write_text("v1/test_gone.py::test_gone\n")
    source = tmp_path / "source"
    (source / "overlay" / "tests" / "v1").mkdir(parents=True)
    (source / "overlay" / "tests" / "v1" / "test_new.py").write_text("X = 1\n")
    (source / "ci").mkdir()
    (source / "ci" / "overlay-tests.txt").write_text("v1/test_new.py::test_x\n")
    human = walkthrough.RebaseHuman(
        ws, source, "", lambda line: subprocess.CompletedProcess(line, 0)
    )
    human.take_tests(source)
    assert sorted(p.name for p in old.rglob("*.py")) == ["test_new.py"]
    assert (checkout / "ci" / "overlay-tests.txt").read_text() == (
        "v1/test_new.py::test_x\n"
    )


def test_the_bench_starts_from_the_0_33_0_series_with_todays_tools(
    tmp_path: Path,
) -> None:
    bench = load_bench("bench_rebase")
    root = bench.start_copy(tmp_path / "start")
    start = bench.START
    pin = tomllib.loads((root / "pin.toml").read_text())
    assert pin["upstream"]["version"] == "0.33.0"
    # the main series, file for file, and the node ids are START's
    listed = git(REPO.root, "ls-tree", "--name-only", start, "patches/").split()
    series = [p for p in listed if p != "patches/vllm-cpu"]
    assert sorted(p.name for p in (root / "patches").iterdir() if p.is_file()) == [
        Path(p).name for p in sorted(series)
    ]
    for rel in [*series, "ci/overlay-tests.txt"]:
        assert (root / rel).read_text() == git(REPO.root, "show", f"{start}:{rel}")
    # the other target's series and the tools are this checkout's
    for rel in ("targets/vllm-cpu/patches/series", "ci/overlay_harness/walkthrough.py"):
        assert (root / rel).read_bytes() == (REPO.root / rel).read_bytes()
    assert git(root, "status", "--porcelain", "--untracked-files=no") == ""
    # the guide's block, for the pin's release
    lines = bench.rebase_lines("0.34.0")
    assert lines[0].startswith("ci/overlay rebase-check 0.34.0 --write")
    assert not any("0.32.0" in line for line in lines)
