"""One router process following a fleet: the reference consumer's ``Fleet``
(a ``Follower`` with a ``CompactMirror`` per engine) against NVIDIA Dynamo's
standalone KV indexer, on the same stream, over ZMQ on 127.0.0.1.

Not part of the test run. A publisher process (``--role publisher``) runs
one real ``ZmqEventPublisher`` per engine (snapshots on) of the build tree
(``PYTHONPATH=build/tree``). The stream: each batch stores a new chain of 4
blocks of 32 random tokens and removes the chain stored ``keys / 4``
batches before it, so every engine holds its share of ``--keys`` at all
times. Per fleet size (``--engines``, e.g. 1 and 64):

- fill: the engines store ``--keys`` keys in all, before any router runs;
- late join: a ``Fleet`` starts; seconds until every follower is synced
  with every key (each recovers by snapshot);
- memory: the router process's RSS then, less its RSS before the
  ``Fleet`` (imports loaded), per held key, each read once glibc returned
  the heap's free pages (``malloc_trim``);
- live throughput: ``--batches`` more batches in all, published at full
  speed; batches applied per second, from the first to the last; the same
  phase read by bare SUB sockets (a Python loop that receives and does not
  decode) shows what the publishers deliver to a reader that does nothing;
- queued throughput: as many again, published while the router is paused
  (not following; Dynamo's process stopped with SIGSTOP) until every
  record holds them, so they wait in the sockets' queues; batches applied
  per second from its resumption to the last. This is the router's own
  rate, which the live phase hides once the publishers (which share the 2
  cores) deliver less than it applies;
- Dynamo: its indexer (``relay_scenario.DYNAMO``, installed in a venv of its
  own) subscribes to every engine before another fill of the same size;
  its RSS per held key, and its throughput on the same two phases (until
  its ``/query`` finds each engine's last chain). It has no late join.

    PYTHONPATH=ci:build/tree PY ci/bench/bench_consumer_fleet.py \\
        --out docs/benchmarks [--engines 1 64] [--keys 1000000]

Writes ``consumer_fleet.json``; ``run_all.py --render-only`` renders it.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import datetime as dt
import functools
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
import psutil  # noqa: E402

REPORT = "consumer_fleet.json"
BLOCK = 32
CHAIN = 4
# Fill batches per engine published before the records must catch up.
FILL_CHUNK = 20_000
GOALS = {"batches_per_s": 30_000, "bytes_per_key": 300, "late_join_s": 10.0}


def chain_batch(
    rng: random.Random, n: int, removed: list[int] | None
) -> tuple[Any, list[int], list[int]]:
    """The ``n``-th batch: it stores a new chain (random hashes, tokens no
    other chain has) and removes ``removed``; with its hashes and tokens."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    hashes = [rng.getrandbits(63) for _ in range(CHAIN)]
    tokens = list(range(n * CHAIN * BLOCK + 1, (n + 1) * CHAIN * BLOCK + 1))
    events: list[Any] = [
        BlockStored(list[Any](hashes), None, tokens, BLOCK, None, "GPU", None, None, 0)
    ]
    if removed:
        events.append(BlockRemoved(list[Any](removed), "GPU", group_idx=0))
    return KVEventBatch(ts=0.0, events=events), hashes, tokens


