"""Scheduler step cost, patched vs unpatched vLLM, each tree in its own process.

vLLM's real v1 ``Scheduler`` (its ``KVCacheManager`` and ``BlockPool``, KV
events on, the null publisher every batch still goes through) runs one
trace with model outputs made up here (no model): 6 prompt families of 16
blocks; a request takes a random family and a block-aligned prefix of it
(2-16 blocks), so shorter requests recompute blocks that longer ones hold
and exact repeats recompute their last block (duplicate copies); a third
of them add a random tail. 0-2 arrivals per step, 8-48 output tokens, at
most 8 running requests on 48 blocks of 16 tokens, so running requests are
preempted. The step count (over 1,000 in the full run) and the
preemptions are reported.

Figure: per step, the time of ``Scheduler.schedule()`` plus
``update_from_output()`` (making up the model output is not timed); per
repeat and policy, the median over the trace's steps. The driver alternates
the trees ABAB (order flipped every repeat) as ``bench_block_pool`` does;
the ratio is patched / unpatched of the medians over repeats, with the
same-version spread (first and second half of the repeats). Once per tree
and policy, the same two calls over the whole trace run under an opcode
tracer: the Python bytecode instructions they execute (exact, the same on
every run, blind to what C code costs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import gc
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bench_block_pool
import bench_router
import benchlib as bl

NUM_GPU_BLOCKS = 48
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 512

# (prompt, max_tokens, arrivals in this step: set on a step's first request)
Trace = list[tuple[list[int], int, int]]


def make_trace(num_requests: int, seed: int = 7) -> Trace:
    """Prompt families with block-aligned prefixes, tails and repeats."""
    rng = random.Random(seed)
    bs = bl.BLOCK_SIZE
    families = [[rng.randrange(1000, 32000) for _ in range(16 * bs)] for _ in range(6)]
    trace: Trace = []
    made = 0
    while made < num_requests:
        group = min(rng.randrange(0, 3), num_requests - made)
        made += group
        for j in range(group):
            prompt = rng.choice(families)[: rng.randint(2, 16) * bs]
            if rng.random() < 1 / 3:
                prompt = prompt + [rng.randrange(1000, 32000) for _ in range(7)]
            trace.append((prompt, rng.randint(8, 48), group if j == 0 else 0))
        if group == 0:
            trace.append(([], 0, 0))
    return trace


def run_trace(
    model_dir: str,
    policy: str | None,
    trace: Trace,
    timed: Callable[[Callable[[], Any]], tuple[Any, int]],
) -> dict[str, Any]:
    """Serve ``trace``; ``timed(call)`` runs one scheduler call and returns its
    result and cost. Returns the per-step costs, steps and preemptions."""
    from vllm.config import KVEventsConfig

    kv_events: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "null"}
    if policy is not None:
        kv_events["copy_semantics"] = policy
    scheduler = bl.make_cpu_scheduler(
        model_dir,
        NUM_GPU_BLOCKS,
        MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=2048,
        seed=0,
        kv_events_config=KVEventsConfig(**kv_events),
    )
    hasher = bl.make_hasher()
    rng = random.Random(11)
    costs: list[int] = []
    preemptions = 0
    i = n_req = 0
    while i < len(trace) or scheduler.has_unfinished_requests():
        if i < len(trace):
            take = max(trace[i][2], 1)
            for prompt, max_tokens, _ in trace[i : i + take]:
                if prompt:
                    scheduler.add_request(
                        bl.make_request(f"r{n_req}", prompt, hasher, max_tokens)
                    )
                    n_req += 1
            i += take
        if not scheduler.has_unfinished_requests():
            continue
        out, schedule_cost = timed(scheduler.schedule)
        preemptions += len(out.preempted_req_ids or ())
        model_output = bl.made_up_output(
            scheduler, out, lambda _request: rng.randrange(1000, 32000)
        )
        _, update_cost = timed(
            functools.partial(scheduler.update_from_output, out, model_output)
        )
        costs.append(schedule_cost + update_cost)
    scheduler.shutdown()
    return {"costs": costs, "steps": len(costs), "preemptions": preemptions}


def timed_ns(call: Callable[[], Any]) -> tuple[Any, int]:
    t0 = time.perf_counter_ns()
    result = call()
    return result, time.perf_counter_ns() - t0


def traced(call: Callable[[], Any]) -> tuple[Any, int]:
    box: list[Any] = []

    def call_once() -> None:
        box.append(call())

    count = bl.bytecodes_executed(call_once)
    return box[0], count


class SchedulerWorker:
    def __init__(self, model_dir: str, num_requests: int) -> None:
        self.model_dir = model_dir
        self.policies = bl.policies()
        self.trace = make_trace(num_requests)
        # One untimed pass per policy (imports, allocator, caches).
        for policy in self.policies:
            run_trace(self.model_dir, policy, self.trace, timed_ns)

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        if command.get("cmd") == "count":
            return {
                "bytecodes": {
                    bl.policy_label(p): sum(
                        run_trace(self.model_dir, p, self.trace, traced)["costs"]
                    )
                    for p in self.policies
                }
            }
        rep = int(command["repeat"])
        k = rep % len(self.policies)
        out: dict[str, Any] = {"repeat": rep, "times": {}, "steps": {}}
        for policy in self.policies[k:] + self.policies[:k]:
            gc.collect()
            r = run_trace(self.model_dir, policy, self.trace, timed_ns)
            label = bl.policy_label(policy)
            # Seconds, as bench_block_pool's summary expects.
            out["times"].setdefault("scheduler_step", {})[label] = (
                bl.median(r["costs"]) / 1e9
            )
            out["steps"][label] = {
                "steps": r["steps"],
                "preemptions": r["preemptions"],
            }
        return out


def make_handler(argv: list[str]) -> Any:
    import logging

    ap = argparse.ArgumentParser()
    ap.add_argument("--tree")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--num-requests", type=int, required=True)
    a = ap.parse_args(argv)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    return SchedulerWorker(a.model_dir, a.num_requests).handle


def drive(
    python: str,
    patched: Path,
    unpatched: Path,
    repeats: int,
    quick: bool,
    model_dir: Path = bench_router.DEFAULT_MODEL_DIR,
    log: Any = sys.stderr,
    shared: dict[str, bl.Worker] | None = None,
) -> dict[str, Any]:
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, not {repeats}")
    num_requests = 40 if quick else 400
    args = [
        "--model-dir",
        str(model_dir.resolve()),
        "--num-requests",
        str(num_requests),
    ]
    trees = {"patched": patched, "unpatched": unpatched}
    t0 = time.time()
    started = f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC"
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    session = bl.Session(
        "scheduler", python, Path(__file__).resolve(), trees, args, shared
    )
    try:
        for rep in range(repeats):
            order = (
                ["patched", "unpatched"] if rep % 2 == 0 else ["unpatched", "patched"]
            )
            for name in order:
                res = session.call(name, {"cmd": "run", "repeat": rep})
                res["order"] = order.index(name)
                runs[name].append(res)
            print(f"[scheduler] repeat {rep + 1}/{repeats} done", file=log, flush=True)
        counts = {
            name: session.call(name, {"cmd": "count"})["bytecodes"] for name in trees
        }
    finally:
        session.close()
    (base,) = counts["unpatched"].values()
    return {
        "bench": "scheduler",
        "started": started,
        "repeats": repeats,
        "quick": quick,
        "num_requests": num_requests,
        "num_gpu_blocks": NUM_GPU_BLOCKS,
        "max_num_seqs": MAX_NUM_SEQS,
        "trees": {k: str(v) for k, v in trees.items()},
        "provenance": session.infos,
        "wall_s": time.time() - t0,
        "runs": runs,
        "steps": {name: reps[0]["steps"] for name, reps in runs.items()},
        "bytecodes": [
            {
                "workload": "scheduler_step",
                "policy": policy,
                "patched": n,
                "unpatched": base,
                "ratio": n / base,
            }
            for policy, n in counts["patched"].items()
        ],
        **bench_block_pool.summarize(runs),
    }


def report_lines(res: dict[str, Any]) -> list[str]:
    """The Markdown section of ``res``."""
    lines = [
        "## Scheduler step, patched / unpatched",
        "",
        (
            f"`bench_scheduler.py`: `Scheduler.schedule()` + "
            f"`update_from_output()` per step over one trace ({res['num_requests']}"
            f" requests in prompt families with repeats, {res['num_gpu_blocks']} "
            f"blocks, at most {res['max_num_seqs']} running), {res['repeats']} "
            "repeats per tree alternated ABAB; each repeat's figure is the median "
            "step time in µs. Same-version spread: each tree's first and second "
            "half of the repeats. Bytecodes: both calls over the whole trace, "
            f"once per tree and policy under an opcode tracer. Measured "
            f"{res['started']}."
        ),
        "",
        "| policy | steps (patched / unpatched) | preemptions | patched µs | "
        "unpatched µs | ratio | ratio half 1 / 2 | patched h2/h1 | unpatched h2/h1 "
        "| bytecodes ratio, trace | per step |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    (unpatched_steps,) = res["steps"]["unpatched"].values()
    codes = {r["policy"]: r["ratio"] for r in res["bytecodes"]}
    for r in res["ratios"]:
        steps = res["steps"]["patched"][r["policy"]]
        # The trees may take different steps (hits differ): per step as well.
        per_step = codes[r["policy"]] * unpatched_steps["steps"] / steps["steps"]
        lines.append(
            f"| {r['policy']} | {steps['steps']} / {unpatched_steps['steps']} | "
            f"{steps['preemptions']} / {unpatched_steps['preemptions']} | "
            f"{r['patched_median_s'] * 1e6:.1f} | "
            f"{r['unpatched_median_s'] * 1e6:.1f} | {r['ratio']:.3f} | "
            f"{r['ratio_half1']:.3f} / {r['ratio_half2']:.3f} | "
            f"{r['patched_half_ratio']:.3f} | {r['unpatched_half_ratio']:.3f} | "
            f"{codes[r['policy']]:.4f} | {per_step:.4f} |"
        )
    lines.append("")
    return lines


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--model-dir", type=Path, default=bench_router.DEFAULT_MODEL_DIR)


def run(a: argparse.Namespace) -> dict[str, Any]:
    repeats = 2 if a.quick else a.repeats
    return drive(
        a.python, a.patched_tree, a.unpatched_tree, repeats, a.quick, a.model_dir
    )


def summary(res: dict[str, Any]) -> Iterator[str]:
    yield from report_lines(res)


def main(argv: list[str] | None = None) -> int:
    return bl.bench_main(
        argv,
        __doc__,
        make_handler,
        run,
        summary,
        add_args,
        json_help="write the full result here",
    )


if __name__ == "__main__":
    sys.exit(main())
