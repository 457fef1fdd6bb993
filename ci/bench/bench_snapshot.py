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
  ``BlockPool`` sends them) and storing a run of 8 blocks of 16 tokens,
  published as fast as the publisher takes them (the costliest case for
  the ratio: no idle wake-ups to share). The stream is first filled to the
  scenario's held keys (untimed); per repeat the time from the first timed
  ``publish`` to the last batch read by a SUB socket on 127.0.0.1 in
  another process (``sub_reader.py``), as a router reads the stream. This
  process is the engine's: its CPU time (all threads) is the publish
  path's, with the record on counting what the publisher does for the
  record process. The record process's CPU over the same batches is
  given apart. This process runs on one core, the reader and the record
  process on the other (``ENGINE_CORE``). Medians per mode, their ratio
  against ``GOAL``, and the spread of each mode (its first half of
  repeats against its second); the load average is recorded.
* ``apply_cpu_us_per_batch`` (per scenario): what the record process does
  per batch, alone: decode it and ``KVEventRecord.apply`` (thread CPU).
* ``handoff_cpu_us_per_batch`` (per scenario): what the publisher thread
  does per batch for the record, alone: ``RecordProcess.put`` (the copy
  into the ring, a share of the message that announces a chunk), thread
  CPU, with a record process following on the other core; medians over
  ``HANDOFF_REPEATS``. Unlike the live ratio it leaves out the ZMQ I/O
  thread and the publisher loop's other record work, and it is steadier.
* ``memory``: bytes per held key of a real record process (its USS holding
  the keys, less a control's fed the same stores with every block
  evicted), per ``MEMORY_PATTERNS``: 100,000 and 1,000,000 keys stored in
  runs of 512 blocks of 16 tokens, and 2,000 such stores (20,000 of 64)
  with all but each store's head evicted; goal ``MEMORY_GOAL``.
* ``snapshot``: for 1k, 10k, 100k and 1M held keys, the time from a
  snapshot request to its end message at the consumer over ZMQ, and the
  longest delay from ``publish`` to a SUB socket of a live batch published
  every millisecond meanwhile, against as long a span without a snapshot;
  goal: 1M's time at most ``SNAPSHOT_GROWTH_GOAL`` times 100k's.
* ``clients``: what 20 clients that ask (a snapshot and a whole replay
  each) and never read add to the engine's process, at its peak;
  goal ``CLIENTS_GOAL_MIB``.
* ``held``: the same for ``HOLDERS`` clients, one connection each, that
  ask for a replay of ``HOLDER_BATCHES`` batches of about 1 MiB (each
  could hold the last ``ReplayAnswers.HWM`` + 1 of them) and stay
  connected after they are cut off, over three rounds of
  ``ReplayAnswers.STALL_S``: what they add to the engine's process, at its
  peak, against ``ReplayAnswers.HELD_MAX_BYTES``, their bound in total.
* ``flood``: the live stream's p99 delay while a client sends the largest
  request the replay socket accepts as fast as it can; goal
  ``FLOOD_GOAL_MS``.

