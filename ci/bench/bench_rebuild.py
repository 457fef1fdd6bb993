"""Cost of rebuilding a lost snapshot record from the block pool (0011).

    PYTHONPATH=build/tree "$PY" ci/bench/bench_rebuild.py --out docs/benchmarks

``PYTHONPATH`` names a patched tree; ``$PY`` is the test venv's python
(as for ``bench_snapshot.py``). It writes ``rebuild.json``:

* ``announcements``: what keeping each cached key's announcement costs the
  block pool's hot path: ``bench_block_pool.py``'s churn workload (random
  prompts of 4-32 blocks through a real ``BlockPool`` of 1,024 blocks,
  events on, ``copy_semantics`` "logical", vLLM's envs cache on as in a
  running engine), in this process, with the
  announcements kept and not, alternated ABAB, a fresh pool per run;
  median seconds per mode, their ratio, and the spread of each mode (its
  first half of repeats against its second).
* ``rebuild`` (per held keys): a real ``ZmqEventPublisher`` following a
  real ``BlockPool`` that holds that many keys (stores of 512 blocks of 16
  tokens, none evicted), its record process killed, while this thread
  publishes an empty batch and calls ``serve()`` every millisecond, as an
  engine's steps do: the seconds from the kill until ``status`` says
  snapshots are served again, and the longest ``serve()`` call (the
  engine thread's pause: the copy of the announcements).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import benchlib as bl
from bench_snapshot import record_process, status, write_report
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
from vllm.envs import enable_envs_cache

STORE_BLOCKS = 512
# Until snapshots are back; the first ask comes RECORD_REBUILD_S after the
# loss is seen.
BACK_TIMEOUT_S = 120.0


def _spread(samples: list[float]) -> float:
    half = len(samples) // 2
    return statistics.median(samples[:half]) / statistics.median(samples[half:])


def announcements(repeats: int, num_requests: int) -> dict[str, Any]:
    workload = bl.workload_churn(num_requests)
    requests = bl.build_requests(workload, bl.make_hasher())
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    for repeat in range(repeats):
        for mode in ("on", "off") if repeat % 2 else ("off", "on"):
            pool = bl.make_pool(workload.num_blocks, events=True, policy="logical")
            if mode == "on":
                pool.keep_announcements()
            gc.collect()
            start = time.perf_counter()
            bl.run_pool_workload(pool, requests, workload.concurrency)
            seconds[mode].append(time.perf_counter() - start)
    median = {mode: statistics.median(s) for mode, s in seconds.items()}
    return {
        "workload": workload.name,
        "requests": num_requests,
        "repeats": repeats,
        "seconds": seconds,
        "median_s": median,
        "ratio_on_over_off": median["on"] / median["off"],
        "spread_first_half_over_second": {m: _spread(s) for m, s in seconds.items()},
    }


def _filled_pool(keys: int) -> Any:
    """A pool holding ``keys`` keys (rounded up to whole stores), with its
    announcements, and the events that stored them not yet taken."""
    hasher = bl.make_hasher()
    stores = -(-keys // STORE_BLOCKS)
    pool = bl.make_pool(stores * STORE_BLOCKS + 1, events=True, policy="logical")
    pool.keep_announcements()
    for i in range(stores):
        prompt = [(i * STORE_BLOCKS + t) % 30000 + 1000 for t in range(STORE_BLOCKS)]
        prompt = [token for t in prompt for token in (t,) * bl.BLOCK_SIZE]
        request = bl.make_request(f"fill-{i}", prompt, hasher)
        blocks = pool.get_new_blocks(STORE_BLOCKS)
        pool.cache_full_blocks(request, blocks, 0, STORE_BLOCKS, bl.BLOCK_SIZE, 0)
        pool.free_blocks(reversed(blocks))
    return pool


def rebuild(keys: int) -> dict[str, Any]:
    pool = _filled_pool(keys)
    pub = ZmqEventPublisher(
        0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0", snapshot_max_keys=2 * keys
    )
    try:
        if not pub.rebuild_from(pool.record_base):
            raise RuntimeError("the publisher keeps no record to rebuild")
        pub.publish(KVEventBatch(ts=time.time(), events=pool.take_events()))
        while status(pub)["snapshot"]["next_seq"] != 1:
            time.sleep(0.05)
        held = status(pub)["snapshot"]["held_keys"]
        recorder = record_process()
        if recorder is None:
            raise RuntimeError("the publisher started no record process")
        killed = time.monotonic()
        recorder.kill()
        serve_s: list[float] = []
        seen_off = False
        next_status = 0.0
        while True:
            now = time.monotonic()
            assert now - killed < BACK_TIMEOUT_S, "snapshots did not come back"
            pub.publish(KVEventBatch(ts=time.time(), events=[]))
            start = time.perf_counter()
            pub.serve()
            serve_s.append(time.perf_counter() - start)
            if now >= next_status:
                next_status = now + 0.05
                enabled = status(pub)["snapshot"]["enabled"]
                seen_off |= not enabled
                if seen_off and enabled:
                    break
            time.sleep(0.001)
        back_s = time.monotonic() - killed
        return {
            "held_keys": held,
            "kill_to_served_s": back_s,
            "rebuild_delay_s": pub.RECORD_REBUILD_S,
            "longest_serve_ms": max(serve_s) * 1000,
            "median_serve_us": statistics.median(serve_s) * 1e6,
            "held_keys_after": status(pub)["snapshot"]["held_keys"],
        }
    finally:
        pub.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="write rebuild.json here")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--keys", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    args = ap.parse_args(argv)
    if not args.out.is_dir():
        print(f"error: --out {args.out} is not a directory", file=sys.stderr)
        return 2
    # tcp://*:0 binds VLLM_HOST_IP on a free port.
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    # As EngineCore after start-up: vllm.envs cached (one os.environ read
    # per event hash otherwise), the import-time heap frozen.
    enable_envs_cache()
    gc.collect()
    gc.freeze()
    result = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_before": os.getloadavg(),
        "announcements": announcements(args.repeats, args.requests),
        "rebuild": [rebuild(keys) for keys in args.keys],
        "load_average_after": os.getloadavg(),
    }
    write_report(args.out / "rebuild.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
