"""Routers that start late, lose batches or outlive the engine, on a real
API server under load: the reference consumer must get the exact view back.

The concurrent-load run of ``load_scenario`` (its workload, its client
threads, its quiesce and probes, its router view as the witness that saw
every batch), against a server whose publisher binds an ``ipc://`` endpoint
and keeps ``BUFFER_STEPS`` batches for replay on ``tcp://127.0.0.1``
(``server_scenario.Replay``), so that several consumers subscribe at once.
The consumers are the reference consumer's ``Follower``
(``vllm.distributed.kv_events_consumer``, the wheel's; for a wheel without
it, the official one, this checkout's file), each driven by its own thread
as its CLI drives it (live batches as they come, a status poll after
``POLL_S`` without one). Its link can be cut: the batches that arrive then
are lost, as on a dropped connection or a SUB past its high-water mark.

- ``short``: joins at start; loses ``SHORT_GAP`` (< ``BUFFER_STEPS``)
  batches as the load starts: recovers by replay;
- ``long``: joins at start; cut for the whole first load phase (many more
  batches than the buffer): recovers by snapshot;
- ``during``: joins while the first load phase runs, so its snapshot is
  built and sent while requests run;
- ``late``: joins after the first load phase: bootstraps by snapshot;
- then (``--restart``) the server process is stopped and started again on
  the same endpoints, and a second load phase runs: every consumer must see
  the new epoch and recover.

After each phase the run quiesces and probes as ``load_scenario`` does;
each consumer's prediction (its mirror's prefix match, capped as vLLM caps
a hit) is recorded next to the view's and the server's
``usage.prompt_tokens_details.cached_tokens``. Each consumer's held keys
are compared with the witness's at every probe.

    python -m overlay_harness.recovery_scenario --policy logical \\
        --label overlay --restart --out build/snapshot-recovery.json

Exit status: 0 when the run completed (judging its figures is the
caller's, ``tests/test_cpu_server_recovery.py``), 2 on a set-up error.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import threading
import time
import urllib.error
from pathlib import Path
from typing import Any

from overlay_harness import load_scenario, server_scenario
from overlay_harness.load_scenario import Scenario, metric
from overlay_harness.router_view import checkout_consumer
from overlay_harness.server_scenario import Replay, Server, SetupError

BLOCK = server_scenario.BLOCK_SIZE
# Small, so that one load phase overruns it many times over.
BUFFER_STEPS = 8
SHORT_GAP = 3
# Running requests the `during` consumer waits for before it joins. Waiting
# for more (3) left it never joining in one run, the phase ending between
# samples of /metrics; the phase's last request can also end within the
# join, so only the count before the join is required.
DURING_MIN_RUNNING = 1
# The reference CLI's default idle interval before a status poll.
POLL_S = 1.0


def consumer_module() -> tuple[Any, str]:
    """The reference consumer the installed wheel ships, or this checkout's
    file for a wheel without it (the official one); and which it is."""
    try:
        return importlib.import_module("vllm.distributed.kv_events_consumer"), "wheel"
    except ImportError:
        return checkout_consumer(), "checkout"


class Consumer:
    """One reference consumer on its own thread, and a link that can be cut."""

    def __init__(self, module: Any, name: str, replay: Replay) -> None:
        outer = self

        class Linked(module.Follower):  # type: ignore[misc]
            def on_live(self, seq: int, payload: bytes) -> None:
                if outer.cut or outer.lose > 0:
                    outer.lose -= not outer.cut
                    outer.dropped += 1
                    return
                super().on_live(seq, payload)

        self.name = name
        self.module = module
        self.cut = False
        self.lose = 0
        self.dropped = 0
        self.unanswered = 0
        self.lock = threading.Lock()
        self.follower = Linked(replay.endpoint, replay.replay_endpoint)
        joined = time.monotonic()
        with self.lock:
            self.follower.sync()
            self.join_s = time.monotonic() - joined
            self.join_keys = len(self.follower.mirror.held_keys())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last_live = time.monotonic()
        while not self._stop.is_set():
            with self.lock:
                try:
                    if self.follower.poll(0.02):
                        last_live = time.monotonic()
                    elif time.monotonic() - last_live > POLL_S:
                        self.follower.sync()
                        last_live = time.monotonic()
                except self.module.NoReply:
                    # The server is down (a restart): ask again later.
                    self.unanswered += 1
                    last_live = time.monotonic()

    def predict(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` this consumer expects served from the cache,
        once it is up to date with what the publisher has sent (the status
        check its idle poll makes)."""
        with self.lock:
            self.follower.sync()
            matched = self.follower.mirror.match(prompt)
        blocks = min(max(matched.values(), default=0), (len(prompt) - 1) // BLOCK)
        return blocks * BLOCK

    def held(self) -> set[Any]:
        with self.lock:
            return set(self.follower.mirror.held_keys())

    def figures(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        f = self.follower
        return {
            "recoveries": dict(f.stats.recoveries),
            "anomalies": [a.split(":", 1)[0] for a in f.stats.anomalies],
            "anomaly_lines": f.stats.anomalies[:20],
            "synced": f.synced,
            "snapshot_service": f.snapshots,
            "dropped": self.dropped,
            "unanswered_status_polls": self.unanswered,
            "applied_batches": f.stats.applied,
            "unknown_removals": {
                "set": len(f.mirror.set.unknown_removals),
                "count": len(f.mirror.count.unknown_removals),
            },
            "join_s": round(self.join_s, 3),
            "join_keys": self.join_keys,
        }

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.follower.close()


class Recovery:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.module, self.source = consumer_module()
        run_dir = Path(tempfile.mkdtemp(prefix="kv-recovery-"))
        self.replay = Replay(
            f"ipc://{run_dir}/kv-events",
            f"tcp://127.0.0.1:{server_scenario.free_port()}",
            BUFFER_STEPS,
        )
        self.consumers: dict[str, Consumer] = {}
        self.witness_mismatches: list[dict[str, Any]] = []
        self.probes: list[dict[str, Any]] = []
        self.during: dict[str, Any] = {}
        self.servers = 0
        self.startup_s: list[float] = []

    def start(self) -> tuple[Server, Scenario]:
        self.servers += 1
        server = Server.from_args(
            "cpu",
            self.args.policy,
            self.args.log_dir / f"serve-recovery-{self.args.label}-{self.servers}.log",
            self.args,
            load_scenario.EXTRA,
            self.replay,
        )
        self.startup_s.append(round(server.startup_s, 1))
        scenario = Scenario(server, self.args)
        scenario.predictors = {n: c.predict for n, c in self.consumers.items()}
        return server, scenario

    def join(self, scenario: Scenario, name: str) -> Consumer:
        consumer = Consumer(self.module, name, self.replay)
        self.consumers[name] = consumer
        scenario.predictors[name] = consumer.predict
        return consumer

    def join_during_load(
        self, scenario: Scenario, after_batches: int, load_done: threading.Event
    ) -> None:
        """Join once the load phase has published ``after_batches`` batches
        and the server runs at least ``DURING_MIN_RUNNING`` requests, with
        them counted just before and after the join."""
        while scenario.live.batches < after_batches:
            if load_done.wait(0.01):
                return
        base = scenario.server.base
        while (running := metric(base, "vllm:num_requests_running")) < (
            DURING_MIN_RUNNING
        ):
            if load_done.wait(0.02):
                return
        consumer = self.join(scenario, "during")
        self.during = {
            "requests_running_before_join": running,
            "requests_running_after_join": metric(base, "vllm:num_requests_running"),
            "join_s": round(consumer.join_s, 3),
            "join_keys": consumer.join_keys,
        }

    def probe_phase(self, scenario: Scenario, phase: str) -> None:
        witness = scenario.live.view
        start = len(scenario.run.probes)
        scenario.probes(phase)
        for record in scenario.run.probes[start:]:
            self.probes.append(record)
        with scenario.live.lock:
            truth = (
                set(witness.counting.counts)
                if self.args.policy == "none"
                else set(witness.set.keys)
            )
        for name, consumer in self.consumers.items():
            held = consumer.held()
            if held != truth:
                self.witness_mismatches.append(
                    {
                        "phase": phase,
                        "consumer": name,
                        "missing": len(truth - held),
                        "extra": len(held - truth),
                    }
                )

    def load(self, scenario: Scenario) -> None:
        before = scenario.live.batches
        load_done = threading.Event()
        joiner = threading.Thread(
            target=self.join_during_load,
            args=(scenario, before + BUFFER_STEPS, load_done),
        )
        self.consumers["short"].lose = SHORT_GAP
        self.consumers["long"].cut = True
        joiner.start()
        try:
            scenario.load(self.args.jobs)
        finally:
            load_done.set()
            self.consumers["long"].cut = False
            joiner.join()
        if "during" not in self.consumers:
            raise SetupError("the load phase ended before the `during` consumer joined")

    def run(self) -> dict[str, Any]:
        server, scenario = self.start()
        try:
            scenario.quiesce()
            self.join(scenario, "short")
            self.join(scenario, "long")
            self.load(scenario)
            self.join(scenario, "late")
            self.probe_phase(scenario, "after load")
            if self.args.restart:
                scenario.close()
                server.close()
                server, scenario = self.start()
                scenario.quiesce()
                scenario.load(self.args.jobs)
                self.probe_phase(scenario, "after restart and load")
        except (SetupError, urllib.error.URLError, OSError) as e:
            raise SetupError(f"{self.args.label}: {server.failure(e)}") from e
        finally:
            scenario.close()
            server.close()
            figures = {
                n: {"source": self.source, **c.figures()}
                for n, c in self.consumers.items()
            }
            for c in self.consumers.values():
                c.close()
        wrong = {
            n: [p for p in self.probes if p["predicted"][n] != p["served"]]
            for n in self.consumers
        }
        return {
            "label": self.args.label,
            "policy": self.args.policy,
            "seed": self.args.seed,
            "buffer_steps": BUFFER_STEPS,
            "short_gap": SHORT_GAP,
            "kv_blocks": load_scenario.NUM_BLOCKS,
            "server_starts": self.servers,
            "startup_s": self.startup_s,
            "probes": len(self.probes),
            "probes_served_a_hit": sum(p["served"] > 0 for p in self.probes),
            "probes_exact": {n: len(self.probes) - len(w) for n, w in wrong.items()},
            "probes_wrong": wrong,
            "witness_mismatches": self.witness_mismatches,
            "during": self.during,
            "consumers": figures,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--restart", action="store_true", help="restart the server, load again"
    )
    args = load_scenario.parse_args(ap, argv, jobs=10, probes=8)
    started = time.monotonic()
    try:
        result = Recovery(args).run()
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["run_s"] = round(time.monotonic() - started, 1)
    print(json.dumps({k: v for k, v in result.items() if k != "probes_wrong"}))
    if args.out:
        load_scenario.record(args.out, result)
    print(f"server logs: {args.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