The import-time heap is frozen out of the garbage collector first, as
``EngineCore`` does after start-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import benchlib  # noqa: F401  (puts ci/ on sys.path, for overlay_harness)
import msgspec
import psutil
import zmq
from vllm.distributed import kv_events_answers, kv_events_record
from vllm.distributed.kv_events import (
    RECORD_SCHEMA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.distributed.kv_events_record import KVEventRecord
from vllm.v1.core.kv_cache_utils import ExternalBlockHash

from overlay_harness.replay_hwm import ask

BLOCK = 16
RUN = 8
Event = BlockStored | BlockRemoved | AllBlocksCleared


GOAL = 1.10  # record on / off, process CPU, on the live publish path
MEMORY_GOAL = 400  # record bytes per held key of 16 tokens, every pattern
SNAPSHOT_GROWTH_GOAL = 12  # 1,000,000 keys' snapshot time over 100,000's
CLIENTS_GOAL_MIB = 64  # what 20 clients that never read add to the engine
HOLDERS = 40  # clients that never read and stay connected
HOLDER_BATCHES = 32  # of about 1 MiB each, in the buffer they ask for
FLOOD_GOAL_MS = 10.0  # p99 live delay under a flood of the largest requests
# The engine's process (this one) runs on the first core, the router's
# reader and the record process (at nice 10, as it sets itself) on the
# others, in both modes: as on a server, the engine's process does not
# share its core with them, and the reader reads as fast with the record on
# as off (a reader that falls behind lets ZMQ send several batches per
# system call, which would make the engine's side look cheaper).
ENGINE_CORE = min(os.sched_getaffinity(0))
OTHER_CORES = sorted(os.sched_getaffinity(0) - {ENGINE_CORE}) or [ENGINE_CORE]
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
        psutil.Process(self._proc.pid).cpu_affinity(OTHER_CORES)
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


STATUS = msgspec.msgpack.encode({"op": "status"})
# The record process's schema: structs rebuilt from the engine's.
CHILD_SCHEMA = kv_events_record.schema_from_spec(
    kv_events_record.schema_spec(RECORD_SCHEMA)
)


def child_decoder() -> msgspec.msgpack.Decoder[Any]:
    """The record process's decoder of a batch (its structs are built at
    run time, so typed Any here)."""
    return msgspec.msgpack.Decoder(CHILD_SCHEMA.batch)


def status(pub: ZmqEventPublisher) -> dict[str, Any]:
    replay = pub.get_publisher_config().replay_endpoint
    assert replay is not None  # bound by every publisher here
    reply: dict[str, Any] = ask(replay, STATUS, 0)["end"]
    return reply


def record_process() -> psutil.Process | None:
    """The record process of this process's publisher, if one runs."""
    for child in psutil.Process().children():
        if kv_events_record.__file__ in child.cmdline():
            return child
    return None


def cpu_seconds(process: psutil.Process | None) -> float:
    if process is None:
        return 0.0
    times = process.cpu_times()
    return float(times.user + times.system)


def await_record(
    pub: ZmqEventPublisher, recorder: psutil.Process | None, seq: int
) -> None:
    """Wait until the record process (if any) has applied the batches
    before ``seq``."""
    while recorder is not None:
        record = status(pub)["snapshot"]
        if not record["enabled"]:
            raise RuntimeError(f"the record went off: {record['reason']}")
        if record["next_seq"] >= seq:
            return
        time.sleep(0.01)


def publish_time(
    warm: list[KVEventBatch], batches: list[KVEventBatch], max_keys: int
) -> tuple[float, float, float]:
    """Wall and CPU seconds (this process, all threads) from the first
    ``publish`` of ``batches`` to the last batch read by a SUB socket in
    another process, ``warm`` published and read before; and the record
    process's CPU seconds until it has applied them too (0 without one)."""
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
        recorder = record_process()
        if recorder is not None:
            recorder.cpu_affinity(OTHER_CORES)
        # The record process has applied the fill too: it works on the timed
        # batches only, as an engine's does in steady state.
        await_record(pub, recorder, sent + len(warm))
        last = sent + len(warm) + len(batches)
        reader.ask(last - 1)
        start, cpu = time.perf_counter(), time.process_time()
        record_cpu = cpu_seconds(recorder)
        for batch in batches:
            pub.publish(batch)
        reader.reached()
        wall, used = time.perf_counter() - start, time.process_time() - cpu
        await_record(pub, recorder, last)
        return wall, used, cpu_seconds(recorder) - record_cpu
    finally:
        reader.close()
        pub.shutdown()


HANDOFF_REPEATS = 5


def handoff_us(warm: list[bytes], payloads: list[bytes]) -> list[float]:
    """The publisher thread's CPU per batch in ``RecordProcess.put`` over
    ``payloads``, ``warm`` put first (untimed), per repeat, each with a
    record process of its own."""
    samples = []
    ctx = zmq.Context()
    try:
        for _ in range(HANDOFF_REPEATS):
            handoff = kv_events_record.RecordProcess(
                ctx,
                RECORD_SCHEMA,
                copy_semantics="logical",
                max_keys=1_000_000,
                keys_per_batch=1024,
                data_parallel_rank=0,
            )
            try:
                psutil.Process(handoff.process.pid).cpu_affinity(OTHER_CORES)
                for seq, payload in enumerate(warm):
                    handoff.put(seq, payload)
                start = time.thread_time()
                for seq, payload in enumerate(payloads, len(warm)):
                    handoff.put(seq, payload)
                handoff.send_batches()
                samples.append((time.thread_time() - start) / len(payloads) * 1e6)
            finally:
                handoff.close(10)
    finally:
        ctx.term()
    return samples


def scenario(held: int, restore: float, repeats: int, n_batches: int) -> dict[str, Any]:
    stream = Stream(0, held, restore)
    warm = stream.fill()
    batches = [stream.batch() for _ in range(n_batches)]
    times: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    record_cpu: list[float] = []
    for _ in range(repeats):
        for mode in ("on", "off"):  # ABAB
            wall, used, recorded = publish_time(
                warm, batches, 1_000_000 if mode == "on" else 0
            )
            times[mode].append(wall)
            cpu[mode].append(used)
            if mode == "on":
                record_cpu.append(recorded)

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
    # The record process's work per batch, alone: decode, then apply.
    record = KVEventRecord("logical", CHILD_SCHEMA)
    decoder = child_decoder()
    for batch in warm:
        record.apply(decoder.decode(msgspec.msgpack.encode(batch)).events)
    payloads = [msgspec.msgpack.encode(batch) for batch in batches]
    start = time.thread_time()
    for payload in payloads:
        record.apply(decoder.decode(payload).events)
    apply_us = (time.thread_time() - start) / len(batches) * 1e6
    handoff = handoff_us([msgspec.msgpack.encode(b) for b in warm], payloads)
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
        "handoff_cpu_us_per_batch": statistics.median(handoff),
        "handoff_cpu_us_samples": handoff,
        "record_process_cpu_us_per_batch": statistics.median(record_cpu)
        / len(batches)
        * 1e6,
        "held_keys_at_end": record.num_keys,
    }