def publisher(engines: int, keys: int) -> None:
    """The publisher process: prints its endpoints, then runs the commands
    read on stdin (``fill``, ``steady N``), printing ``done`` and each
    engine's last chain's tokens after each."""
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"
    from vllm.distributed.kv_events import ZmqEventPublisher

    pubs = [
        ZmqEventPublisher(0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
        for _ in range(engines)
    ]
    configs = [p.get_publisher_config() for p in pubs]
    print(json.dumps([[c.endpoint, c.replay_endpoint] for c in configs]), flush=True)
    window = max(1, keys // CHAIN // engines)
    rng = random.Random(0)
    chains = [collections.deque[list[int]](maxlen=window) for _ in pubs]
    last: list[list[int]] = [[] for _ in pubs]
    n = 0
    for line in sys.stdin:
        command, rounds_text = line.split()
        rounds = int(rounds_text)
        batches = []
        for _ in range(rounds):
            for e in range(engines):
                old = chains[e][0] if len(chains[e]) == window else None
                batch, hashes, tokens = chain_batch(rng, n, old)
                n += 1
                chains[e].append(hashes)
                last[e] = tokens
                batches.append((e, batch))
        print("built", flush=True)
        for e, batch in batches:
            pubs[e].publish(batch)
        print(json.dumps({"done": last}), flush=True)
    for p in pubs:
        p.shutdown()


class Publishers:
    def __init__(self, engines: int, keys: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--role", "publisher"]
            + ["--engines", str(engines), "--keys", str(keys)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.endpoints = json.loads(self._line())

    def _line(self) -> str:
        assert self.process.stdout is not None  # narrows type for mypy
        while not (line := self.process.stdout.readline()).startswith(("[", "{")):
            if not line:
                raise SystemExit("the publisher process died")
        return line

    def run(self, command: str) -> tuple[float, list[list[int]]]:
        """Send ``command``; when its batches started going out (monotonic
        clock) and each engine's last chain's tokens."""
        assert self.process.stdin is not None  # narrows type for mypy
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        assert self.process.stdout is not None
        while self.process.stdout.readline().strip() != "built":
            pass
        started = time.monotonic()
        return started, json.loads(self._line())["done"]

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(120)


def follow_fleet(pubs: Publishers, keys: int, batches: int) -> dict[str, Any]:
    from vllm.distributed.kv_events_consumer import Fleet

    me = psutil.Process()
    fill(pubs, keys)
    base_rss = retained_rss(me)
    started = time.monotonic()
    fleet = Fleet({f"e{i}": tuple(e) for i, e in enumerate(pubs.endpoints)})
    followers = list(fleet.followers.values())
    while not all(f.synced for f in followers) or held(fleet) < keys:
        fleet.follow(0.01)
    join_s = time.monotonic() - started
    held_keys = held(fleet)
    assert held_keys == keys, (held_keys, keys)
    per_key = (retained_rss(me) - base_rss) / held_keys

    def steady(queued: bool) -> float:
        """Seconds to apply ``batches`` more per engine, from when they
        start going out (live) or from the router's resumption (queued)."""
        target = [(f.next_seq or 0) + batches for f in followers]
        started, _ = pubs.run(f"steady {batches}")
        if queued:
            settle(pubs, target)
            started = time.monotonic()
        while any(
            (f.next_seq or 0) < t for f, t in zip(followers, target, strict=True)
        ):
            fleet.follow(0.01, poll_interval_s=5.0)
        return time.monotonic() - started

    live_s, queued_s = steady(queued=False), steady(queued=True)
    recoveries = sum(sum(f.stats.recoveries.values()) for f in followers)
    fleet.close()
    return {
        "late_join_s": round(join_s, 2),
        "held_keys": held_keys,
        "bytes_per_key": round(per_key),
        "batches_per_s": round(batches * len(followers) / live_s),
        "queued_batches_per_s": round(batches * len(followers) / queued_s),
        "recoveries": recoveries,
    }


def stream_alone(pubs: Publishers, keys: int, batches: int) -> dict[str, Any]:
    """The same steady phase read by bare SUB sockets (received, not
    decoded): what the publishers deliver on this machine to a reader that
    does nothing with it."""
    import zmq

    fill(pubs, keys)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    subs = []
    for endpoint, _ in pubs.endpoints:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        subs.append(sub)
    time.sleep(1.0)  # the subscriptions reach the publishers
    poller = zmq.Poller()
    for sub in subs:
        poller.register(sub, zmq.POLLIN)
    want = batches * len(subs)
    # Each engine's batches sent so far: the fill's.
    sent = keys // CHAIN // len(subs)

    def steady(queued: bool) -> float:
        nonlocal sent
        started, _ = pubs.run(f"steady {batches}")
        sent += batches
        if queued:
            settle(pubs, [sent] * len(subs))
            started = time.monotonic()
        got = 0
        while got < want:
            for sub, _ in poller.poll(1000):
                while got < want and sub.poll(0):
                    sub.recv_multipart()
                    got += 1
        return time.monotonic() - started

    live_s, queued_s = steady(queued=False), steady(queued=True)
    for sub in subs:
        sub.close(linger=0)
    return {
        "batches_per_s": round(want / live_s),
        "queued_batches_per_s": round(want / queued_s),
    }


def fill(pubs: Publishers, keys: int) -> None:
    """Publish the fill, ``FILL_CHUNK`` batches per engine at a time, each
    chunk once every record holds the one before: at full speed a record
    falls more than its ring behind and turns snapshots off (and with no
    engine behind these publishers it is never rebuilt)."""
    engines = len(pubs.endpoints)
    rounds = keys // CHAIN // engines
    for done in range(0, rounds, FILL_CHUNK):
        pubs.run(f"fill {min(FILL_CHUNK, rounds - done)}")
        settle(pubs, [min(done + FILL_CHUNK, rounds)] * engines, recorded=True)


def settle(pubs: Publishers, sent: list[int], recorded: bool = False) -> None:
    """Until each engine has sent its ``sent`` batches and, if ``recorded``,
    its record holds them: a join measured while the fill still goes out
    would time the fill, and a queued phase must not start before its
    batches are out. (A steady phase at full speed can leave a record too
    far behind, which turns snapshots off: only a fill waits for it.)"""
    from vllm.distributed.kv_events_consumer import Follower

    for (endpoint, replay), batches in zip(pubs.endpoints, sent, strict=True):
        follower = Follower(endpoint, replay, timeout_s=60.0)
        try:
            while True:
                status = follower.status()
                assert status is not None  # narrows type for mypy
                record = status["snapshot"]["next_seq"] or 0
                if status["next_seq"] >= batches and (
                    not recorded or record >= batches
                ):
                    break
                time.sleep(0.1)
        finally:
            follower.close()


def retained_rss(process: psutil.Process) -> int:
    """RSS once glibc has returned the heap's free pages (``malloc_trim``):
    what the router keeps, not what a snapshot's batches left free."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rss: int = process.memory_info().rss
    return rss


def held(fleet: Any) -> int:
    return sum(len(f.mirror) for f in fleet.followers.values())


def follow_dynamo(
    pubs: Publishers, python: Path, keys: int, batches: int, log: Path
) -> dict[str, Any]:
    from overlay_harness.relay_scenario import Indexer

    first, *more = pubs.endpoints
    indexer = Indexer(python, first[0], BLOCK, log, tuple(e[0] for e in more))
    try:
        time.sleep(1.0)  # its subscriptions reach the publishers
        proc = psutil.Process(indexer.process.pid)
        base_rss = proc.memory_info().rss
        fill(pubs, keys)
        _, last = pubs.run("steady 1")
        until_holds(indexer, last)
        per_key = (proc.memory_info().rss - base_rss) / keys
        sent_at, last = pubs.run(f"steady {batches}")
        until_holds(indexer, last)
        live_s = time.monotonic() - sent_at
        # Each engine's batches sent so far: the fill's, 1, the two phases'.
        sent = keys // CHAIN // len(pubs.endpoints) + 1 + 2 * batches
        proc.suspend()
        try:
            _, last = pubs.run(f"steady {batches}")
            settle(pubs, [sent] * len(pubs.endpoints))
        finally:
            proc.resume()
        resumed_at = time.monotonic()
        until_holds(indexer, last)
        queued_s = time.monotonic() - resumed_at
    finally:
        indexer.close()
    return {
        "held_keys": keys,
        "bytes_per_key": round(per_key),
        "batches_per_s": round(batches * len(last) / live_s),
        "queued_batches_per_s": round(batches * len(last) / queued_s),
    }


def until_holds(indexer: Any, last: list[list[int]]) -> None:
    """Until Dynamo's index holds each engine's last chain (worker ``1 +
    engine``), in the order they were published."""
    from overlay_harness.relay_scenario import WORKER

    for engine, tokens in enumerate(last):
        while indexer.matched(tokens).get(WORKER + engine, 0) < len(tokens):
            time.sleep(0.01)


def median_cell(
    repeats: list[dict[str, Any]], router: str, figure: str, unit: str = ""
) -> str:
    """A figure's median over ``repeats``, with its min - max."""
    values = [r[router][figure] for r in repeats]
    mid = statistics.median(values)
    if unit:
        return f"{mid:,.1f}{unit} ({min(values):,.1f} - {max(values):,.1f})"
    return f"{mid:,.0f} ({min(values):,} - {max(values):,})"


def report_lines(report: dict[str, Any]) -> list[str]:
    """The section of docs/benchmarks/README.md."""
    lines = [
        "## One router process following a fleet (the reference consumer's "
        "`Fleet`) and Dynamo's indexer",
        "",
        f"`ci/bench/bench_consumer_fleet.py` (see its docstring), run "
        f"{report['started']} UTC on {report['cpus']} CPUs, load average "
        f"{report['load_average_end']:.1f} at the end: {report['keys']:,} held "
        f"keys in all, chains of {CHAIN} blocks of {BLOCK} tokens, "
        f"{report['batches']:,} steady batches in all at full speed; medians "
        f"of {report['repeats']} repeats (min - max; each repeat starts "
        "fresh publishers for each router). "
        f"Dynamo: {report['dynamo']}. Goals (issue 41): "
        f"at least {GOALS['batches_per_s']:,} batches/s, at most "
        f"{GOALS['bytes_per_key']} B per held key, a late join in at most "
        f"{GOALS['late_join_s']:g} s. The publishers (one process, a record "
        "process each) share the 2 cores with the router, so every live "
        "rate is also theirs: the bare SUB sockets (a Python loop that "
        "receives and does not decode) show what they deliver to a reader "
        "that does nothing. The queued column is each router's own rate: "
        "the same number of batches, sent while it was paused, applied from "
        "the sockets' queues.",
        "",
        "| engines | router | batches/s applied, live | batches/s applied, "
        "queued | bytes per held key | late join |",
        "|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        n = run["engines"]
        cell = functools.partial(median_cell, run["repeats"])
        for router, name, join in (
            ("stream", "bare SUB sockets", None),
            ("fleet", "`Fleet`", cell("fleet", "late_join_s", " s")),
            ("dynamo", "Dynamo's indexer", "none (no recovery)"),
        ):
            per_key = "-" if join is None else cell(router, "bytes_per_key")
            lines.append(
                f"| {n} | {name} | {cell(router, 'batches_per_s')} | "
                f"{cell(router, 'queued_batches_per_s')} | {per_key} | "
                f"{join or '-'} |"
            )
    return [*lines, ""]


def measure(
    engines: int, keys: int, batches: int, python: Path, logs: Path
) -> dict[str, Any]:
    """One repeat for a fleet of ``engines``: the stream alone, the ``Fleet``
    and Dynamo's indexer, each on a fresh set of publishers."""
    per_engine = max(1, batches // engines)
    held = held_in_all(keys, engines)
    run: dict[str, Any] = {}
    for router in ("stream", "fleet", "dynamo"):
        pubs = Publishers(engines, keys)
        try:
            if router == "stream":
                run[router] = stream_alone(pubs, held, per_engine)
            elif router == "fleet":
                run[router] = follow_fleet(pubs, held, per_engine)
            else:
                log = logs / f"dynamo-fleet-{engines}.log"
                run[router] = follow_dynamo(pubs, python, held, per_engine, log)
        finally:
            pubs.close()
    return run


def held_in_all(keys: int, engines: int) -> int:
    """The keys the engines hold once filled: whole chains, an equal number
    per engine (``publisher``'s window)."""
    return CHAIN * engines * max(1, keys // CHAIN // engines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("bench", "publisher"), default="bench")
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument(
        "--batches", type=int, default=20_000, help="steady batches, all engines"
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.role == "publisher":
        publisher(args.engines[0], args.keys)
        return 0
    from overlay_harness.relay_scenario import DYNAMO, dynamo_python
    from vllm_overlay.paths import default_layout

    layout = default_layout()
    python = dynamo_python(layout.cache, layout.logs / "dynamo-env.log")
    started = dt.datetime.now(dt.UTC)
    repeats: dict[int, list[dict[str, Any]]] = {n: [] for n in args.engines}
    for _ in range(args.repeats):
        for engines in args.engines:
            run = measure(engines, args.keys, args.batches, python, layout.logs)
            repeats[engines].append(run)
            print(json.dumps(run), flush=True)
    report = {
        "started": started.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "load_average_end": os.getloadavg()[0],
        "keys": args.keys,
        "batches": args.batches,
        "dynamo": DYNAMO,
        "repeats": args.repeats,
        "runs": [{"engines": n, "repeats": r} for n, r in repeats.items()],
    }
    if args.out:
        (args.out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join(report_lines(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
