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
import collections
import dataclasses
import datetime as dt
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib as bl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from overlay_harness import upstream_tests as ut  # noqa: E402
from vllm_overlay import rebase  # noqa: E402
from vllm_overlay.errors import OverlayError  # noqa: E402
from vllm_overlay.paths import default_layout  # noqa: E402

BLOCK_POOL = "vllm/v1/core/block_pool.py"
OFFLOADING_SCHEDULER = (
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
)
HISPARSE_POOL = "vllm/v1/hisparse/block_pool.py"
CONSUMER = "vllm/distributed/kv_events_consumer.py"


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    file: str
    old: str
    new: str
    # Further (old, new) replacements in the same file, each exact and once.
    also: tuple[tuple[str, str], ...] = ()


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


OFFLOADING_EVENTS = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py"
# 0005's tracker state, which git put after a `return` of a new method.
_TRACKER_INIT = (
    '        self._stores_every_copy = config.copy_semantics != "logical"\n'
    '        self._removes_every_copy = config.copy_semantics == "physical"\n'
    "        # Copies announced (BlockStored) and not yet removed, per hash and\n"
    '        # tier. The gates of "logical" and "last_copy" read every tier\'s;\n'
    '        # under "physical" only the reset reads them, the primary tier\'s, so\n'
    "        # no other tier is counted.\n"
    "        self._announced: dict[_AnnouncedKey, int] = {}\n"
    '        self._counts_every_tier = config.copy_semantics != "physical"\n'
    "        # Events translated ahead of the next take_events(): the manager's\n"
    "        # backlog at a reset, then the reset's removals.\n"
    "        self._queued: list[KVCacheEvent] = []\n"
)
_METADATA_FOR_END = (
    "        chunk_idx = boundary // group_config.tokens_per_chunk - 1\n"
    "        return self._build_event_metadata(state, group_config, chunk_idx)\n"
)
_TRACKER_BETWEEN = (
    "\n    def on_new_request(\n"
    "        self,\n"
    "        req_context: ReqContext,\n"
    "        request: Request,\n"
    '        group_configs: tuple["GroupOffloadConfig", ...],\n'
    "    ) -> None:\n"
)

