"""Duplicate prefix-cache copies through the real Scheduler, three trees.

One worker process per vLLM tree (``PYTHONPATH=<tree>``) runs the same
traces through vLLM's real v1 ``Scheduler`` with made-up model outputs, with
KV events on (each of the tree's copy-semantics policies; the unpatched tree
has none). The trees:

  upstream   -- the unpatched vLLM 0.33.0: a hit takes the first copy;
  series     -- the patched tree without ``DUP_FIRST_PATCH`` (0006), laid as
                a copy with that patch reversed (after the later patches
                that edit its files, ``patches_to_reverse``): a hit takes a
                copy in use (0004);
  dup_first  -- the patched tree: a freed copy whose key stays resident goes
                to the front of the free queue (0006).

Per trace, tree and seed: prefix-cache hit tokens and hit rate, blocks
computed (scheduled tokens / block size), physical copies per resident key
over the run (mean of the per-step mean, max, keys with more than one copy),
steps, preemptions; and per policy the event volume (stored and removed
hashes, messages, bytes as ZmqEventPublisher sends them). Blocks and hits do
not depend on the policy; the worker checks that they are equal across
policies. Every figure is a count, the same on every run.

    python bench_hit_selection.py --patched-tree build/tree \\
        --unpatched-tree "$(ci/overlay pristine-tree)" --python PY \\
        --out docs/benchmarks [--seeds 5] [--quick]

writes ``dup_first.json`` and ``dup_first.md`` there (``ci/bench.sh`` runs it
through ``run_all.py``; ``--quick``: one seed, 20 requests per trace).

Traces (``TRACES``), each under high and low pressure (cache size):
  families -- block-aligned system prompts of 8 or 24 families, optionally
              followed by earlier "turns" (the tokens the made-up model
              generates after that prompt, so they match decode blocks of
              other requests) and a private question;
  repeat   -- the seed's pattern: 24 block-aligned prompts of 4-16 blocks,
              skewed popularity, each request one of them exactly (each
              repeat recomputes the last block into a new copy);
  chat     -- 6 shared system prompts with canned block-aligned questions
              repeated exactly, follow-up turns and random turns.
Output tokens depend only on (prompt family, position), so concurrent
requests of one family decode identical blocks.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import bench_router
import benchlib as bl

BLOCK_SIZE = bl.BLOCK_SIZE
# The patch under test; the series tree is the patched tree without it.
PATCHES = Path(__file__).resolve().parents[2] / "patches"
DUP_FIRST_PATCH = str(PATCHES / "0006-prefix-cache-duplicates-leave-first.patch")
EOS = 2
MAX_MODEL_LEN = 4096

# One trace request: (arrival step, request id, family, prompt, max_tokens),
# sorted as tuples (ties by request id).
Trace = list[tuple[int, str, int, list[int], int]]


def generated_token(family: int, position: int) -> int:
    return 10_000 + (family * 7919 + position * 104729) % 50_000


def arrival_steps(rng: random.Random, n: int) -> list[int]:
    return sorted(rng.randrange(0, 2 * n // 3) for _ in range(n))


def families_trace(seed: int, num_requests: int, num_families: int) -> Trace:
    rng = random.Random(seed)
    families = []
    for f in range(num_families):
        prompt = [100 * (f + 1) + i % 97 for i in range(rng.choice([2, 3, 4]) * 16)]
        families.append(prompt)
    trace = []
    for i in range(num_requests):
        f = rng.randrange(num_families)
        prompt = list(families[f])
        # Earlier turns: what the model generated after the family prompt.
        turns = rng.choice([0, 0, 1, 2])
        for _ in range(turns * BLOCK_SIZE):
            prompt.append(generated_token(f, len(prompt)))
        if rng.random() < 0.4:
            prompt += [60_000 + i] * rng.randrange(1, BLOCK_SIZE)
        max_tokens = rng.randrange(8, 3 * BLOCK_SIZE)
        arrival = rng.randrange(0, 2 * num_requests // 3)
        trace.append((arrival, f"r{i}", f, prompt, max_tokens))
    return sorted(trace, key=lambda r: r[:2])


def repeat_trace(seed: int, num_requests: int) -> Trace:
    rng = random.Random(seed)
    prompts = bl.workload_duplicates(num_requests, seed).prompts
    index = {tuple(p): i for i, p in enumerate(dict.fromkeys(map(tuple, prompts)))}
    arrivals = arrival_steps(rng, num_requests)
    return [
        (t, f"r{i}", index[tuple(p)], p, rng.randrange(1, 2 * BLOCK_SIZE))
        for i, (t, p) in enumerate(zip(arrivals, prompts, strict=True))
    ]


def chat_trace(seed: int, num_requests: int) -> Trace:
    rng = random.Random(seed)
    requests = [
        (prompt, max_tokens)
        for prompt, max_tokens, _ in bench_router.make_chat_trace(num_requests, seed)
        if prompt
    ]
    # Family: the system prompt (its first block's tokens).
    systems = dict.fromkeys(tuple(p[:BLOCK_SIZE]) for p, _ in requests)
    family = {first_block: i for i, first_block in enumerate(systems)}
    arrivals = arrival_steps(rng, len(requests))
    return [
        (
            t,
            f"r{i}",
            family[tuple(p[:BLOCK_SIZE])],
            p,
            max_tokens + rng.randrange(0, BLOCK_SIZE),
        )
        for i, (t, (p, max_tokens)) in enumerate(zip(arrivals, requests, strict=True))
    ]


# name -> (trace builder taking (seed, num_requests), GPU blocks, max_num_seqs)
TRACES: dict[str, tuple[Callable[[int, int], Trace], int, int]] = {
    "families_high": (lambda s, n: families_trace(s, n, 24), 120, 16),
    "families_low": (lambda s, n: families_trace(s, n, 8), 160, 16),
    "repeat_high": (repeat_trace, 96, 16),
    "repeat_low": (repeat_trace, 400, 16),
    "chat_high": (chat_trace, 40, 8),
    "chat_low": (chat_trace, 160, 8),
}

# Per-run figures that must not depend on the copy-semantics policy.
POLICY_FREE = (
    "hit_tokens",
    "blocks_computed",
    "copies_mean",
    "copies_max",
    "dup_keys_mean",
    "steps",
    "preemptions",
)


# --------------------------------------------------------------------------
# worker
# --------------------------------------------------------------------------


def model_config(model_dir: Path) -> None:
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "model_type": "opt",
                "architectures": ["OPTForCausalLM"],
                "hidden_size": 16,
                "ffn_dim": 32,
                "num_attention_heads": 2,
                "num_hidden_layers": 2,
                "vocab_size": 70_000,
                "max_position_embeddings": MAX_MODEL_LEN,
                "word_embed_proj_dim": 16,
                "bos_token_id": EOS,
                "eos_token_id": EOS,
                "pad_token_id": 1,
            }
        )
    )


def run_trace(
    model_dir: str, trace_name: str, seed: int, num_requests: int, policy: str | None
) -> dict[str, Any]:
    from vllm.config import KVEventsConfig

    build, num_blocks, max_num_seqs = TRACES[trace_name]
    kv_events: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "null"}
    if policy is not None:
        kv_events["copy_semantics"] = policy
    hasher = bl.make_hasher(BLOCK_SIZE)  # also sets the none-hash
    scheduler = bl.make_cpu_scheduler(
        model_dir,
        num_blocks,
        max_num_seqs,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=1024,
        seed=42,
        kv_events_config=KVEventsConfig(**kv_events),
    )
    # The scheduler hands it exactly the batches ZmqEventPublisher would get.
    tap = bl.EventTap()
    scheduler.kv_event_publisher = tap
    pool = scheduler.kv_cache_manager.block_pool
    trace = build(seed, num_requests)
    family_of: dict[str, int] = {}
    queries = hits = computed = preemptions = 0
    mean_copies: list[float] = []
    dup_keys: list[int] = []
    max_copies = 0
    step_idx = pos = 0
    while pos < len(trace) or scheduler.has_requests():
        while pos < len(trace) and trace[pos][0] <= step_idx:
            _, req_id, family, prompt, max_tokens = trace[pos]
            family_of[req_id] = family
            scheduler.add_request(
                bl.make_request(req_id, prompt, hasher, max_tokens, eos_token_id=EOS)
            )
            pos += 1
        step_idx += 1
        out, engine_outputs = bl.step(
            scheduler,
            lambda req: generated_token(family_of[req.request_id], req.num_tokens),
        )
        computed += sum(out.num_scheduled_tokens.values())
        for outputs in engine_outputs.values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.prefix_cache_stats is not None:
                queries += stats.prefix_cache_stats.queries
                hits += stats.prefix_cache_stats.hits
                preemptions += stats.prefix_cache_stats.preempted_requests
        counts = bl.copies_per_key(pool)
        if counts:
            mean_copies.append(sum(counts) / len(counts))
            max_copies = max(max_copies, max(counts))
            dup_keys.append(sum(1 for c in counts if c > 1))
        if step_idx > 100_000:
            raise RuntimeError(f"{trace_name} seed {seed} did not finish")
    end_check = tap.mirror_check(bl.resident_external_keys(pool))
    scheduler.shutdown()
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "hit_tokens": hits,
        "blocks_computed": computed / BLOCK_SIZE,
        "copies_mean": statistics.fmean(mean_copies),
        "copies_max": max_copies,
        "dup_keys_mean": statistics.fmean(dup_keys),
        "steps": step_idx,
        "preemptions": preemptions,
        "events": tap.totals(),
        "end_check": end_check,
    }


def make_handler(argv: list[str]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    import logging

    del argv  # only --tree, which benchlib has already put on PYTHONPATH
    logging.getLogger("vllm").setLevel(logging.ERROR)
    model_dir = Path(tempfile.mkdtemp(prefix="hitsel-model-"))
    model_config(model_dir)

    def handle(command: dict[str, Any]) -> dict[str, Any]:
        """One trace and seed under every policy of this tree."""
        per_policy = {
            bl.policy_label(policy): run_trace(
                str(model_dir),
                command["trace"],
                command["seed"],
                command["requests"],
                policy,
            )
            for policy in bl.policies()
        }
        first = next(iter(per_policy.values()))
        for label, r in per_policy.items():
            differ = [k for k in POLICY_FREE if r[k] != first[k]]
            if differ:
                raise RuntimeError(f"{label} changed {differ}: the policy must not")
        return {
            **{k: first[k] for k in ("hit_rate", *POLICY_FREE)},
            "events": {label: r["events"] for label, r in per_policy.items()},
            "end_check": {label: r["end_check"] for label, r in per_policy.items()},
        }

    return handle


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Median, min and max over seeds per tree; event volume per policy."""
    out: dict[str, Any] = {}
    for tree, seeds in runs.items():
        s: dict[str, Any] = {
            k: bl.spread([r[k] for r in seeds]) for k in ("hit_rate", *POLICY_FREE)
        }
        s["events"] = {
            policy: {
                k: bl.spread([r["events"][policy][k] for r in seeds])
                for k in ("stored_hashes", "removed_hashes", "messages", "frame_bytes")
            }
            for policy in seeds[0]["events"]
        }
        out[tree] = s
    return out


