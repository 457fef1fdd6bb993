"""Router accuracy: prefix hits scored from the KV-event stream vs the engine.

vLLM's real v1 ``Scheduler`` (with its ``KVCacheManager`` and ``BlockPool``)
runs a trace with model outputs made up here (no model): shared system
prompts, exactly repeated block-aligned prompts, random user turns, a small
GPU cache (eviction pressure).  The publisher is replaced by a capture that
receives exactly the ``KVEventBatch`` objects the scheduler would hand to
``ZmqEventPublisher.publish``; every event is fed to two router mirrors:

* set mirror: BlockStored adds, BlockRemoved discards, AllBlocksCleared clears;
* counting mirror: +1 per stored hash, -1 per removed hash, dropped at 0.

For every new request, right before it is added to the scheduler (the event
queue is drained at that point: events are published at the end of each
``update_from_output``), the score of each mirror (longest prefix of the
request's block hashes present in it) is compared with

* ``engine``: what ``KVCacheManager.get_computed_blocks`` finds (capped, as
  the engine caps it, at ``num_tokens - 1`` tokens; the mirror score is capped
  the same way);
* ``index``: the longest prefix present in the pool's own prefix index
  (uncapped, the pool's ``get_cached_block``).

Reported per policy and mirror: exact-match rate, mean absolute error in
blocks, how often the mirror over- and under-scores, plus event volume.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import benchlib as bl

DEFAULT_MODEL_DIR = (
    Path(__file__).resolve().parents[2] / "tests" / "data" / "tiny-model"
)
MAX_MODEL_LEN = 512


# --------------------------------------------------------------------------
# worker
# --------------------------------------------------------------------------


Trace = list[tuple[list[int], int, int]]


def make_chat_trace(num_requests: int, seed: int = 3) -> Trace:
    """(prompt, max_tokens, arrivals-before-next-step marker) per request.

    Prompts: one of 6 shared system prompts (2-5 blocks, skewed popularity),
    then one of: a canned block-aligned question (8 of them, 1-2 blocks, so
    the whole prompt repeats exactly and is block-aligned: its last block is
    recomputed into a new physical copy), 40 %; the same followed by a random
    follow-up turn (3-40 tokens), so the duplicated block sits inside the
    prefix, 30 %; a random user turn (3-40 tokens), 30 %.  The third field
    is the number of requests that arrive together at that step (set on the
    first of a group, 0 on the others).
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    bs = bl.BLOCK_SIZE
    systems = [
        rng.integers(1000, 32000, size=int(rng.integers(2, 6)) * bs).tolist()
        for _ in range(6)
    ]
    canned = [
        rng.integers(1000, 32000, size=int(rng.integers(1, 3)) * bs).tolist()
        for _ in range(8)
    ]
    ws = 1.0 / np.arange(1, len(systems) + 1)
    ws /= ws.sum()
    trace: Trace = []
    made = 0
    while made < num_requests:
        group = min(int(rng.poisson(0.8)), num_requests - made)
        made += group
        for j in range(group):
            sys_p = systems[int(rng.choice(len(systems), p=ws))]
            u = rng.random()
            if u < 0.4:
                user = canned[int(rng.integers(0, len(canned)))]
            elif u < 0.7:
                # A follow-up turn: a repeated block-aligned prompt (whose last
                # block may have several physical copies) plus a new turn.
                user = canned[int(rng.integers(0, len(canned)))]
                user = (
                    user
                    + rng.integers(1000, 32000, size=int(rng.integers(3, 41))).tolist()
                )
            else:
                user = rng.integers(1000, 32000, size=int(rng.integers(3, 41))).tolist()
            trace.append(
                (sys_p + user, int(rng.integers(1, 9)), group if j == 0 else 0)
            )
        if group == 0:
            trace.append(([], 0, 0))  # a step with no arrival
    return trace