# The silent breakages that a clean 3-way merge of the 0.33.0 series onto
# vLLM 0.34.0 produced (issue 30: no conflict marker, every one compiled),
# each remade in today's code, and two that a maintainer's trial merged and
# the gate once missed (issue 42: a HiSparse pool with a free_blocks of its
# own, a consumer reading a misnamed field): the gate before adopt
# (`ci/overlay rebase-test`: compile and ruff F821, then the overlay's
# tests) must fail on each. `--set merge` runs them
# (docs/merge-mutation.md).
MERGE_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "0002-num-copies-len-of-id",
        "0002: num_copies() keeps 0.33.0's body and calls len() on the block "
        "id that `_cache` now holds",
        BLOCK_POOL,
        "        dup_ids = self._dup_ids.get(key)\n"
        "        if dup_ids is not None:\n"
        "            return len(dup_ids)\n"
        "        return 1 if key in self._cache else 0\n",
        "        blocks = self._cache.get(key)\n"
        "        if blocks is None:\n"
        "            return 0\n"
        "        if isinstance(blocks, KVCacheBlock):\n"
        "            return 1\n"
        "        return len(blocks)\n",
    ),
    Mutant(
        "0002-old-extra-keys-name",
        "0002: the moved event code calls the old name "
        "`_generate_event_extra_keys` (0.34.0: `generate_event_extra_keys`)",
        BLOCK_POOL,
        "            new_hashes.append(maybe_convert_block_hash(block_hashes[i]))\n"
        "            block_start = i * block_size\n"
        "            block_end = block_start + block_size\n"
        "            extra_keys, curr_mm_idx = self.generate_event_extra_keys(\n",
        "            new_hashes.append(maybe_convert_block_hash(block_hashes[i]))\n"
        "            block_start = i * block_size\n"
        "            block_end = block_start + block_size\n"
        "            extra_keys, curr_mm_idx = self._generate_event_extra_keys(\n",
    ),
    Mutant(
        "0002-old-lookahead-name",
        "0002: the moved event code calls the old name `_lookahead_token_ids` "
        "(0.34.0: `get_lookahead_token_ids`)",
        BLOCK_POOL,
        "            extra_keys_list.append(extra_keys)\n"
        "            if lookahead_token_ids is not None:\n"
        "                lookahead_token_ids.append(\n"
        "                    self.get_lookahead_token_ids(request, block_end)\n"
        "                )\n"
        "        return self._build_block_stored_event(\n",
        "            extra_keys_list.append(extra_keys)\n"
        "            if lookahead_token_ids is not None:\n"
        "                lookahead_token_ids.append(\n"
        "                    self._lookahead_token_ids(request, block_end)\n"
        "                )\n"
        "        return self._build_block_stored_event(\n",
    ),
    Mutant(
        "0004-private-block-hash",
        "0004: _note_ref_change reads `block._block_hash`, gone in 0.34.0 "
        "(a plain `block_hash` attribute)",
        BLOCK_POOL,
        "        cache.note_ref_change(block.block_hash, block_id, in_use)\n",
        "        cache.note_ref_change(block._block_hash, block_id, in_use)\n",
    ),
    Mutant(
        "0004-evict-first-unnoted",
        "0004: upstream's new `evict_first` branch of free_blocks frees a copy "
        "without noting its ref change",
        BLOCK_POOL,
        "        if evict_first:\n"
        "            self._note_ref_change(block, in_use=False)\n"
        "            blocks_to_evict_first.append(block)\n",
        "        if evict_first:\n            blocks_to_evict_first.append(block)\n",
    ),
    Mutant(
        "0005-init-after-return",
        "0005: the tracker's __init__ lines landed after the last `return` "
        "of `_metadata_for`, so they never run",
        OFFLOADING_EVENTS,
        "\n" + _TRACKER_INIT + _TRACKER_BETWEEN,
        _TRACKER_BETWEEN,
        also=((_METADATA_FOR_END, _METADATA_FOR_END + _TRACKER_INIT),),
    ),
    Mutant(
        "0005-lookahead-not-sliced",
        "0005: _stored_run copies `lookahead_token_ids` whole into each run "
        "instead of slicing it with the hashes",
        OFFLOADING_EVENTS,
        "            lookahead_token_ids=(\n"
        "                event.lookahead_token_ids[start:stop]\n"
        "                if event.lookahead_token_ids is not None\n"
        "                else None\n"
        "            ),\n"
        "        )\n",
        "        )\n",
    ),
    Mutant(
        "0006-copies-dropped-at-one",
        "0006/0004: a key's referenced_copies/lru_copies entries go when it is "
        "down to one copy (as upstream drops `_dup_ids`), not with its last",
        BLOCK_POOL,
        "            if len(dup_ids) == 1:\n                del self._dup_ids[key]\n",
        "            if len(dup_ids) == 1:\n"
        "                del self._dup_ids[key]\n"
        "                self.referenced_copies.pop(key, None)\n"
        "                self.lru_copies.pop(key, None)\n",
    ),
    Mutant(
        "0006-clear-keeps-referenced",
        "0006/0004: the in-place clear() on reset leaves referenced_copies",
        BLOCK_POOL,
        "        self._dup_ids.clear()\n        self.referenced_copies.clear()\n",
        "        self._dup_ids.clear()\n",
    ),
    Mutant(
        "0006-clear-keeps-lru",
        "0006: the in-place clear() on reset leaves lru_copies",
        BLOCK_POOL,
        "        self.referenced_copies.clear()\n        self.lru_copies.clear()\n",
        "        self.referenced_copies.clear()\n",
    ),
    Mutant(
        "hisparse-free-blocks-lru",
        "a release's HiSparse host pool overrides free_blocks with a plain LRU "
        "append, bypassing the series' ordering of surplus copies",
        HISPARSE_POOL,
        "    shares_event_queue = True\n    reset_events_per_key = True\n",
        "    shares_event_queue = True\n"
        "    reset_events_per_key = True\n"
        "\n"
        "    def free_blocks(self, ordered_blocks, evict_first=False):\n"
        "        freed = []\n"
        "        for block in ordered_blocks:\n"
        "            if block.is_null:\n"
        "                continue\n"
        "            block.ref_cnt -= 1\n"
        "            if block.ref_cnt == 0:\n"
        "                freed.append(block)\n"
        "        self.free_block_queue.append_n(freed)\n",
    ),
    Mutant(
        "consumer-misnamed-field",
        "the consumer reads a BlockStored field by a name the schema does not "
        "have (`lookahead_tokens`), so every block's lookahead tokens are None",
        CONSUMER,
        '    lookahead = getattr(event, "lookahead_token_ids", None)\n',
        '    lookahead = getattr(event, "lookahead_tokens", None)\n',
    ),
    Mutant(
        "0010-fast-path-merged",
        "0010 (dropped): its get_cached_block fast path laid over 0.34.0's, "
        "reading `_cache` and taking its value for a block",
        BLOCK_POOL,
        "        cached_blocks = []\n"
        "        for group_id in kv_cache_group_ids:\n"
        "            block_hash_with_group_id = make_block_hash_with_group_id(\n"
        "                block_hash, group_id\n"
        "            )\n"
        "            block = self.cached_block_hash_to_block.get_one_block(\n"
        "                block_hash_with_group_id\n"
        "            )\n"
        "            if not block:\n"
        "                return None\n"
        "            cached_blocks.append(block)\n",
        "        cached_blocks = []\n"
        "        cache_map = self.cached_block_hash_to_block\n"
        "        for group_id in kv_cache_group_ids:\n"
        "            block_hash_with_group_id = make_block_hash_with_group_id(\n"
        "                block_hash, group_id\n"
        "            )\n"
        "            # A key with a single block is looked up here, without a call:\n"
        "            # this runs for every block of every prefix lookup.\n"
        "            block = cache_map._cache.get(block_hash_with_group_id)\n"
        "            if block is None:\n"
        "                return None\n"
        "            if not isinstance(block, KVCacheBlock):\n"
        "                block = cache_map.get_one_block(block_hash_with_group_id)\n"
        "                if block is None:\n"
        "                    return None\n"
        "            cached_blocks.append(block)\n",
    ),
)


