"""Mutation suite: the overlay's tests must catch each behavioural mistake.

That the overlay's new tests fail on the unpatched tree mostly shows that the
API is new (``TypeError`` on the new keyword). This suite shows they check the
behaviour: it applies each mutant below, one at a time, to a copy of the
patched tree's ``vllm/`` and runs the overlay's tests with that copy ahead of
the installed wheel; every mutant must be killed (a test that passes on the
unmutated copy fails on the mutant). A control run on the unmutated copy
must pass every test. Writes ``<out>.json`` and ``<out>.md`` (which tests
killed which mutant); exits 1 if a mutant survives or the control fails.

    python ci/bench/mutation.py --tree build/tree --python PY --out docs/mutation

Each mutant is an exact text replacement in the patched code. When a patch
changes that code, the mutant no longer applies and the suite stops with an
error naming it: update ``MUTANTS`` here to make the same mistake in the new
code. Run by ``ci/bench.sh``, not by the test run (about 40 minutes here).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from overlay_harness import upstream_tests as ut  # noqa: E402

BLOCK_POOL = "vllm/v1/core/block_pool.py"
OFFLOADING_SCHEDULER = (
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
)


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    file: str
    old: str
    new: str


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "store-every-copy",
        'BlockStored for every copy under every policy (as "physical")',
        BLOCK_POOL,
        'self._stores_every_copy = kv_events_copy_semantics != "logical"',
        "self._stores_every_copy = True",
    ),
    Mutant(
        "remove-every-copy",
        'BlockRemoved for every copy under every policy (as "physical")',
        BLOCK_POOL,
        'self._removes_every_copy = kv_events_copy_semantics == "physical"',
        "self._removes_every_copy = True",
    ),
    Mutant(
        "run-split-off-by-one",
        "the next BlockStored run starts at the already resident block",
        BLOCK_POOL,
        "            start_block = end_block + 1\n",
        "            start_block = end_block\n",
    ),
    Mutant(
        "reset-all-blocks-cleared",
        "a host pool's reset publishes AllBlocksCleared again",
        BLOCK_POOL,
        "        if not self.reset_events_per_key:\n",
        "        if True:\n",
    ),
    Mutant(
        "hit-first-copy",
        "a hit takes the oldest copy, not one in use",
        BLOCK_POOL,
        "        block_id = self._cache.get(key)\n"
        "        return None if block_id is None else self._blocks[block_id]\n",
        "        dup_ids = self._dup_ids.get(key)\n"
        "        block_id = next(iter(dup_ids)) if dup_ids else self._cache.get(key)\n"
        "        return None if block_id is None else self._blocks[block_id]\n",
    ),
    Mutant(
        "first-copy-unmarked",
        "insert marks only the new block when a key gains a second copy, so "
        "the pool never notes the first copy's ref_cnt changes",
        BLOCK_POOL,
        "            first.has_copies = True\n",
        "            pass\n",
    ),
    Mutant(
        "move-drops-key",
        "move_block_hashes removes the keys but does not re-insert them",
        BLOCK_POOL,
        "            self._insert_block_hash(block_hash, dst_block, "
        "num_tokens=num_tokens)\n",
        "            pass\n",
    ),
    Mutant(
        "promotion-gated-on-policy",
        "partial->full promotion announces the partial key's removal only "
        'under "physical", instead of when its last copy goes',
        BLOCK_POOL,
        "                removed_hashes = self._remove_cached_block_hashes(blk)\n"
        "                self._emit_block_removed_events(removed_hashes)\n",
        "                removed_hashes = self._remove_cached_block_hashes(blk)\n"
        "                if self._removes_every_copy:\n"
        "                    self._emit_block_removed_events(removed_hashes)\n",
    ),
    Mutant(
        "sliding-window-mask-ignored",
        "BlockStored lists blocks the sliding-window mask leaves out",
        BLOCK_POOL,
        "            if block_mask is not None and not block_mask["
        "i - num_cached_blocks]:\n                continue\n",
        "",
    ),
    Mutant(
        "surplus-copies-evicted-last",
        "a freed duplicate whose key stays resident goes to the back of the "
        "free queue (0006 undone: it ages out behind unique prefixes)",
        BLOCK_POOL,
        "            # freed.\n            blocks_to_evict_first.append(block)\n",
        "            # freed.\n            blocks_to_evict_last.append(block)\n",
    ),
    Mutant(
        "older-free-copy-kept",
        "when a later copy of the key is freed, the key's older free copy "
        "keeps its LRU place instead of going to the front",
        BLOCK_POOL,
        "                self.free_block_queue.remove(previous)\n"
        "                blocks_to_evict_first.append(previous)\n",
        "                pass\n",
    ),
    Mutant(
        "copy-left-alone-stays-first",
        "a key that loses its copy in use or in LRU place without it being "
        "freed keeps its other copies at the front of the free queue, so the "
        "next allocation evicts its only copy",
        BLOCK_POOL,
        "        if self._unplaced_keys:\n            self._restore_lru_copies()\n",
        "",
    ),
    Mutant(
        "watched-copy-sent-first",
        "a free copy that a reuse watcher still reads (HiSparse's unpinned "
        "page) goes to the front of the free queue like any surplus copy",
        BLOCK_POOL,
        "            if previous.block_hash == key and not "
        "self._keeps_its_place(previous):\n",
        "            if previous.block_hash == key:\n",
    ),
    Mutant(
        "reset-publishes-its-promotions-after",
        "the stores of promotions that a connector reset finishes are "
        "published after the reset's removals",
        OFFLOADING_SCHEDULER,
        "        self.manager.reset_cache()\n"
        "        # The reset finishes the secondary tiers' jobs before it clears the\n"
        "        # primary tier, so a promotion stores its chunks there on the way:\n"
        "        # count those stores too, so the removals below cover them.\n"
        "        self._events_tracker.queue_events(self.manager.take_events())\n",
        "        self.manager.reset_cache()\n",
    ),
)


class MutantError(Exception):
    pass


def mutated(text: str, mutant: Mutant) -> str:
    """``text`` with the mutant applied; loud when it no longer applies."""
    count = text.count(mutant.old)
    if count != 1:
        raise MutantError(
            f"mutant {mutant.name} no longer applies to {mutant.file} (its text "
            f"occurs {count} times, not once): update it in ci/bench/mutation.py"
        )
    return text.replace(mutant.old, mutant.new)


def _imports_from(python: Path, env: dict[str, str], cwd: Path, src: Path) -> None:
    proc = subprocess.run(
        [str(python), "-c", "import vllm.v1.core.block_pool as m; print(m.__file__)"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    where = Path(proc.stdout.strip() or "?").resolve()
    if proc.returncode != 0 or not where.is_relative_to(src.resolve()):
        raise MutantError(
            f"vllm does not import from the mutated copy {src} "
            f"(got {where}): {proc.stderr[-1000:]}"
        )


def run_tests(
    python: Path,
    test_tree: Path,
    src: Path,
    tests: list[str],
    work: Path,
    pytest_args: tuple[str, ...] = (),
) -> dict[str, str]:
    """Outcome per node id of ``tests``, with ``src`` ahead of the wheel."""
    env = ut._run_env(test_tree)
    env["PYTHONPATH"] = f"{src}:{env['PYTHONPATH']}"
    _imports_from(python, env, test_tree, src)
    junit = work / "junit.xml"
    junit.unlink(missing_ok=True)
    cmd = [
        str(python), "-m", "pytest", "-p", "overlay_harness.pytest_cpu",
        "-p", "no:cacheprovider", "-n", str(ut.XDIST_WORKERS),
        f"--timeout={ut.PER_TEST_TIMEOUT_S}", f"--junitxml={junit}",
        "-o", "junit_family=xunit1", "-o", "junit_logging=no", "-q",
        *pytest_args, *tests,
    ]  # fmt: skip
    with (work / "pytest.log").open("w") as log:
        subprocess.run(cmd, cwd=test_tree, env=env, stdout=log, stderr=log)
    if not junit.is_file():
        raise MutantError(f"pytest left no result; see {work / 'pytest.log'}")
    return {k: r.outcome for k, r in ut.parse_junit(junit, test_tree).items()}


def render(report: dict[str, Any]) -> str:
    lines = [
        "# Mutation suite",
        "",
        "Generated by `ci/bench/mutation.py` (run by `ci/bench.sh`); do not edit.",
        f"Run {report['date']} UTC, {report['wall_s']:.0f} s: `{report['command']}`.",
        "",
        "Each mutant below is applied alone to a copy of the patched tree; the "
        "overlay's tests run against it. "
        + (
            "A test kills a mutant when it fails on it. No control run in this "
            "mode: that the same tests pass on the unmutated tree is the test "
            "run's (`ci/test.sh`, every test in `ci/overlay-tests.txt`)."
            if report["first_killer_only"]
            else "A test kills a mutant when it passes on the unmutated copy (the "
            f"control run: {report['control_passed']} of {report['tests']} "
            "passed) and fails on the mutant."
        ),
        "",
        (
            "Each mutant's run stopped at its first failure (`--first-killer`), "
            "so a test named below kills it; others may too."
            if report["first_killer_only"]
            else "Each mutant's run is complete: every test that kills it is named."
        ),
        "",
        "| mutant | the mistake | killed by |",
        "|---|---|---|",
    ]
    for m in report["mutants"]:
        lines.append(f"| `{m['name']}` | {m['what']} | {len(m['killed_by'])} tests |")
    for m in report["mutants"]:
        lines += ["", f"## `{m['name']}` ({m['file']})", ""]
        lines += [f"- `{t}`" for t in m["killed_by"]] or ["- SURVIVED"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, required=True, help="the patched tree")
    ap.add_argument("--python", type=Path, required=True, help="the test venv's")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json, OUT.md")
    ap.add_argument("--overlay", type=Path, default=Path("overlay"))
    ap.add_argument(
        "--first-killer",
        action="store_true",
        help="stop each mutant's run at its first failure, and skip the control "
        "run (minutes, not an hour): shows that a test fails on each mutant, not "
        "every test that does; the unmutated tests' passing is then ci/test.sh's",
    )
    ap.add_argument(
        "--mutant",
        action="append",
        choices=[m.name for m in MUTANTS],
        help="run only this mutant (repeatable; every mutant must still apply)",
    )
    args = ap.parse_args(argv)
    selected = [m for m in MUTANTS if not args.mutant or m.name in args.mutant]
    started, t0 = dt.datetime.now(dt.UTC), time.monotonic()
    # The event tests first: with --first-killer a mutant's run stops sooner.
    tests = sorted(
        (
            p.relative_to(args.overlay).as_posix()
            for p in args.overlay.rglob("test_*.py")
        ),
        key=lambda t: ("identity" in t, t),
    )
    try:
        sources = {m.file: (args.tree / m.file).read_text() for m in MUTANTS}
        texts = {m.name: mutated(sources[m.file], m) for m in MUTANTS}
        with tempfile.TemporaryDirectory(prefix="vllm-mutation-") as tmp:
            work = Path(tmp)
            src = work / "src"
            shutil.copytree(
                args.tree / "vllm", src / "vllm",
                ignore=shutil.ignore_patterns("__pycache__"),
            )  # fmt: skip
            test_tree = ut.build_test_tree(args.tree, work / "test-tree")
            control: dict[str, str] = {}
            if not args.first_killer:
                print("control run (unmutated copy)", file=sys.stderr)
                control = run_tests(args.python, test_tree, src, tests, work)
            passed = sorted(k for k, o in control.items() if o == "passed")
            if len(passed) != len(control):
                raise MutantError(
                    "the control run did not pass every test: "
                    f"{sorted(set(control) - set(passed))[:10]}"
                )
            results = []
            maxfail = ("--maxfail=1",) if args.first_killer else ()
            for m in selected:
                print(f"mutant {m.name}", file=sys.stderr)
                target = src / m.file
                target.write_text(texts[m.name])
                try:
                    outcome = run_tests(
                        args.python, test_tree, src, tests, work, maxfail
                    )
                finally:
                    target.write_text(sources[m.file])
                # A test that failed, or a file that no longer collects; with
                # --first-killer the tests after the first failure never ran,
                # which kills nothing.
                killers = sorted(
                    t
                    for t, o in outcome.items()
                    if o in ("failed", "error")
                    and (args.first_killer or t in control or "::" not in t)
                )
                results.append({**dataclasses.asdict(m), "killed_by": killers})
                print(f"  killed by {len(killers)} tests", file=sys.stderr)
    except (MutantError, ut.HarnessError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = {
        "date": f"{started:%Y-%m-%d %H:%M}",
        "wall_s": time.monotonic() - t0,
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "tests": len(control) or None,
        "first_killer_only": args.first_killer,
        "control_passed": len(passed),
        "mutants": [
            {k: v for k, v in r.items() if k not in ("old", "new")} for r in results
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(report))
    survivors = [r["name"] for r in results if not r["killed_by"]]
    if survivors:
        print(f"SURVIVED: {', '.join(survivors)}", file=sys.stderr)
        return 1
    print(f"every mutant killed; wrote {args.out}.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
