"""Block-pool hot path, patched vs unpatched vLLM, each tree in its own process.

Workloads (all on a bare ``vllm.v1.core.block_pool.BlockPool``):

a_upstream    upstream ``benchmarks/benchmark_block_pool.py``: for each
              allocation size (10, 50, 100, 500, 1000 blocks) a fresh pool of
              100,000 blocks with caching on, ``num_iteration`` rounds of
              ``get_new_blocks(n)`` + ``free_blocks``; no hashes, no events.
              Timed like upstream's ``TimeCollector`` (each call); the figure
              is the sum of all get+free call times.
b_churn       hashed caching with eviction churn, KV events on: random prompts
              through prefix lookup / ``get_new_blocks`` / ``cache_full_blocks``
              / ``free_blocks``, ``take_events()`` drained after every request.
c_duplicates  as b, but requests repeat a few block-aligned prompts, so a key
              gets many physical copies (the recomputed last block).

b and c figures per repeat are the best of ``PASSES`` passes (fresh pool
each), to damp interference from other jobs on a shared machine; a_upstream is
one pass (the sum over its 5,000 timed get/free pairs), as upstream runs it.

Protocol: the driver starts one worker process per tree (the ~10 s vLLM
import is paid once per process), then alternates them ABAB...:
repeat ``r`` of
the patched tree, then repeat ``r`` of the unpatched tree (the order within
a pair flips every repeat).  Each repeat runs every workload once in a fresh
pool (the patched tree once per policy, the policy order rotating); requests
and their block hashes are built once per worker, outside the timed region.

By default every repeat runs in a fresh pair of worker processes
(``--repeats-per-process 1``): a process carries a bias of its own (memory
layout...) that repeats inside it cannot average out.

Timings on a shared 2-core machine move by a few percent between processes,
more than the overhead under test; so a's get/free calls (smaller:
``COUNTED_UPSTREAM``; the building of its pools is counted apart, as
``a_pool_construction``, since no timed call covers it), b and c are also
run once per tree and policy under an opcode tracer
(``benchlib.bytecodes_executed``): the Python bytecode instructions
executed, the same on every run.  That count says how much interpreted work
a patch adds, exactly; it does not weigh instructions (an allocation counts
as one), so the timed ratio remains the figure to judge.

Reported: the median over repeats per tree/workload/policy, the ratio of
medians patched/unpatched, and the spread of running the same version twice:
the repeats split in time order into a first and a second half (separate
processes unless several repeats share one), the median of each half, their
ratio, and the patched/unpatched ratio computed from each half alone.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import benchlib as bl

UPSTREAM_SIZES = (10, 50, 100, 500, 1000)
# b/c: each repeat's figure is the best of this many passes (fresh pool each).
PASSES = 3
# a_upstream under the opcode tracer: (num_gpu_blocks, num_iteration). The
# timed run's 100,000 blocks and 1,000 rounds would take minutes to trace;
# every round is the same calls, so fewer give the same ratio.
COUNTED_UPSTREAM = (10000, 20)
# The bytecode row of building a_upstream's pools (10,000 blocks each): paid
# once per pool at start-up, outside every timed call, so it is counted
# apart from a_upstream.
POOL_CONSTRUCTION = "a_pool_construction"


# --------------------------------------------------------------------------
# worker
# --------------------------------------------------------------------------


def upstream_pools(num_gpu_blocks: int) -> list[Any]:
    """One fresh pool per allocation size, as upstream's benchmark builds."""
    return [
        bl.make_pool(num_gpu_blocks, events=False, policy=None) for _ in UPSTREAM_SIZES
    ]


def upstream_calls(pools: list[Any], num_iteration: int) -> None:
    """a_upstream's timed calls, untimed: what its bytecode count covers."""
    for n, pool in zip(UPSTREAM_SIZES, pools, strict=True):
        for _ in range(num_iteration):
            pool.free_blocks(pool.get_new_blocks(n))