def touched_files(patch: Path) -> set[str]:
    return {
        line.split(" b/", 1)[1]
        for line in patch.read_text().splitlines()
        if line.startswith("diff --git ")
    }


def patches_to_reverse() -> list[Path]:
    """``DUP_FIRST_PATCH`` and, newest first before it, every later patch of
    the series that edits one of its files: those edit its lines, so it does
    not reverse under them (0010, which changes no behaviour)."""
    names = [
        line.strip()
        for line in (PATCHES / "series").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    dup_first = Path(DUP_FIRST_PATCH)
    files = touched_files(dup_first)
    later = [PATCHES / n for n in names[names.index(dup_first.name) + 1 :]]
    return [p for p in reversed(later) if touched_files(p) & files] + [dup_first]


def lay_trees(patched: Path, unpatched: Path, scratch: Path) -> dict[str, Path]:
    """The three trees: ``series`` is a copy of ``patched``'s ``vllm/`` under
    ``scratch`` with ``patches_to_reverse()`` reversed."""
    series = scratch / "series"
    shutil.copytree(patched / "vllm", series / "vllm")
    for patch in patches_to_reverse():
        proc = subprocess.run(
            ["patch", "-R", "-p1", "-s", "--no-backup-if-mismatch", "-i", str(patch)],
            cwd=series,
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(
                f"{patched} does not hold {patch} (it does not reverse: "
                f"{(proc.stdout + proc.stderr).strip()[:500]}); run ./build.sh first"
            )
    return {"upstream": unpatched, "series": series, "dup_first": patched}


def drive(
    python: str,
    trees: dict[str, Path],
    seeds: int,
    requests: int,
    log: Any = sys.stderr,
) -> dict[str, Any]:
    t0 = time.time()
    workers, infos = bl.start_workers(python, Path(__file__).resolve(), trees, [])
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        with ThreadPoolExecutor(len(workers)) as pool:
            for trace in TRACES:
                runs[trace] = {name: [] for name in trees}
                for seed in range(seeds):
                    command = {"trace": trace, "seed": seed, "requests": requests}
                    done = pool.map(
                        bl.Worker.call, workers.values(), [command] * len(workers)
                    )
                    for name, result in zip(workers, done, strict=True):
                        runs[trace][name].append(result)
                    print(f"[hit_selection] {trace} seed {seed}", file=log, flush=True)
    finally:
        for w in workers.values():
            w.close()
    return {
        "bench": "hit_selection",
        "seeds": list(range(seeds)),
        "requests": requests,
        "traces": {
            t: {"num_blocks": blocks, "max_num_seqs": seqs}
            for t, (_, blocks, seqs) in TRACES.items()
        },
        "trees": {name: str(tree) for name, tree in trees.items()},
        "provenance": infos,
        "wall_s": time.time() - t0,
        "summary": {t: summarize(runs[t]) for t in TRACES},
        "runs": runs,
    }


def summary_lines(res: dict[str, Any]) -> Iterator[str]:
    for trace, per_tree in res["summary"].items():
        for tree, s in per_tree.items():
            yield (
                f"{trace:<14} {tree:<10} hit tokens {s['hit_tokens']['median']:g} "
                f"blocks computed {s['blocks_computed']['median']:g} "
                f"copies mean {s['copies_mean']['median']:.3f} "
                f"max {s['copies_max']['max']:g}"
            )


def fmt(v: dict[str, float], digits: int = 0) -> str:
    """Median [min, max]."""
    return f"{v['median']:.{digits}f} [{v['min']:.{digits}f}, {v['max']:.{digits}f}]"


def verdicts(res: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """Per trace: dup_first's median blocks computed against the series'
    (fewer, equal or more) and the number of seeds on which it computes more."""
    out = {}
    for trace, runs in res["runs"].items():
        a = res["summary"][trace]["series"]["blocks_computed"]["median"]
        b = res["summary"][trace]["dup_first"]["blocks_computed"]["median"]
        worse = sum(
            d["blocks_computed"] > s["blocks_computed"]
            for s, d in zip(runs["series"], runs["dup_first"], strict=True)
        )
        out[trace] = ("fewer" if b < a else "equal" if b == a else "more", worse)
    return out


def report_lines(res: dict[str, Any]) -> list[str]:
    """dup_first.md: the trees' hits and copies, dup_first against the
    series per seed, the event volume and 0006's ship rule."""
    return [
        *copies_table(res),
        *computed_per_seed_table(res),
        *event_volume_table(res),
        *ship_rule_lines(res),
    ]


def copies_table(res: dict[str, Any]) -> list[str]:
    """The report's title and method, and each tree's hits and copies."""
    seeds = res["seeds"]
    lines = [
        "# Duplicates leave first: three trees, one run"
        + (" (quick smoke run)" if res["quick"] else ""),
        "",
        f"`ci/bench/bench_hit_selection.py` (run by `ci/bench.sh`), "
        f"{res['requests']} requests per trace, seeds {seeds[0]}-{seeds[-1]}, "
        f"{res['wall_s']:.0f} s. Real v1 Scheduler, made-up model outputs, "
        "KV events on; every figure is a count (the same on every run). "
        "Cells: median over seeds [min, max].",
        "",
        "Trees: *upstream* vLLM 0.33.0 (a hit takes the first copy), *series* "
        "0001-0005 (0004: a hit takes a copy in use), *dup_first* the series "
        "plus 0006 (a freed copy whose key stays resident goes to the front "
        "of the free queue).",
        "",
        "| trace | GPU blocks | tree | hit tokens | blocks computed "
        "| mean copies per key | max copies per key | keys with >1 copy |",
        "|---|---:|---|---|---|---|---|---|",
    ]
    for trace, per_tree in res["summary"].items():
        for tree, s in per_tree.items():
            lines.append(
                f"| {trace} | {res['traces'][trace]['num_blocks']} | {tree} "
                f"| {fmt(s['hit_tokens'])} | {fmt(s['blocks_computed'], 1)} "
                f"| {fmt(s['copies_mean'], 3)} | {fmt(s['copies_max'])} "
                f"| {fmt(s['dup_keys_mean'], 2)} |"
            )
    return lines


def computed_per_seed_table(res: dict[str, Any]) -> list[str]:
    """Blocks computed, dup_first minus the series, seed by seed."""
    seeds = res["seeds"]
    lines = [
        "",
        "Blocks computed per seed, dup_first minus series (negative: fewer):",
        "",
        "| trace | " + " | ".join(f"seed {i}" for i in seeds) + " |",
        "|---|" + "---:|" * len(seeds),
    ]
    for trace, runs in res["runs"].items():
        diffs = [
            d["blocks_computed"] - s["blocks_computed"]
            for s, d in zip(runs["series"], runs["dup_first"], strict=True)
        ]
        lines.append(f"| {trace} | " + " | ".join(f"{x:g}" for x in diffs) + " |")
    return lines


def event_volume_table(res: dict[str, Any]) -> list[str]:
    """Event volume per tree and policy."""
    lines = [
        "",
        "Event volume per policy (hashes in BlockStored / BlockRemoved, "
        "messages and bytes as ZmqEventPublisher sends them; median over seeds; "
        "the unpatched tree has no policy and behaves as `physical`):",
        "",
        "| trace | tree | policy | stored hashes | removed hashes | messages | bytes |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for trace, per_tree in res["summary"].items():
        for tree, s in per_tree.items():
            for policy, ev in s["events"].items():
                lines.append(
                    f"| {trace} | {tree} | {policy} "
                    f"| {ev['stored_hashes']['median']:g} "
                    f"| {ev['removed_hashes']['median']:g} "
                    f"| {ev['messages']['median']:g} "
                    f"| {ev['frame_bytes']['median']:g} |"
                )
    return lines


def ship_rule_lines(res: dict[str, Any]) -> list[str]:
    """0006's ship rule per trace, whether it was met, and the provenance."""
    v = verdicts(res)
    met = all(kind != "more" and worse == 0 for kind, worse in v.values()) and any(
        kind == "fewer" for kind, _ in v.values()
    )
    return [
        "",
        "The ship rule of 0006, dup_first against the series: fewer blocks "
        "computed on every trace, or equal on some and fewer on the others "
        "(median; and the seeds on which dup_first computes more):",
        "",
        "| trace | blocks computed | seeds with more |",
        "|---|---|---:|",
        *(f"| {t} | {kind} | {worse} |" for t, (kind, worse) in v.items()),
        "",
        f"First rule: {'met' if met else 'NOT met'}.",
        "",
        "Provenance: "
        + "; ".join(
            bl.block_pool_where(name, info) for name, info in res["provenance"].items()
        )
        + ".",
        "",
    ]


def run(
    python: str, patched: Path, unpatched: Path, quick: bool, seeds: int = 5
) -> dict[str, Any]:
    """Lay the three trees and run every trace on them (``quick``: one seed,
    20 requests per trace)."""
    with tempfile.TemporaryDirectory(prefix="hitsel-trees-") as scratch:
        trees = lay_trees(patched, unpatched, Path(scratch))
        res = drive(python, trees, 1 if quick else seeds, 20 if quick else 400)
    res["quick"] = quick
    return res


def write_report(res: dict[str, Any], out: Path) -> None:
    (out / "dup_first.json").write_text(json.dumps(res, indent=1))
    write_markdown(res, out)


def write_markdown(res: dict[str, Any], out: Path) -> None:
    """``out``/dup_first.md from the report alone (``run_all.py --render-only``)."""
    (out / "dup_first.md").write_text("\n".join(report_lines(res)))


def main(argv: list[str] | None = None) -> int:
    def drive_main(args: list[str]) -> int:
        ap = bl.driver_parser(__doc__)
        ap.add_argument("--seeds", type=int, default=5)
        ap.add_argument("--quick", action="store_true", help="smoke run")
        ap.add_argument("--out", type=Path, required=True)
        a = ap.parse_args(args)
        res = run(a.python, a.patched_tree, a.unpatched_tree, a.quick, a.seeds)
        a.out.mkdir(parents=True, exist_ok=True)
        write_report(res, a.out)
        for line in summary_lines(res):
            print(line)
        return 0

    return bl.cli_main(argv, make_handler, drive_main)


if __name__ == "__main__":
    sys.exit(main())
