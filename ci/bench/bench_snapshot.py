"""Cost of the KV-event snapshot record (patch 0008), measured in one run.

    PYTHONPATH=build/tree "$PY" ci/bench/bench_snapshot.py --out docs/benchmarks

``PYTHONPATH`` names a patched tree; ``$PY`` is the test venv's python
(``PYTHONPATH=ci python3 -m overlay_harness.testenv dist/vllm-0.34.0*.whl``),
which has the engine's requirements. It writes ``snapshot.json``:

* ``live``: the real ``ZmqEventPublisher`` publishing the same stream of
  batches with the record on and off (``snapshot_max_keys`` 1,000,000 and
  0; both with a replay socket), alternated ABAB, in two scenarios
  (``SCENARIOS``): ``held_100k``, 100,000 keys held, and ``churn``, a
  2,000-key cache where half the stores bring back evicted prefixes. A
  batch is what an engine step under eviction sends: 4 requests, each
  evicting 8 blocks (one single-key ``BlockRemoved`` per block, as
  ``BlockPool`` sends them) and storing a run of 8 blocks of 16 tokens.
  The stream is first filled to the scenario's held keys (untimed); per
  repeat the time from the first timed ``publish`` to the last batch read
  by a SUB socket on 127.0.0.1 in another process (``sub_reader.py``), as
  a router reads the stream: this process's CPU is then the engine's side
  alone (a reader in it would add about as much again to both modes).
  Medians per mode, their ratio against ``GOAL``, and the spread of each
  mode (its first half of repeats against its second). Wall time and the
  process's CPU time (all threads), the latter less disturbed by a loaded
  machine; the load average is recorded.
* ``apply_cpu_us_per_batch`` (per scenario): ``KVEventRecord.apply`` alone
  on the same batches (thread CPU time).
* ``memory``: bytes per held key (tracemalloc) of a record built from such
  stores, the announcing events included (the record keeps them alive).
* ``snapshot``: for 1k, 10k and 100k held keys, the time from a snapshot
  request to its end message at the consumer over ZMQ, the record's copy
  (the one step done at once) and the longest single batch (built, encoded,
  sent; median and longest), i.e. the pause a live batch can see.

The import-time heap is frozen out of the garbage collector first, as
``EngineCore`` does after start-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import select
import statistics
import subprocess
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


GOAL = 1.10  # record on / off, process CPU, on the live publish path
# name: (held keys, share of stores that bring back an evicted prefix)
SCENARIOS = {"held_100k": (100_000, 0.0), "churn": (2_000, 0.5)}


class Stream:
    """An engine under eviction: blocks stored in runs, the oldest evicted."""

    def __init__(self, seed: int, held: int = 0, restore: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.next_hash = 1
        self.held: list[ExternalBlockHash] = []
        self.target = held
        self.restore = restore
        self.evicted: list[list[ExternalBlockHash]] = []

    def run(self, hashes: list[ExternalBlockHash]) -> BlockStored:
        self.held.extend(hashes)
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=[
                self.rng.randrange(1000, 32000) for _ in range(len(hashes) * BLOCK)
            ],
            block_size=BLOCK,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )

    def new_hashes(self) -> list[ExternalBlockHash]:
        hashes: list[ExternalBlockHash] = list(
            range(self.next_hash, self.next_hash + RUN)
        )
        self.next_hash += RUN
        return hashes

    def stores(self, runs: int) -> list[Event]:
        return [self.run(self.new_hashes()) for _ in range(runs)]

    def fill(self) -> list[KVEventBatch]:
        """Batches of stores that take the stream to its held keys."""
        runs = -(-self.target // RUN)
        return [
            KVEventBatch(ts=time.time(), events=self.stores(min(64, runs - done)))
            for done in range(0, runs, 64)
        ]

    def batch(self, requests: int = 4) -> KVEventBatch:
        events: list[Event] = []
        for _ in range(requests):
            if len(self.held) >= self.target:
                gone, self.held = self.held[:RUN], self.held[RUN:]
                self.evicted.append(gone)
                events += [
                    BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0)
                    for h in gone
                ]
            if self.evicted and self.rng.random() < self.restore:
                hashes = self.evicted.pop(self.rng.randrange(len(self.evicted)))
            else:
                hashes = self.new_hashes()
            events.append(self.run(hashes))
        return KVEventBatch(ts=time.time(), events=events)


class Reader:
    """``sub_reader.py`` subscribed to ``endpoint`` in its own process, as a
    router is: the publisher's process then pays only for the engine's side."""

    def __init__(self, endpoint: str) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("sub_reader.py")), endpoint],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin, self.stdout = self._proc.stdin, self._proc.stdout

    def ask(self, seq: int) -> None:
        """Read up to ``seq`` (-1: any batch); ``reached`` gives the seq read."""
        self._stdin.write(f"{seq}\n")
        self._stdin.flush()

    def reached(self) -> int:
        line = self.stdout.readline()
        if not line:
            raise RuntimeError(f"sub_reader exited {self._proc.wait()}")
        return int(line)

    def close(self) -> None:
        self._stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:  # still waiting for a batch
            self._proc.kill()
            self._proc.wait()


def publish_time(
    warm: list[KVEventBatch], batches: list[KVEventBatch], max_keys: int
) -> tuple[float, float]:
    """Wall and CPU seconds (this process, all threads) from the first
    ``publish`` of ``batches`` to the last batch read by a SUB socket in
    another process, ``warm`` published and read before."""
    pub = ZmqEventPublisher(
        0,
        endpoint="tcp://*:0",
        replay_endpoint="tcp://*:0",
        buffer_steps=1000,
        snapshot_max_keys=max_keys,
    )
    reader = Reader(pub.get_publisher_config().endpoint)
    try:
        # Empty batches until the SUB's subscription has landed: a PUB
        # drops what it sends before that.
        reader.ask(-1)
        sent = 0
        while not select.select([reader.stdout], [], [], 0.05)[0]:
            pub.publish(KVEventBatch(ts=time.time(), events=[]))
            sent += 1
        reader.reached()
        reader.ask(sent + len(warm) - 1)
        for batch in warm:
            pub.publish(batch)
        reader.reached()
        reader.ask(sent + len(warm) + len(batches) - 1)
        start, cpu = time.perf_counter(), time.process_time()
        for batch in batches:
            pub.publish(batch)
        reader.reached()
        return time.perf_counter() - start, time.process_time() - cpu
    finally:
        reader.close()
        pub.shutdown()


def scenario(held: int, restore: float, repeats: int, n_batches: int) -> dict[str, Any]:
    stream = Stream(0, held, restore)
    warm = stream.fill()
    batches = [stream.batch() for _ in range(n_batches)]
    times: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(repeats):
        for mode in ("on", "off"):  # ABAB
            wall, used = publish_time(warm, batches, 1_000_000 if mode == "on" else 0)
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
    for batch in warm:
        record.apply(batch.events)
    start = time.thread_time()
    for batch in batches:
        record.apply(batch.events)
    apply_us = (time.thread_time() - start) / len(batches) * 1e6
    removed = sum(isinstance(e, BlockRemoved) for b in batches for e in b.events)
    stored = sum(isinstance(e, BlockStored) for b in batches for e in b.events)
    return {
        "batches": len(batches),
        "held_keys": held,
        "restored_share": restore,
        "events_per_batch": f"{stored / len(batches):.1f} BlockStored x {RUN} "
        f"blocks x {BLOCK} tokens, {removed / len(batches):.1f} BlockRemoved x 1",
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


def live(repeats: int, n_batches: int) -> dict[str, Any]:
    return {
        name: scenario(held, restore, repeats, n_batches)
        for name, (held, restore) in SCENARIOS.items()
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
    ap.add_argument("--batches", type=int, default=3000)
    args = ap.parse_args(argv)
    # tcp://*:0 binds VLLM_HOST_IP on a free port.
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if not args.out.is_dir():
        print(f"error: --out {args.out} is not a directory", file=sys.stderr)
        return 2
    # As EngineCore after start-up (freeze_gc_heap): the import-time heap
    # (torch, vLLM) out of the collector's way, so that a full collection
    # (about 0.5 s here without this) is not timed as the record's pause.
    gc.collect()
    gc.freeze()
    result = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_before": os.getloadavg(),
        "goal_cpu_ratio": GOAL,
        "live": live(args.repeats, args.batches),
        "load_average_after": os.getloadavg(),
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