def time_upstream(num_gpu_blocks: int, num_iteration: int) -> dict[str, float]:
    get_ns = 0
    free_ns = 0
    calls = 0
    clock = time.perf_counter_ns
    for n in UPSTREAM_SIZES:
        gc.collect()  # as upstream: collect ahead of each size
        pool = bl.make_pool(num_gpu_blocks, events=False, policy=None)
        for _ in range(num_iteration):
            t0 = clock()
            blocks = pool.get_new_blocks(n)
            t1 = clock()
            pool.free_blocks(blocks)
            t2 = clock()
            get_ns += t1 - t0
            free_ns += t2 - t1
            calls += 1
    return {
        "seconds": (get_ns + free_ns) / 1e9,
        "get_avg_us": get_ns / calls / 1e3,
        "free_avg_us": free_ns / calls / 1e3,
    }


def time_hashed(
    wl: bl.PoolWorkload, requests: list[Any], policy: str | None, passes: int = 1
) -> float:
    """Best of ``passes`` runs, each in a fresh pool (seconds)."""
    best = float("inf")
    for _ in range(passes):
        gc.collect()
        pool = bl.make_pool(wl.num_blocks, events=True, policy=policy)
        t0 = time.perf_counter()
        bl.run_pool_workload(pool, requests, wl.concurrency)
        best = min(best, time.perf_counter() - t0)
    return best


def count_hashed(wl: bl.PoolWorkload, requests: list[Any], policy: str | None) -> int:
    """Bytecode instructions of one pass of ``wl`` (pool built outside)."""
    pool = bl.make_pool(wl.num_blocks, events=True, policy=policy)
    return bl.bytecodes_executed(
        lambda: bl.run_pool_workload(pool, requests, wl.concurrency)
    )


class BlockPoolWorker:
    def __init__(
        self, num_requests: int, num_gpu_blocks: int, num_iteration: int, passes: int
    ):
        self.passes = passes
        self.policies = bl.policies()
        hasher = bl.make_hasher()
        self.num_gpu_blocks = num_gpu_blocks
        self.num_iteration = num_iteration
        self.workloads = [
            bl.workload_churn(num_requests),
            # (c) is cheaper per request (mostly prefix hits): more requests.
            bl.workload_duplicates(4 * num_requests),
        ]
        self.requests = {
            wl.name: bl.build_requests(wl, hasher) for wl in self.workloads
        }
        # One untimed pass of everything (allocator, caches, lazy imports).
        time_upstream(min(num_gpu_blocks, 10000), min(num_iteration, 100))
        for wl in self.workloads:
            for policy in self.policies:
                time_hashed(wl, self.requests[wl.name], policy)

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        if command.get("cmd") == "count":
            return self.count()
        return self.run(command)

    def count(self) -> dict[str, Any]:
        """Bytecode instructions of a's get/free calls (on ``COUNTED_UPSTREAM``:
        what its timed figure covers), of building a's pools (once per pool
        at start-up, not timed), and per hashed workload and policy of b and
        c."""
        num_gpu_blocks, num_iteration = COUNTED_UPSTREAM
        pools: list[Any] = []
        construction = bl.bytecodes_executed(
            lambda: pools.extend(upstream_pools(num_gpu_blocks))
        )
        upstream = bl.bytecodes_executed(lambda: upstream_calls(pools, num_iteration))
        return {
            "bytecodes": {
                "a_upstream": {"-": upstream},
                POOL_CONSTRUCTION: {"-": construction},
                **{
                    wl.name: {
                        bl.policy_label(policy): count_hashed(
                            wl, self.requests[wl.name], policy
                        )
                        for policy in self.policies
                    }
                    for wl in self.workloads
                },
            }
        }

    def run(self, command: dict[str, Any]) -> dict[str, Any]:
        rep = int(command["repeat"])
        out: dict[str, Any] = {"repeat": rep, "times": {}}
        up = time_upstream(self.num_gpu_blocks, self.num_iteration)
        out["times"]["a_upstream"] = {"-": up["seconds"]}
        out["upstream_detail"] = up
        k = rep % len(self.policies)
        order = self.policies[k:] + self.policies[:k]
        for wl in self.workloads:
            per: dict[str, float] = {}
            for policy in order:
                per[bl.policy_label(policy)] = time_hashed(
                    wl, self.requests[wl.name], policy, self.passes
                )
            out["times"][wl.name] = per
        return out


