"""Cost of the KV-event snapshot record (patch 0008), measured in one run.

    PYTHONPATH=build/tree "$PY" ci/bench/bench_snapshot.py --out docs/benchmarks

``PYTHONPATH`` names a patched tree; ``$PY`` is the test venv's python
(``PYTHONPATH=ci python3 -m overlay_harness.testenv dist/vllm-0.33.0*.whl``),
which has the engine's requirements. It writes ``snapshot.json``:

* ``live``: the real ``ZmqEventPublisher`` publishing the same stream of
  batches (each 4 stored runs of 8 blocks of 16 tokens and 32 removed keys,
  about 8,000 keys held) with the record on and off (``snapshot_max_keys``
  1,000,000 and 0; both with a replay socket), alternated ABAB; per repeat
  the time from the first ``publish`` to the last batch read by a SUB socket
  on 127.0.0.1. Medians per mode, their ratio, and the spread of each mode
  (its first half of repeats against its second).
  Wall time and the process's CPU time (all threads), the latter less
  disturbed by a loaded machine.
* ``apply_cpu_us_per_batch``: ``KVEventRecord.apply`` alone on the same
  batches (thread CPU time).
* ``memory``: bytes per held key (tracemalloc) of a record built from such
  stores, the announcing events included (the record keeps them alive).
* ``snapshot``: for 1k, 10k and 100k held keys, the time from a snapshot
  request to its end message at the consumer over ZMQ, the record's copy
  (the one step done at once) and the longest single batch (built, encoded,
  sent; median and longest), i.e. the pause a live batch can see.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventRecord,
    ZmqEventPublisher,
)
from vllm.v1.core.kv_cache_utils import ExternalBlockHash

BLOCK = 16
RUN = 8
Event = BlockStored | BlockRemoved | AllBlocksCleared


class Stream:
    """A steady stream: runs of new blocks stored, the oldest keys removed."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_hash = 1
        self.held: list[ExternalBlockHash] = []

    def stores(self, runs: int) -> list[Event]:
        out: list[Event] = []
        for _ in range(runs):
            hashes: list[ExternalBlockHash] = list(
                range(self.next_hash, self.next_hash + RUN)
            )
            self.next_hash += RUN
            out.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=[
                        self.rng.randrange(1000, 32000) for _ in range(RUN * BLOCK)
                    ],
                    block_size=BLOCK,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            )
            self.held.extend(hashes)
        return out

    def batch(self, runs: int = 4, removals: int = 32) -> KVEventBatch:
        events = self.stores(runs)
        if len(self.held) > 8000:
            gone, self.held = self.held[:removals], self.held[removals:]
            events.append(BlockRemoved(block_hashes=gone, medium="GPU", group_idx=0))
        return KVEventBatch(ts=time.time(), events=events)


def publish_time(batches: list[KVEventBatch], max_keys: int) -> tuple[float, float]:
    """Wall and CPU seconds (this process, all threads) from the first
    ``publish`` to the last batch read."""
    pub = ZmqEventPublisher(
        0,
        endpoint="tcp://*:0",
        replay_endpoint="tcp://*:0",
        buffer_steps=1000,
        snapshot_max_keys=max_keys,
    )
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(pub.get_publisher_config().endpoint)
    time.sleep(0.3)  # the SUB must be connected before the first batch
    try:
        start, cpu = time.perf_counter(), time.process_time()
        for batch in batches:
            pub.publish(batch)
        last = -1
        while last < len(batches) - 1:
            if not sub.poll(5000):
                raise RuntimeError(f"stalled after seq {last}")
            last = int.from_bytes(sub.recv_multipart()[1], "big")
        return time.perf_counter() - start, time.process_time() - cpu
    finally:
        sub.close(linger=0)
        pub.shutdown()


