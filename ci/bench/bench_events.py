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
import json
import sys
import time
from pathlib import Path
from typing import Any

import benchlib as bl

# --------------------------------------------------------------------------
# worker
# --------------------------------------------------------------------------


def measure(wl: bl.PoolWorkload, requests: list[Any], policy: str | None) -> dict:
    from vllm.distributed.kv_events import KVEventBatch

    pool = bl.make_pool(wl.num_blocks, events=True, policy=policy)
    wire = bl.WireCounter()
    counts = {
        "stored_events": 0,
        "stored_hashes": 0,
        "removed_events": 0,
        "removed_hashes": 0,
        "cleared_events": 0,
    }
    mirrors = {"set": bl.SetMirror(), "count": bl.CountMirror()}
    state = {"prev": set(), "min_stores": 0, "min_removals": 0}

    def on_op() -> None:
        now = bl.resident_keys(pool)
        prev = state["prev"]
        state["min_stores"] += len(now - prev)
        state["min_removals"] += len(prev - now)
        state["prev"] = now

    def on_batch(events: list[Any]) -> None:
        if not events:
            return  # the scheduler publishes nothing for an empty step
        for k, v in bl.event_counts(events).items():
            counts[k] += v
        wire.add_batch(KVEventBatch(ts=time.time(), events=events))
        for m in mirrors.values():
            for ev in events:
                m.apply(ev)

    bl.run_pool_workload(pool, requests, wl.concurrency, on_batch=on_batch, on_op=on_op)
    truth = {bl.external_key(k) for k in bl.resident_keys(pool)}
    mirror_check = {}
    for name, m in mirrors.items():
        held = m.key_set()
        mirror_check[name] = {
            "stale": len(held - truth),
            "missing": len(truth - held),
            "orphan_removals": m.orphan_removals,
        }
    return {
        **counts,
        "messages": wire.messages,
        "payload_bytes": wire.payload_bytes,
        "frame_bytes": wire.frame_bytes,
        "min_stores": state["min_stores"],
        "min_removals": state["min_removals"],
        "resident_keys_at_end": len(truth),
        "mirror_check_at_end": mirror_check,
    }


class EventsWorker:
    def __init__(self, num_requests: int) -> None:
        self.policies: list[str | None] = (
            list(bl.POLICIES) if bl.has_copy_semantics() else [None]
        )
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
                label = policy if policy is not None else bl.UPSTREAM
                out.setdefault(wl.name, {})[label] = measure(
                    wl, self.requests[wl.name], policy
                )
        return out


def make_handler(argv: list[str]) -> Any:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree")
    ap.add_argument("--num-requests", type=int, required=True)
    a = ap.parse_args(argv)
    return EventsWorker(a.num_requests).run


def worker_main(argv: list[str]) -> None:
    bl.serve(argv[argv.index("--tree") + 1], make_handler(argv))


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
    results: dict[str, Any] = {}
    try:
        for name in trees:
            results[name] = session.call(name, {"cmd": "run"})
            print(f"[events] {name} done", file=log, flush=True)
    finally:
        session.close()
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":
        worker_main(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--patched-tree", type=Path, required=True)
    ap.add_argument("--unpatched-tree", type=Path, required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    res = drive(a.python, a.patched_tree, a.unpatched_tree, a.quick)
    for r in res["rows"]:
        print(
            f"{r['tree']:<9} {r['workload']:<13} {r['policy']:<9} "
            f"stored {r['stored_hashes']}/{r['min_stores']} "
            f"removed {r['removed_hashes']}/{r['min_removals']} "
            f"bytes {r['frame_bytes']} mirrors {r['mirror_check_at_end']}"
        )
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