def make_handler(argv: list[str]) -> Any:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree")
    ap.add_argument("--num-requests", type=int, required=True)
    ap.add_argument("--num-gpu-blocks", type=int, required=True)
    ap.add_argument("--num-iteration", type=int, required=True)
    ap.add_argument("--passes", type=int, required=True)
    a = ap.parse_args(argv)
    w = BlockPoolWorker(a.num_requests, a.num_gpu_blocks, a.num_iteration, a.passes)
    return w.handle


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------


def summarize(
    runs: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    """Medians, half-splits and patched/unpatched ratios."""
    rows: list[dict[str, Any]] = []
    series: dict[tuple[str, str, str], list[float]] = {}
    for tree, reps in runs.items():
        for rep in reps:
            for wl, per in rep["times"].items():
                for policy, sec in per.items():
                    series.setdefault((tree, wl, policy), []).append(float(sec))
    for (tree, wl, policy), xs in sorted(series.items()):
        h = len(xs) // 2
        first, second = xs[:h] or xs, xs[h:]
        m1, m2 = bl.median(first), bl.median(second)
        med = bl.median(xs)
        rows.append(
            {
                "tree": tree,
                "workload": wl,
                "policy": policy,
                "n": len(xs),
                "median_s": med,
                "min_s": min(xs),
                "max_s": max(xs),
                "half1_median_s": m1,
                "half2_median_s": m2,
                "half_spread": abs(m1 - m2) / med if med else float("nan"),
                "all_s": xs,
            }
        )
    ratios: list[dict[str, Any]] = []
    base = {
        r["workload"]: r for r in rows if r["tree"] == "unpatched"
    }  # one policy per workload on the unpatched tree
    for r in rows:
        if r["tree"] != "patched" or r["workload"] not in base:
            continue
        b = base[r["workload"]]
        ratios.append(
            {
                "workload": r["workload"],
                "policy": r["policy"],
                "patched_median_s": r["median_s"],
                "unpatched_median_s": b["median_s"],
                "ratio": r["median_s"] / b["median_s"],
                # The same ratio from each time-ordered half of the repeats.
                "ratio_half1": r["half1_median_s"] / b["half1_median_s"],
                "ratio_half2": r["half2_median_s"] / b["half2_median_s"],
                # Same-version noise, as a ratio: half 2 / half 1 of each tree.
                "patched_half_ratio": r["half2_median_s"] / r["half1_median_s"],
                "unpatched_half_ratio": b["half2_median_s"] / b["half1_median_s"],
            }
        )
    return {"rows": rows, "ratios": ratios}


def bytecode_ratios(
    counts: dict[str, dict[str, dict[str, int]]],
) -> list[dict[str, Any]]:
    """Patched/unpatched bytecode counts per hashed workload and policy."""
    out = []
    for wl, per in counts["patched"].items():
        (base,) = counts["unpatched"][wl].values()
        for policy, n in per.items():
            out.append(
                {
                    "workload": wl,
                    "policy": policy,
                    "patched": n,
                    "unpatched": base,
                    "ratio": n / base,
                }
            )
    return out


def worker_args(num_requests: int, quick: bool) -> list[str]:
    """The workers' command line: the workloads' sizes."""
    return [
        "--num-requests",
        str(num_requests),
        "--num-gpu-blocks",
        str(10000 if quick else 100000),
        "--num-iteration",
        str(100 if quick else 1000),
        "--passes",
        str(1 if quick else PASSES),
    ]


def generations(repeats: int, quick: bool, per_process: int) -> tuple[int, list[range]]:
    """Repeats per pair of worker processes, and each pair's repeats."""
    # Generations of worker processes: ``per_process`` repeats in each pair
    # of processes, then a fresh pair, so that the medians (and the half-split)
    # also sample the spread between separate processes (memory layout and
    # the like persist within a process and bias all its repeats alike).
    # A smoke run (``quick``) keeps one generation: fewer start-ups.
    step = repeats if quick or per_process <= 0 else per_process
    return step, [range(i, min(i + step, repeats)) for i in range(0, repeats, step)]


def run_repeats(
    session: bl.Session,
    reps: range,
    gen: int,
    repeats: int,
    runs: dict[str, list[dict[str, Any]]],
    log: Any,
) -> None:
    """One generation's timed repeats, the trees alternated ABAB (the
    order flipped every repeat), appended to ``runs``."""
    for rep in reps:
        order = ["patched", "unpatched"] if rep % 2 == 0 else ["unpatched", "patched"]
        for name in order:
            res = session.call(name, {"cmd": "run", "repeat": rep})
            res["order"] = order.index(name)
            res["generation"] = gen
            runs[name].append(res)
        print(
            f"[block_pool] repeat {rep + 1}/{repeats} done (process "
            f"generation {gen + 1})",
            file=log,
            flush=True,
        )


def drive(
    python: str,
    patched: Path,
    unpatched: Path,
    repeats: int,
    quick: bool,
    log: Any = sys.stderr,
    shared: dict[str, bl.Worker] | None = None,
    per_process: int = 1,
) -> dict[str, Any]:
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, not {repeats}")
    num_requests = 150 if quick else 1500
    args = worker_args(num_requests, quick)
    trees = {"patched": patched, "unpatched": unpatched}
    t0 = time.time()
    started = f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC"
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    step, gens = generations(repeats, quick, per_process)
    infos: dict[str, Any] = {}
    for gen, reps in enumerate(gens):
        # ``shared`` workers, if given, serve the first generation.
        session = bl.Session(
            "block_pool",
            python,
            Path(__file__).resolve(),
            trees,
            args,
            shared if gen == 0 else None,
        )
        infos = session.infos
        try:
            run_repeats(session, reps, gen, repeats, runs, log)
            if gen == len(gens) - 1:
                # Once, after the timed repeats: tracing is slow.
                counts = {
                    name: session.call(name, {"cmd": "count"})["bytecodes"]
                    for name in trees
                }
                print("[block_pool] bytecode counts done", file=log, flush=True)
        finally:
            session.close()
    summary = summarize(runs)
    return {
        "bench": "block_pool",
        "started": started,
        "repeats": repeats,
        "repeats_per_process": step,
        "process_generations": len(gens),
        "quick": quick,
        "num_requests": num_requests,
        "worker_args": args,
        "trees": {k: str(v) for k, v in trees.items()},
        "provenance": infos,
        "wall_s": time.time() - t0,
        "runs": runs,
        "bytecodes": bytecode_ratios(counts),
        **summary,
    }


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--repeats-per-process", type=int, default=1)


def run(a: argparse.Namespace) -> dict[str, Any]:
    return drive(
        a.python,
        a.patched_tree,
        a.unpatched_tree,
        a.repeats,
        a.quick,
        per_process=a.repeats_per_process,
    )


def summary(res: dict[str, Any]) -> Iterator[str]:
    for r in res["ratios"]:
        yield (
            f"{r['workload']:<13} {r['policy']:<10} ratio={r['ratio']:.3f} "
            f"(patched {r['patched_median_s']:.4f}s / "
            f"unpatched {r['unpatched_median_s']:.4f}s)"
        )
    for r in res["bytecodes"]:
        yield (
            f"{r['workload']:<13} {r['policy']:<10} bytecode ratio={r['ratio']:.4f} "
            f"({r['patched']} / {r['unpatched']})"
        )


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