def live(repeats: int, n_batches: int) -> dict[str, Any]:
    return {
        name: scenario(held, restore, repeats, n_batches)
        for name, (held, restore) in SCENARIOS.items()
    }


# name: (stores, blocks per store, blocks of each store kept: all or 1)
MEMORY_PATTERNS = {
    "plain_100k": (100_000 // 512, 512, 512),
    "plain_1m": (1_000_000 // 512, 512, 512),
    # What LRU leaves of finished requests: each store's head block (issue
    # 40's measurement: 2,000 stores of 512 blocks).
    "head_survivors": (2_000, 512, 1),
    "head_survivors_20k": (20_000, 64, 1),
}


def record_memory(stores: int, blocks: int, kept: int) -> dict[str, Any]:
    """Bytes per held key of a real record process, once it holds the
    keys: its unique memory (USS) less that of a control record process fed
    the same stores with every block evicted (what the process spends on
    decoding them, once, and holds for no key). The record lives there
    only; the ring both processes map is a fixed RING_BYTES of shared
    memory, which RSS counts in each once batches have passed through it
    (``rss_*`` give it)."""
    held, control = (_record_uss(stores, blocks, k) for k in (kept, 0))
    return {
        "stores": stores,
        "blocks_per_store": blocks,
        "held_keys": held["held_keys"],
        "uss_mib": held["uss_mib"],
        "control_uss_mib": control["uss_mib"],
        "rss_mib": held["rss_mib"],
        "bytes_per_key": (held["uss_mib"] - control["uss_mib"])
        * 2**20
        / held["held_keys"],
    }


def _record_uss(stores: int, blocks: int, kept: int) -> dict[str, Any]:
    """The record process's memory once it has applied ``stores`` stores of
    ``blocks`` blocks with all but ``kept`` of each evicted at once."""
    pub = ZmqEventPublisher(0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    try:
        recorder = record_process()
        assert recorder is not None, "the publisher started no record process"
        stream = Stream(3)
        for _ in range(stores):
            hashes: list[ExternalBlockHash] = list(
                range(stream.next_hash, stream.next_hash + blocks)
            )
            stream.next_hash += blocks
            events: list[Event] = [stream.run(hashes)]
            if kept < blocks:
                events.append(
                    BlockRemoved(block_hashes=hashes[kept:], medium="GPU", group_idx=0)
                )
            pub.publish(KVEventBatch(ts=time.time(), events=events))
        await_record(pub, recorder, stores)
        memory = recorder.memory_full_info()
        return {
            "held_keys": status(pub)["snapshot"]["held_keys"],
            "uss_mib": memory.uss / 2**20,
            "rss_mib": memory.rss / 2**20,
        }
    finally:
        pub.shutdown()


def live_delays(
    pub: ZmqEventPublisher,
    sub: zmq.Socket[bytes],
    until_s: float,
    dealer: zmq.Socket[bytes] | None = None,
) -> tuple[list[float], dict[str, Any] | None, float]:
    """Publish an empty batch every millisecond and read it back on ``sub``:
    each batch's delay from ``publish`` to arrival, in seconds. Until the
    snapshot answer on ``dealer`` ends (its end message is returned, with
    when it arrived: ``time.perf_counter()``), or for ``until_s`` seconds
    without one."""
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    if dealer is not None:
        poller.register(dealer, zmq.POLLIN)
    delays: list[float] = []
    end = None
    ended = 0.0
    stop = time.perf_counter() + until_s
    due = time.perf_counter()
    while (dealer is not None and end is None) or time.perf_counter() < stop:
        if time.perf_counter() >= due:
            pub.publish(KVEventBatch(ts=time.time(), events=[]))
            due += 0.001
        # Sleep in poll until the next batch is due (at least 1 ms while it
        # is ahead): a loop spinning here would hold the GIL from the
        # publisher thread, as no engine does.
        wait_ms = math.ceil((due - time.perf_counter()) * 1000)
        ready = dict(poller.poll(max(0, wait_ms)))
        if sub in ready:
            while sub.poll(0):
                batch = decoder.decode(sub.recv_multipart()[-1])
                delays.append(time.time() - batch.ts)
        if dealer is not None and dealer in ready:
            while dealer.poll(0):
                frames = dealer.recv_multipart()
                if frames[2] == ZmqEventPublisher.END_SEQ:
                    end = msgspec.msgpack.decode(frames[3])
                    ended = time.perf_counter()
    # What is still on its way belongs to this span.
    while sub.poll(50):
        delays.append(time.time() - decoder.decode(sub.recv_multipart()[-1]).ts)
    return delays, end, ended


def clients_that_never_read(clients: int, keys: int = 200_000) -> dict[str, Any]:
    """What ``clients`` clients that ask and never read add to the engine's
    process (this one): each asks for a snapshot of ``keys`` keys and a
    replay of the whole buffer, with a one-message receive queue and a 4 KiB
    receive buffer; the process's RSS sampled every 0.1 s until they have
    been cut off (ReplayAnswers.STALL_S) and 3 s more, its peak less its
    RSS before."""
    stream = Stream(4)
    batches = [
        KVEventBatch(ts=time.time(), events=stream.stores(16))
        for _ in range(-(-keys // (RUN * 16)))
    ]
    requests = [msgspec.msgpack.encode({"op": "snapshot"}), (0).to_bytes(8, "big")]
    added = _added_by_idle_clients(
        batches, [requests] * clients, kv_events_answers.ReplayAnswers.STALL_S + 3
    )
    return {
        "clients": clients,
        "held_keys": keys,
        "added_mib": added / 2**20,
        "goal_mib": CLIENTS_GOAL_MIB,
    }


def connections_that_hold() -> dict[str, Any]:
    """What HOLDERS clients that ask for a replay of HOLDER_BATCHES large
    batches, never read and stay connected add to the engine's process, at
    its peak, over three rounds of being cut off (the ``held`` above)."""
    rng = random.Random(0)
    batches = [
        KVEventBatch(
            ts=time.time(),
            events=[
                BlockStored(
                    block_hashes=[seq],
                    parent_block_hash=None,
                    # About 1 MiB packed: 2**18 tokens of 3 to 5 bytes.
                    token_ids=[rng.randrange(2**16, 2**20) for _ in range(2**18)],
                    block_size=2**18,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                )
            ],
        )
        for seq in range(HOLDER_BATCHES)
    ]
    answers = kv_events_answers.ReplayAnswers
    added = _added_by_idle_clients(
        batches, [[(0).to_bytes(8, "big")]] * HOLDERS, 3 * answers.STALL_S + 3
    )
    batch_bytes = statistics.median(len(msgspec.msgpack.encode(b)) for b in batches)
    return {
        "clients": HOLDERS,
        "batches": HOLDER_BATCHES,
        "batch_mib": batch_bytes / 2**20,
        "unbounded_mib": HOLDERS * (answers.HWM + 1) * batch_bytes / 2**20,
        "added_mib": added / 2**20,
        "bound_mib": answers.HELD_MAX_BYTES / 2**20,
    }


def _added_by_idle_clients(
    batches: list[KVEventBatch], requests: list[list[bytes]], seconds: float
) -> int:
    """Publish ``batches`` (the record following), then connect a client
    per entry of ``requests`` that sends those requests and never reads,
    with a one-message receive queue and a 4 KiB receive buffer; the
    process's RSS sampled every 0.1 s for ``seconds``: its peak less its
    RSS before the clients."""
    pub = ZmqEventPublisher(0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    dealers: list[zmq.Socket[bytes]] = []
    try:
        recorder = record_process()
        for batch in batches:
            pub.publish(batch)
        await_record(pub, recorder, len(batches))
        gc.collect()
        me = psutil.Process()
        before = me.memory_info().rss
        replay = pub.get_publisher_config().replay_endpoint
        assert replay is not None  # bound above
        for sent in requests:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVHWM, 1)
            dealer.setsockopt(zmq.RCVBUF, 4096)
            dealer.connect(replay)
            for request in sent:
                dealer.send_multipart((b"", request))
            dealers.append(dealer)
        peak = before
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            peak = max(peak, me.memory_info().rss)
            time.sleep(0.1)
    finally:
        for dealer in dealers:
            dealer.close(linger=0)
        pub.shutdown()
    return int(peak - before)


_FLOODER = """
import sys, time, msgspec, zmq
endpoint, seconds, size = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
pad = size
while len(frame := msgspec.msgpack.encode({"op": "status", "pad": "x" * pad})) > size:
    pad -= 1
assert len(frame) == size, len(frame)
dealer = zmq.Context().socket(zmq.DEALER)
dealer.connect(endpoint)
sent, until = 0, time.monotonic() + seconds
while time.monotonic() < until:
    try:
        dealer.send_multipart((b"", frame), zmq.NOBLOCK)
        sent += 1
    except zmq.Again:
        pass
    while dealer.poll(0):
        dealer.recv_multipart()
print(sent)
"""


def request_flood(seconds: float) -> dict[str, Any]:
    """The live stream's delay (a batch every millisecond, publish to a SUB
    socket) while a client in another process sends the largest request
    the socket accepts (a padded status request) as fast as it can, and
    for as long without it."""
    pub = ZmqEventPublisher(0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.get_publisher_config().endpoint)
    try:
        while not live_delays(pub, sub, 0.05)[0]:
            pass
        quiet = live_delays(pub, sub, seconds)[0]
        flooder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _FLOODER,
                str(pub.get_publisher_config().replay_endpoint),
                str(seconds),
                str(ZmqEventPublisher.REQUEST_MAX_BYTES),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        psutil.Process(flooder.pid).cpu_affinity(OTHER_CORES)
        flooded = live_delays(pub, sub, seconds)[0]
        sent = int(flooder.communicate(timeout=60)[0])
    finally:
        sub.close(linger=0)
        pub.shutdown()

    def p99(delays: list[float]) -> float:
        return statistics.quantiles(delays, n=100)[98] * 1e3

    return {
        "seconds": seconds,
        "request_bytes": ZmqEventPublisher.REQUEST_MAX_BYTES,
        "requests_sent": sent,
        "live_p99_ms": p99(flooded),
        "live_max_ms": max(flooded) * 1e3,
        "live_p99_without_ms": p99(quiet),
        "goal_p99_ms": FLOOD_GOAL_MS,
    }


def snapshot(keys: int, repeats: int) -> dict[str, Any]:
    """Snapshots of ``keys`` held keys: request to end message, and the
    longest delay of a live batch (one a millisecond) while one is sent,
    against as long a span without one."""
    pub = ZmqEventPublisher(0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    recorder = record_process()
    assert recorder is not None, "the publisher started no record process"
    recorder.cpu_affinity(OTHER_CORES)
    stream = Stream(2)
    for _ in range(keys // (RUN * 16)):
        pub.publish(KVEventBatch(ts=time.time(), events=stream.stores(16)))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.get_publisher_config().endpoint)
    dealer: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    replay = pub.get_publisher_config().replay_endpoint
    assert replay is not None  # bound above
    dealer.connect(replay)
    request = msgspec.msgpack.encode({"op": "snapshot"})
    totals, during, idle, held = [], [], [], 0
    try:
        # Until the subscription has landed and the record holds the fill.
        while not live_delays(pub, sub, 0.05)[0]:
            pass
        await_record(pub, recorder, status(pub)["next_seq"])
        for _ in range(repeats):
            start = time.perf_counter()
            dealer.send_multipart((b"", request))
            delays, info, ended = live_delays(pub, sub, 0.0, dealer)
            totals.append(ended - start)
            assert info is not None and info["status"] == "ok", info
            held = info["keys"]
            during.append(max(delays))
            idle.append(max(live_delays(pub, sub, totals[-1])[0]))
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        pub.shutdown()
    return {
        "held_keys": held,
        "request_to_end_ms": statistics.median(totals) * 1e3,
        "request_to_end_ms_all": [t * 1e3 for t in totals],
        "live_delay_max_ms": statistics.median(during) * 1e3,
        "live_delay_max_ms_all": [t * 1e3 for t in during],
        "live_delay_max_without_ms": statistics.median(idle) * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="write snapshot.json here")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--batches", type=int, default=10_000)
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
    os.sched_setaffinity(0, {ENGINE_CORE})
    result = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_before": os.getloadavg(),
        "goal_cpu_ratio": GOAL,
        "engine_core": ENGINE_CORE,
        "other_cores": OTHER_CORES,
        "live": live(args.repeats, args.batches),
        "load_average_after": os.getloadavg(),
        "memory": {
            name: record_memory(*pattern) for name, pattern in MEMORY_PATTERNS.items()
        },
        "goal_bytes_per_key": MEMORY_GOAL,
        "snapshot": [
            snapshot(n, 5 if n < 1_000_000 else 3)
            for n in (1_000, 10_000, 100_000, 1_000_000)
        ],
        "goal_snapshot_1m_over_100k": SNAPSHOT_GROWTH_GOAL,
        "clients": clients_that_never_read(20),
        "held": connections_that_hold(),
        "flood": request_flood(5.0),
    }
    write_report(args.out / "snapshot.json", result)
    return 0


def write_report(path: Path, result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` whole or not at all, and print it."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
