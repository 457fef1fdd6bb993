"""KV-event volume per workload and copy-semantics policy, against the minimum.

The hashed workloads of ``bench_block_pool.py`` (b_churn, c_duplicates) run
once per policy on the patched tree and once on the unpatched tree (its only
behaviour, labelled ``upstream``; it should equal ``physical``).  Every
``take_events()`` drain is one ``KVEventBatch``, encoded as
``ZmqEventPublisher`` encodes it (``msgspec.msgpack.Encoder().encode(batch)``,
sent as the frames topic, 8-byte sequence number, payload).

Counted: BlockStored / BlockRemoved events, the block hashes they carry,
messages, payload bytes and frame bytes.  The minimum is counted from the
pool's own index (``cached_block_hash_to_block``), not from events: after
every pool call the set of keys with at least one resident copy is compared
with the set before it; each key that appears is one necessary store, each
key that disappears one necessary removal.  At the end the events are also
replayed into a set mirror and a reference-counting mirror and compared with
the pool's resident keys (stale = mirror holds a key the pool dropped,
missing = the pool holds a key the mirror lacks).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import benchlib as bl

# --------------------------------------------------------------------------
# worker
# --------------------------------------------------------------------------


def measure(
    wl: bl.PoolWorkload, requests: list[Any], policy: str | None
) -> dict[str, Any]:
    from vllm.distributed.kv_events import KVEventBatch

    pool = bl.make_pool(wl.num_blocks, events=True, policy=policy)
    tap = bl.EventTap()
    state: dict[str, Any] = {"prev": set(), "min_stores": 0, "min_removals": 0}

    def on_op() -> None:
        now = bl.resident_keys(pool)
        prev = state["prev"]
        state["min_stores"] += len(now - prev)
        state["min_removals"] += len(prev - now)
        state["prev"] = now

    def on_batch(events: list[Any]) -> None:
        if not events:
            return  # the scheduler publishes nothing for an empty step
        tap.publish(KVEventBatch(ts=time.time(), events=events))

    bl.run_pool_workload(pool, requests, wl.concurrency, on_batch=on_batch, on_op=on_op)
    truth = bl.resident_external_keys(pool)
    return {
        **tap.totals(),
        "min_stores": state["min_stores"],
        "min_removals": state["min_removals"],
        "resident_keys_at_end": len(truth),
        "mirror_check_at_end": tap.mirror_check(truth),
    }


class EventsWorker:
    def __init__(self, num_requests: int) -> None:
        self.policies = bl.policies()
        hasher = bl.make_hasher()
        self.workloads = [
            bl.workload_churn(num_requests),
            bl.workload_duplicates(4 * num_requests),
        ]
        self.requests = {
            wl.name: bl.build_requests(wl, hasher) for wl in self.workloads
        }

    def run(self, command: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for wl in self.workloads:
            for policy in self.policies:
                out.setdefault(wl.name, {})[bl.policy_label(policy)] = measure(
                    wl, self.requests[wl.name], policy
                )
        return out


def make_handler(argv: list[str]) -> Any:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree")
    ap.add_argument("--num-requests", type=int, required=True)
    a = ap.parse_args(argv)
    return EventsWorker(a.num_requests).run


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------


def drive(
    python: str,
    patched: Path,
    unpatched: Path,
    quick: bool,
    log: Any = sys.stderr,
    shared: dict[str, bl.Worker] | None = None,
) -> dict[str, Any]:
    num_requests = 150 if quick else 1500
    trees = {"patched": patched, "unpatched": unpatched}
    t0 = time.time()
    session = bl.Session(
        "events",
        python,
        Path(__file__).resolve(),
        trees,
        ["--num-requests", str(num_requests)],
        shared,
    )
    results = bl.run_trees(session, trees, log)
    rows: list[dict[str, Any]] = []
    for tree, per_wl in results.items():
        for wl, per_policy in per_wl.items():
            for policy, r in per_policy.items():
                rows.append({"tree": tree, "workload": wl, "policy": policy, **r})
    # Bytes relative to the logical stream of the same workload.
    logical = {
        r["workload"]: r["frame_bytes"]
        for r in rows
        if r["tree"] == "patched" and r["policy"] == "logical"
    }
    for r in rows:
        base = logical.get(r["workload"])
        r["bytes_vs_logical"] = r["frame_bytes"] / base if base else float("nan")
        r["stored_vs_min"] = (
            r["stored_hashes"] / r["min_stores"] if r["min_stores"] else float("nan")
        )
        r["removed_vs_min"] = (
            r["removed_hashes"] / r["min_removals"]
            if r["min_removals"]
            else float("nan")
        )
    return {
        "bench": "events",
        "quick": quick,
        "num_requests": num_requests,
        "trees": {k: str(v) for k, v in trees.items()},
        "provenance": session.infos,
        "wall_s": time.time() - t0,
        "rows": rows,
    }


def run(a: argparse.Namespace) -> dict[str, Any]:
    return drive(a.python, a.patched_tree, a.unpatched_tree, a.quick)


def summary(res: dict[str, Any]) -> Iterator[str]:
    for r in res["rows"]:
        yield (
            f"{r['tree']:<9} {r['workload']:<13} {r['policy']:<9} "
            f"stored {r['stored_hashes']}/{r['min_stores']} "
            f"removed {r['removed_hashes']}/{r['min_removals']} "
            f"bytes {r['frame_bytes']} mirrors {r['mirror_check_at_end']}"
        )


def main(argv: list[str] | None = None) -> int:
    return bl.bench_main(argv, __doc__, make_handler, run, summary)


if __name__ == "__main__":
    sys.exit(main())