class MutantError(Exception):
    pass


def mutated(text: str, mutant: Mutant) -> str:
    """``text`` with the mutant applied; loud when it no longer applies."""
    for old, new in ((mutant.old, mutant.new), *mutant.also):
        count = text.count(old)
        if count != 1:
            raise MutantError(
                f"mutant {mutant.name} no longer applies to {mutant.file} (its "
                f"text occurs {count} times, not once): update it in "
                "ci/bench/mutation.py"
            )
        text = text.replace(old, new)
    return text


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


def lay_work(
    tree: Path, mutants: tuple[Mutant, ...], work: Path
) -> tuple[dict[str, str], dict[str, str], Path, Path]:
    """What every mutant run starts from: the mutated files' texts (loud if
    a mutant no longer applies), each mutant's text, a copy of ``tree``'s
    ``vllm/`` under ``work/src`` and the test tree."""
    sources = {m.file: (tree / m.file).read_text() for m in mutants}
    texts = {m.name: mutated(sources[m.file], m) for m in mutants}
    src = work / "src"
    shutil.copytree(
        tree / "vllm", src / "vllm", ignore=shutil.ignore_patterns("__pycache__")
    )
    return sources, texts, src, ut.build_test_tree(tree, work / "test-tree")


def run_command(report: dict[str, Any]) -> str:
    """The report's command as a reader runs it: no machine path."""
    return bl.role_command(report["command"], {})