def make_family_trace(num_requests: int, seed: int = 5) -> Trace:
    """The seed's pattern, many times: block-aligned prefixes of long prompts.

    6 prompt families of 8 blocks each; a request takes a random family and a
    random block-aligned prefix of it (2-8 blocks), so a short request
    recomputes a block that sits inside the longer requests' prefix (the
    seed's request A ``H1..H3`` vs request B ``H1..H7``).  Up to 2 arrivals
    per step, 1-4 output tokens.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    bs = bl.BLOCK_SIZE
    families = [rng.integers(1000, 32000, size=8 * bs).tolist() for _ in range(6)]
    trace: Trace = []
    made = 0
    while made < num_requests:
        group = min(int(rng.integers(0, 3)), num_requests - made)
        made += group
        for j in range(group):
            fam = families[int(rng.integers(0, len(families)))]
            n = int(rng.integers(2, 9))
            trace.append(
                (fam[: n * bs], int(rng.integers(1, 5)), group if j == 0 else 0)
            )
        if group == 0:
            trace.append(([], 0, 0))
    return trace


# name -> (trace builder, max_num_seqs)
TRACES: dict[str, tuple[Any, int]] = {
    "chat": (make_chat_trace, 4),
    "families": (make_family_trace, 3),
}


def trace_scheduler(
    model_dir: str, policy: str | None, num_gpu_blocks: int, max_num_seqs: int
) -> Any:
    """A real v1 Scheduler with KV events on (``policy``: its
    ``copy_semantics``; None leaves the field out)."""
    kv_events: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "null"}
    if policy is not None:
        kv_events["copy_semantics"] = policy
    from vllm.config import KVEventsConfig

    return bl.make_cpu_scheduler(
        model_dir,
        num_gpu_blocks,
        max_num_seqs,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=2048,
        seed=0,
        kv_events_config=KVEventsConfig(**kv_events),
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
    )


def arrival_sample(req: Any, kvm: Any, mirrors: dict[str, Any]) -> dict[str, int]:
    """A request's prefix hit as it arrives: the engine's, the longest
    prefix in the pool's index, and each mirror's, capped as the engine
    caps it and uncapped."""
    from vllm.distributed.kv_events import MEDIUM_GPU
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    pool = kvm.block_pool
    keys = [(MEDIUM_GPU, 0, maybe_convert_block_hash(h)) for h in req.block_hashes]
    max_hit = (req.num_tokens - 1) // bl.BLOCK_SIZE
    _, ntok, *_ = kvm.get_computed_blocks(req)
    index_hit = 0
    for h in req.block_hashes:
        if pool.get_cached_block(h, [0]) is None:
            break
        index_hit += 1
    s = {"engine": ntok // bl.BLOCK_SIZE, "index": index_hit}
    for name, m in mirrors.items():
        s[f"{name}_capped"] = bl.prefix_len(keys[:max_hit], m.__contains__)
        s[f"{name}_full"] = bl.prefix_len(keys, m.__contains__)
    return s


def mirror_scores(
    samples: list[dict[str, int]], mirrors: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Each mirror's score against the engine (capped) and the index
    (uncapped), over every request."""
    scores: dict[str, dict[str, Any]] = {}
    for name in mirrors:
        for ref, col in (("engine", f"{name}_capped"), ("index", f"{name}_full")):
            diffs = [s[col] - s[ref] for s in samples]
            n = len(diffs)
            scores[f"{name}_vs_{ref}"] = {
                "n": n,
                "exact_rate": sum(d == 0 for d in diffs) / n if n else float("nan"),
                "mae_blocks": sum(abs(d) for d in diffs) / n if n else float("nan"),
                "over": sum(d > 0 for d in diffs),
                "under": sum(d < 0 for d in diffs),
                "max_abs": max((abs(d) for d in diffs), default=0),
            }
    return scores


def run_trace(
    model_dir: str,
    trace_name: str,
    policy: str | None,
    num_requests: int,
    num_gpu_blocks: int,
    max_steps: int,
) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(4)
    make, max_num_seqs = TRACES[trace_name]
    scheduler = trace_scheduler(model_dir, policy, num_gpu_blocks, max_num_seqs)
    # The scheduler hands it exactly the batches ZmqEventPublisher would get.
    cap = bl.EventTap()
    scheduler.kv_event_publisher = cap
    kvm = scheduler.kv_cache_manager
    pool = kvm.block_pool
    hasher = bl.make_hasher()
    trace = make(num_requests)

    def step() -> None:
        bl.step(scheduler, lambda _request: int(rng.integers(1000, 32000)))

    samples: list[dict[str, int]] = []
    pending_at_arrival = 0
    steps = 0
    i = 0
    n_req = 0
    while i < len(trace) or scheduler.has_unfinished_requests():
        if i < len(trace):
            prompt, max_tokens, group = trace[i]
            take = max(group, 1)
            for prompt, max_tokens, _ in trace[i : i + take]:
                if not prompt:
                    continue
                req = bl.make_request(f"r{n_req}", prompt, hasher, max_tokens)
                n_req += 1
                pending_at_arrival += len(pool.kv_event_queue)
                samples.append(arrival_sample(req, kvm, cap.mirrors))
                scheduler.add_request(req)
            i += take
        if scheduler.has_unfinished_requests():
            step()
            steps += 1
        if steps > max_steps:
            raise RuntimeError(f"trace did not finish in {max_steps} steps")
    end_check = cap.mirror_check(bl.resident_external_keys(pool))
    scores = mirror_scores(samples, cap.mirrors)
    scheduler.shutdown()
    return {
        "trace": trace_name,
        "max_num_seqs": max_num_seqs,
        "requests": len(samples),
        "steps": steps,
        "num_gpu_blocks": num_gpu_blocks,
        "mean_engine_hit_blocks": sum(s["engine"] for s in samples) / len(samples),
        "requests_with_hit": sum(s["engine"] > 0 for s in samples),
        "pending_events_at_arrival": pending_at_arrival,
        "scores": scores,
        "end_check": end_check,
        "events": cap.totals(),
    }