def live(repeats: int, n_batches: int) -> dict[str, Any]:
    stream = Stream(0)
    warm = [stream.batch() for _ in range(400)]  # fills to ~8,000 held keys
    batches = warm + [stream.batch() for _ in range(n_batches)]
    times: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(repeats):
        for mode in ("on", "off"):  # ABAB
            wall, used = publish_time(batches, 1_000_000 if mode == "on" else 0)
            times[mode].append(wall)
            cpu[mode].append(used)

    def per_batch_us(samples: dict[str, list[float]]) -> dict[str, float]:
        return {
            m: statistics.median(t) / len(batches) * 1e6 for m, t in samples.items()
        }

    def spread(samples: dict[str, list[float]]) -> dict[str, float]:
        half = repeats // 2
        return {
            m: statistics.median(t[:half]) / statistics.median(t[half:])
            for m, t in samples.items()
        }

    wall_us, cpu_us = per_batch_us(times), per_batch_us(cpu)
    record = KVEventRecord("logical")
    start = time.thread_time()
    for batch in batches:
        record.apply(batch.events)
    apply_us = (time.thread_time() - start) / len(batches) * 1e6
    return {
        "batches": len(batches),
        "events_per_batch": "4 BlockStored x 8 blocks x 16 tokens, 1 BlockRemoved x 32",
        "wall_seconds": times,
        "cpu_seconds": cpu,
        "wall_us_per_batch": wall_us,
        "cpu_us_per_batch": cpu_us,
        "wall_ratio_on_over_off": wall_us["on"] / wall_us["off"],
        "cpu_ratio_on_over_off": cpu_us["on"] / cpu_us["off"],
        "wall_spread_first_half_over_second": spread(times),
        "cpu_spread_first_half_over_second": spread(cpu),
        "apply_cpu_us_per_batch": apply_us,
        "held_keys_at_end": record.num_keys,
    }


def memory(keys: int) -> dict[str, Any]:
    stream = Stream(1)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    record = KVEventRecord("logical")
    record.apply(stream.stores(keys // RUN))
    stream.held.clear()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {
        "keys": record.num_keys,
        "bytes_per_key": (after - before) / record.num_keys,
    }


def snapshot(keys: int, repeats: int) -> dict[str, Any]:
    pub = ZmqEventPublisher(0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    stream = Stream(2)
    for _ in range(-(-keys // (RUN * 16))):
        pub.publish(KVEventBatch(ts=time.time(), events=stream.stores(16)))
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    replay = pub.get_publisher_config().replay_endpoint
    assert replay is not None  # bound above
    dealer.connect(replay)
    request = msgspec.msgpack.encode({"op": "snapshot"})
    totals, held = [], 0
    try:
        time.sleep(0.5)
        for _ in range(repeats):
            start = time.perf_counter()
            dealer.send_multipart((b"", request))
            while True:
                frames = dealer.recv_multipart()
                if frames[2] == ZmqEventPublisher.END_SEQ:
                    info = msgspec.msgpack.decode(frames[3])
                    break
            totals.append(time.perf_counter() - start)
            assert info["status"] == "ok", info
            held = info["keys"]
    finally:
        dealer.close(linger=0)
        pub.shutdown()
    # The publisher thread's two kinds of turn, timed alone on the same record.
    record = KVEventRecord("logical")
    record.apply(stream.stores(keys // RUN))
    encoder = msgspec.msgpack.Encoder()
    copies, longest, typical = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        batches = record.snapshot(ZmqEventPublisher.SNAPSHOT_KEYS_PER_BATCH)
        copies.append(time.perf_counter() - start)
        turns = []
        while True:
            start = time.perf_counter()
            events = next(batches, None)
            if events is None:
                break
            encoder.encode(KVEventBatch(ts=0.0, events=events))
            turns.append(time.perf_counter() - start)
        longest.append(max(turns))
        typical.append(statistics.median(turns))
    return {
        "held_keys": held,
        "request_to_end_ms": statistics.median(totals) * 1e3,
        "request_to_end_ms_all": [t * 1e3 for t in totals],
        "copy_ms": statistics.median(copies) * 1e3,
        "longest_batch_ms": statistics.median(longest) * 1e3,
        "median_batch_ms": statistics.median(typical) * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="write snapshot.json here")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--batches", type=int, default=2000)
    args = ap.parse_args(argv)
    # tcp://*:0 binds VLLM_HOST_IP on a free port.
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if not args.out.is_dir():
        print(f"error: --out {args.out} is not a directory", file=sys.stderr)
        return 2
    result = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "live": live(args.repeats, args.batches),
        "memory": memory(100_000),
        "snapshot": [snapshot(n, 5) for n in (1_000, 10_000, 100_000)],
    }
    path = args.out / "snapshot.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