def render(report: dict[str, Any]) -> str:
    lines = [
        "# Mutation suite",
        "",
        "Generated by `ci/bench/mutation.py` (run by `ci/bench.sh`); do not edit.",
        f"Run {report['date']} UTC, {report['wall_s']:.0f} s: `{run_command(report)}`.",
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


def new_findings(before: list[str], after: list[str]) -> list[str]:
    """The static check's findings on a mutant that the unmutated file does
    not have, compared without their line and column (the mutant moves
    lines)."""

    def what(line: str) -> str:
        match = rebase._FINDING.match(line)
        return f"{match['file']}: {match['what']}" if match else line

    left = collections.Counter(what(line) for line in before)
    found = []
    for line in after:
        if left[what(line)] > 0:
            left[what(line)] -= 1
        else:
            found.append(line)
    return found


def relevant_first(tests: list[str], file: str) -> list[str]:
    """``tests`` with those of the mutated module's own area first, so that
    a run that stops at its first failure stops sooner."""
    if "kv_connector" in file:
        area = "kv_connector"
    elif file.startswith("vllm/distributed/kv_events"):
        area = "tests/distributed"
    else:
        area = "v1/core"
    return sorted(tests, key=lambda t: (area not in t, t))


def render_merge(report: dict[str, Any]) -> str:
    caught = sum(1 for m in report["mutants"] if m["caught"])
    lines = [
        "# The merge's silent breakages, and the gate before adopt",
        "",
        "Generated by `ci/bench/mutation.py --set merge`; do not edit.",
        f"Run {report['date']} UTC, {report['wall_s']:.0f} s: `{run_command(report)}`.",
        "",
        "A clean 3-way merge of the 0.33.0 series onto vLLM 0.34.0 left these "
        "mistakes without a conflict marker (issue 30); a maintainer's trial "
        "merged two more that the gate once missed (issue 42: the HiSparse and "
        "consumer rows). Each is remade as a "
        "mutant of today's patched tree (`MERGE_MUTANTS`) and put through the "
        "two halves of the gate that `ci/overlay rebase-test VERSION` runs "
        "before `adopt`: the static check (every touched file compiles and "
        f"passes {report['ruff']} with upstream's configuration, F821 "
        "selected: `rebase.static_findings`), then the overlay's tests. A "
        "mutant is caught when the static check reports a finding that the "
        "unmutated file does not have, or when a test fails on it that passes "
        "on the unmutated copy (the control run, after the mutants, reruns "
        f"every test that failed on one: {report['control_passed']} of "
        f"{report['control_tests']} passed; a test that fails there catches "
        "nothing).",
        "",
        "Each mutant's test run is every test file of `overlay/tests/` "
        f"({report['test_files']} files), those of the mutated module's area "
        "first (`v1/core` for block_pool.py, `kv_connector` for the offloading "
        f"tracker), with `{' '.join(report['pytest_args'])}`: it stops at its "
        "first failure, so the test named is one that catches the mutant, "
        "not every one. `ran` counts the tests that finished before the stop.",
        "",
        f"**Caught: {caught} of {len(report['mutants'])}.**",
        "",
        "| mutant | the mistake | static check | first failing test | ran |",
        "|---|---|---|---|---|",
    ]
    for m in report["mutants"]:
        static = "; ".join(f"`{f}`" for f in m["static"]) or "clean"
        test = ", ".join(f"`{t}`" for t in m["killed_by"]) or "none failed"
        lines.append(
            f"| `{m['name']}` | {m['what']} | {static} | {test} | {m['ran']} |"
        )
    if survivors := [m["name"] for m in report["mutants"] if not m["caught"]]:
        lines += ["", "Not caught: " + ", ".join(f"`{n}`" for n in survivors) + "."]
    return "\n".join(lines) + "\n"


def merge_main(args: argparse.Namespace) -> int:
    """``--set merge``: each of MERGE_MUTANTS through the static check and
    the overlay's tests (every file, stopping at the first failure)."""
    selected = [m for m in MERGE_MUTANTS if not args.mutant or m.name in args.mutant]
    if not selected:
        print("error: --mutant names none of MERGE_MUTANTS", file=sys.stderr)
        return 2
    started, t0 = dt.datetime.now(dt.UTC), time.monotonic()
    tests = sorted(
        p.relative_to(args.overlay).as_posix() for p in args.overlay.rglob("test_*.py")
    )
    pytest_args = ("--maxfail=1",)
    try:
        ruff_python = args.ruff_python or rebase.ruff_python(
            default_layout(), args.tree
        )
        ruff_version = subprocess.run(
            [str(ruff_python), "-m", "ruff", "--version"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="vllm-merge-mutation-") as tmp:
            work = Path(tmp)
            sources, texts, src, test_tree = lay_work(args.tree, MERGE_MUTANTS, work)
            # Upstream's ruff configuration, where ruff finds it from src/.
            shutil.copy2(args.tree / "pyproject.toml", src / "pyproject.toml")
            before = {f: rebase.static_findings(src, [f], ruff_python) for f in sources}
            results: list[dict[str, Any]] = []
            for m in selected:
                print(f"mutant {m.name}", file=sys.stderr)
                target = src / m.file
                target.write_text(texts[m.name])
                try:
                    static = new_findings(
                        before[m.file],
                        rebase.static_findings(src, [m.file], ruff_python),
                    )
                    outcome = run_tests(
                        args.python, test_tree, src,
                        relevant_first(tests, m.file), work, pytest_args,
                    )  # fmt: skip
                finally:
                    target.write_text(sources[m.file])
                killers = sorted(
                    t for t, o in outcome.items() if o in ("failed", "error")
                )
                ran = sum(1 for o in outcome.values() if o != "skipped")
                results.append(
                    {
                        "name": m.name,
                        "what": m.what,
                        "file": m.file,
                        "static": static,
                        "killed_by": killers,
                        "ran": ran,
                        "caught": bool(static or killers),
                    }
                )
                print(
                    f"  static {len(static)} findings; {len(killers)} tests "
                    f"failed of {ran} run",
                    file=sys.stderr,
                )
            # The control run: a failing test counts only if it passes on the
            # unmutated copy (a whole file that failed to collect must too).
            rerun = sorted({t for r in results for t in r["killed_by"]})
            print(f"control run of {len(rerun)} tests (unmutated)", file=sys.stderr)
            control = (
                run_tests(args.python, test_tree, src, rerun, work) if rerun else {}
            )
            passed = sorted(t for t, o in control.items() if o == "passed")
            for r in results:
                r["killed_by"] = [
                    t
                    for t in r["killed_by"]
                    if t in passed
                    or ("::" not in t and any(p.startswith(t + "::") for p in passed))
                ]
                r["caught"] = bool(r["static"] or r["killed_by"])
    except (MutantError, ut.HarnessError, OverlayError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"error: {shlex.join(e.cmd)} failed: {e.stderr}", file=sys.stderr)
        return 2
    report = {
        "date": f"{started:%Y-%m-%d %H:%M}",
        "wall_s": time.monotonic() - t0,
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "ruff": ruff_version,
        "control_tests": len(control),
        "control_passed": len(passed),
        "test_files": len(tests),
        "pytest_args": [*pytest_args, "-n", str(ut.XDIST_WORKERS)],
        "caught": sum(1 for r in results if r["caught"]),
        "mutants": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render_merge(report))
    survivors = [r["name"] for r in results if not r["caught"]]
    print(
        f"caught {report['caught']} of {len(results)}; wrote {args.out}.md",
        file=sys.stderr,
    )
    if survivors:
        print(f"NOT CAUGHT: {', '.join(survivors)}", file=sys.stderr)
        return 1
    return 0


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
        "--set",
        choices=("behaviour", "merge"),
        default="behaviour",
        help="behaviour: MUTANTS, the overlay's tests must kill each (default); "
        "merge: MERGE_MUTANTS, the breakages a clean merge onto 0.34.0 hid, "
        "which the gate before adopt (static check, then the overlay's tests) "
        "must catch",
    )
    ap.add_argument(
        "--ruff-python",
        type=Path,
        help="--set merge: the python whose ruff runs the static check "
        "(default: the ruff the tree's .pre-commit-config.yaml pins, as "
        "rebase-check's check uses)",
    )
    ap.add_argument(
        "--mutant",
        action="append",
        choices=[m.name for m in (*MUTANTS, *MERGE_MUTANTS)],
        help="run only this mutant (repeatable; every mutant must still apply)",
    )
    args = ap.parse_args(argv)
    if not args.python.is_file():
        ap.error(f"--python {args.python} is not a file: name the test venv's python")
    # The tests run with the tree as their working directory. Not resolve():
    # a venv's python is a symlink, and its target is not the venv.
    args.python = Path(os.path.abspath(args.python))
    if args.set == "merge":
        return merge_main(args)
    selected = [m for m in MUTANTS if not args.mutant or m.name in args.mutant]
    if not selected:
        ap.error("--mutant names none of MUTANTS (--set merge for MERGE_MUTANTS)")
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
        with tempfile.TemporaryDirectory(prefix="vllm-mutation-") as tmp:
            work = Path(tmp)
            sources, texts, src, test_tree = lay_work(args.tree, MUTANTS, work)
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