class RouterWorker:
    def __init__(self, model_dir: str, num_requests: int, num_gpu_blocks: int):
        self.model_dir = model_dir
        self.num_requests = num_requests
        self.num_gpu_blocks = num_gpu_blocks
        self.policies = bl.policies()

    def run(self, command: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for trace_name in TRACES:
            for policy in self.policies:
                out.setdefault(trace_name, {})[bl.policy_label(policy)] = run_trace(
                    self.model_dir,
                    trace_name,
                    policy,
                    self.num_requests,
                    self.num_gpu_blocks,
                    max_steps=50 * self.num_requests + 100,
                )
        return out


def make_handler(argv: list[str]) -> Any:
    import logging

    ap = argparse.ArgumentParser()
    ap.add_argument("--tree")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--num-requests", type=int, required=True)
    ap.add_argument("--num-gpu-blocks", type=int, required=True)
    a = ap.parse_args(argv)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    return RouterWorker(a.model_dir, a.num_requests, a.num_gpu_blocks).run


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------


def drive(
    python: str,
    patched: Path,
    unpatched: Path,
    quick: bool,
    model_dir: Path = DEFAULT_MODEL_DIR,
    num_gpu_blocks: int = 40,
    log: Any = sys.stderr,
    shared: dict[str, bl.Worker] | None = None,
) -> dict[str, Any]:
    num_requests = 60 if quick else 600
    trees = {"patched": patched, "unpatched": unpatched}
    args = [
        "--model-dir",
        str(model_dir.resolve()),
        "--num-requests",
        str(num_requests),
        "--num-gpu-blocks",
        str(num_gpu_blocks),
    ]
    t0 = time.time()
    session = bl.Session(
        "router", python, Path(__file__).resolve(), trees, args, shared
    )
    results = bl.run_trees(session, trees, log)
    rows: list[dict[str, Any]] = []
    for tree, per_trace in results.items():
        for trace_name, per_policy in per_trace.items():
            for policy, r in per_policy.items():
                for key, sc in r["scores"].items():
                    mirror, ref = key.split("_vs_")
                    rows.append(
                        {
                            "tree": tree,
                            "trace": trace_name,
                            "policy": policy,
                            "mirror": mirror,
                            "reference": ref,
                            **sc,
                        }
                    )
    return {
        "bench": "router",
        "quick": quick,
        "num_requests": num_requests,
        "num_gpu_blocks": num_gpu_blocks,
        "trees": {k: str(v) for k, v in trees.items()},
        "provenance": session.infos,
        "wall_s": time.time() - t0,
        "results": results,
        "rows": rows,
    }


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--num-gpu-blocks", type=int, default=40)


def run(a: argparse.Namespace) -> dict[str, Any]:
    return drive(
        a.python,
        a.patched_tree,
        a.unpatched_tree,
        a.quick,
        a.model_dir,
        a.num_gpu_blocks,
    )


def summary(res: dict[str, Any]) -> Iterator[str]:
    for r in res["rows"]:
        yield (
            f"{r['tree']:<9} {r['trace']:<8} {r['policy']:<9} {r['mirror']:<5} "
            f"vs {r['reference']:<6} "
            f"exact {r['exact_rate']:.3f} mae {r['mae_blocks']:.3f} "
            f"over {r['over']} under {r['under']}"
        )


def main(argv: list[str] | None = None) -> int:
    return bl.bench_main(argv, __doc__, make_handler, run, summary, add_args)


if __name__ == "__main__":
    sys.exit(main())
