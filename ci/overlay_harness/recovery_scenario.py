"""Routers that start late, lose batches or outlive the engine, on a real
API server under load: the reference consumer must get the exact view back.

The concurrent-load run of ``load_scenario`` (its workload, its client
threads, its quiesce and probes, its router view as the witness that saw
every batch), against a server whose publisher binds an ``ipc://`` endpoint
and keeps ``BUFFER_STEPS`` batches for replay on ``tcp://127.0.0.1``
(``server_scenario.Replay``), so that several consumers subscribe at once.
The consumers are the reference consumer's ``Follower``
(``vllm.distributed.kv_events_consumer``, the wheel's; for a wheel without
it, the official one, this checkout's file; with ``--consumer-python``, the
standalone consumer wheel in that python's venv, a router's, in a process of
its own: ``consumer_host``), each driven by its own thread as its CLI drives
it (live batches as they come, a status poll after ``consumer_host.POLL_S``
without one).
Its link can be cut: the batches that arrive then are lost, as on a dropped
connection or a SUB past its high-water mark.

- ``short``: joins at start; loses ``SHORT_GAP`` (< ``BUFFER_STEPS``)
  batches as the load starts: recovers by replay;
- ``long``: joins at start; cut for the whole first load phase (many more
  batches than the buffer): recovers by snapshot;
- ``during``: joins while the first load phase runs, so its snapshot is
  built and sent while requests run;
- ``late``: joins after the first load phase: bootstraps by snapshot;
- ``rebuilt``: the server's snapshot record process is then killed, on the
  idle server; once the status says snapshots are back (the record rebuilt
  from the engine's block pool, ``record_rebuild`` in the report) it joins
  by snapshot. A wheel without a record process (the official one) skips
  this;
- then (``--restart``) the server process is stopped and started again on
  the same endpoints, ``DOWN_BEFORE_START_S`` later, and a second load
  phase runs: every consumer must see the new epoch and recover. The
  reference CLI, in a process of its own, follows the server from before
  the stop to the end (``restart`` in the report: how long the server was
  down, and what the CLI printed meanwhile and after).

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
import bisect
import importlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from pathlib import Path
from typing import Any

import psutil

from overlay_harness import load_scenario, server_scenario
from overlay_harness.consumer_host import Cli, Consumer, Host, RemoteConsumer
from overlay_harness.load_scenario import Scenario, metric
from overlay_harness.relay_scenario import Relayed
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
# Load phases run at most until the `during` consumer has joined, each
# with twice the requests of the one before: under "logical" a phase of
# --jobs requests can publish few batches more than BUFFER_STEPS, and a
# starved joiner thread then missed all three of equal length (one cold
# CI run).
LOAD_PHASES_FOR_JOIN = 3
# A recovery followed by this long without a live batch is reported, with
# what the witness got meanwhile (issue 31: about 2 s seen by a consumer).
SILENCE_S = 0.5
# Between two of the short consumer's gaps, with --short-gaps.
GAP_EVERY_S = 1.0
# How long the killed record may take to be seen off, then to come back.
RECORD_OFF_WITHIN_S = 10.0
RECORD_BACK_WITHIN_S = 60.0
# With --restart, the server stays down this long before it starts again
# (its start-up comes on top: 14 to 190 s seen here): the reference CLI,
# which follows it throughout, must outlast a restart of over two minutes.
DOWN_BEFORE_START_S = 125.0


def consumer_module() -> tuple[Any, str]:
    """The reference consumer the installed wheel ships, or this checkout's
    file for a wheel without it (the official one); and which it is."""
    try:
        return importlib.import_module("vllm.distributed.kv_events_consumer"), "wheel"
    except ImportError:
        return checkout_consumer(), "checkout"


class WitnessTimeline:
    """The witness's batch count over wall time (every ``STEP_S``), to tell
    a consumer's silence after a recovery from the engine's: how many
    batches the subscriber that sees every batch got meanwhile."""

    STEP_S = 0.02

    def __init__(self) -> None:
        self.times: list[float] = []
        self.counts: list[int] = []
        # (batches of the views before, the view followed now): one tuple,
        # replaced whole, so that _run never sees a new base with the old view.
        self._following: tuple[int, load_scenario.LiveView] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def follow(self, live: load_scenario.LiveView) -> None:
        """Count ``live``'s batches from now on, after the previous one's."""
        following = self._following
        base = 0 if following is None else following[0] + following[1].batches
        self._following = (base, live)

    def _run(self) -> None:
        while not self._stop.wait(self.STEP_S):
            following = self._following
            if following is not None:
                self.times.append(time.time())
                self.counts.append(following[0] + following[1].batches)

    def _at(self, t: float) -> int:
        i = bisect.bisect_right(self.times, t)
        return self.counts[i - 1] if i else 0

    def batches_between(self, start: float, end: float) -> int:
        return self._at(end) - self._at(start)

    def next_batch_s(self, start: float) -> float | None:
        """Seconds from ``start`` to the sample that first counts a batch
        the witness got after it (None: none came)."""
        before = self._at(start)
        for i in range(bisect.bisect_right(self.times, start), len(self.times)):
            if self.counts[i] > before:
                return round(self.times[i] - start, 3)
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Recovery:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.module, self.source = consumer_module()
        self.host: Host | None = None
        if args.consumer_python is not None:
            ci = str(Path(__file__).resolve().parents[1])
            self.host = Host(
                subprocess.Popen(
                    [str(args.consumer_python), "-m", "overlay_harness.consumer_host"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env={**os.environ, "PYTHONPATH": ci},
                )
            )
            self.source = "standalone"
        run_dir = Path(tempfile.mkdtemp(prefix="kv-recovery-"))
        self.replay = Replay(
            f"ipc://{run_dir}/kv-events",
            f"tcp://127.0.0.1:{server_scenario.free_port()}",
            BUFFER_STEPS,
        )
        self.consumers: dict[str, Consumer | RemoteConsumer] = {}
        self.witness_mismatches: list[dict[str, Any]] = []
        self.probes: list[dict[str, Any]] = []
        self.during: dict[str, Any] = {}
        self.servers = 0
        self.startup_s: list[float] = []
        self.witness = WitnessTimeline()
        self.record_rebuild: dict[str, Any] | None = None
        self.restart: dict[str, Any] | None = None
        self.clis: list[Cli] = []
        self.relayed: Relayed | None = None
        self.relay_figures: dict[str, Any] | None = None

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
        self.witness.follow(scenario.live)
        scenario.predictors = {n: c.predict for n, c in self.consumers.items()}
        if self.relayed is not None:
            scenario.predictors |= self.relayed.predictors
        return server, scenario

    def cli_module(self) -> tuple[str, str]:
        """The python and module of the reference CLI, as the consumers run:
        in the router's venv (the standalone wheel) or this one."""
        if self.args.consumer_python is not None:
            return str(self.args.consumer_python), "vllm_kv_events_consumer"
        return sys.executable, self.module.__name__

    def cli(self) -> Cli:
        return Cli(
            *self.cli_module(), self.replay.endpoint, self.replay.replay_endpoint
        )

    def start_relayed(self, scenario: Scenario) -> None:
        """The relay and Dynamo's indexers, started late (``relay_scenario``)."""
        self.relayed = Relayed(
            self.cli_module(),
            self.args.dynamo_python,
            (self.replay.endpoint, self.replay.replay_endpoint),
            BLOCK,
            self.args.log_dir,
        )
        self.relayed.follow(lambda: self.status()["next_seq"])
        scenario.predictors |= self.relayed.predictors

    def relay_gap(self, scenario: Scenario) -> None:
        """A load phase that the relay's link loses whole."""
        assert self.relayed is not None  # narrows type for mypy
        self.relayed.link.cut = True
        try:
            scenario.load(self.args.jobs)
        finally:
            self.relayed.link.cut = False

    def join(self, scenario: Scenario, name: str) -> Consumer | RemoteConsumer:
        live, replay = self.replay.endpoint, self.replay.replay_endpoint
        consumer: Consumer | RemoteConsumer
        if self.host is None:
            consumer = Consumer(self.module, live, replay, BLOCK)
        else:
            consumer = RemoteConsumer(
                self.host, name, endpoint=live, replay_endpoint=replay, block_size=BLOCK
            )
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
            truth = {
                repr(key)
                for key in (
                    witness.counting.counts
                    if self.args.policy == "none"
                    else witness.set.keys
                )
            }
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

    def status(self) -> dict[str, Any]:
        """The publisher's status map."""
        follower = self.module.Follower(
            self.replay.endpoint, self.replay.replay_endpoint
        )
        try:
            status: dict[str, Any] | None = follower.status()
        finally:
            follower.close()
        if status is None:
            raise SetupError("the replay socket did not answer a status request")
        return status

    def snapshot_status(self) -> dict[str, Any]:
        snapshot: dict[str, Any] = self.status()["snapshot"]
        return snapshot

    def _await_snapshots(self, enabled: bool, within_s: float) -> float:
        """Seconds until the status says snapshots are ``enabled``."""
        start = time.monotonic()
        while self.snapshot_status()["enabled"] != enabled:
            if time.monotonic() - start > within_s:
                raise SetupError(
                    f"snapshots not {'back' if enabled else 'off'} within "
                    f"{within_s:g} s: {self.snapshot_status()}"
                )
            time.sleep(0.1)
        return time.monotonic() - start

    def kill_the_record(self, server: Server) -> dict[str, Any] | None:
        """SIGKILL the server's record process on the idle server; how long
        until snapshots were off, then back (None: the wheel has none)."""
        records = [
            p
            for p in psutil.Process(server.proc.pid).children(recursive=True)
            if any(a.endswith("kv_events_record.py") for a in p.cmdline())
        ]
        if not records:
            return None
        (record,) = records
        record.kill()
        off_s = self._await_snapshots(False, RECORD_OFF_WITHIN_S)
        back_s = self._await_snapshots(True, RECORD_BACK_WITHIN_S)
        return {"off_s": round(off_s, 2), "back_after_off_s": round(back_s, 2)}

    def load(self, scenario: Scenario) -> None:
        """A load phase with the `long` consumer cut, the `short` one losing
        batches and the `during` one joining; another phase (up to
        LOAD_PHASES_FOR_JOIN in all, each twice as long) where the phase
        ended before the join saw a request running (a starved joiner
        thread, on a loaded CI machine)."""
        for phase in range(1, LOAD_PHASES_FOR_JOIN + 1):
            before = scenario.live.batches
            load_done = threading.Event()
            joiner = threading.Thread(
                target=self.join_during_load,
                args=(scenario, before + BUFFER_STEPS, load_done),
            )
            gaps = threading.Thread(target=self.short_gaps, args=(load_done,))
            self.consumers["long"].link(cut=True, lose=0)
            joiner.start()
            gaps.start()
            try:
                scenario.load(self.args.jobs * 2 ** (phase - 1))
            finally:
                load_done.set()
                self.consumers["long"].link(cut=False, lose=0)
                joiner.join()
                gaps.join()
            if "during" in self.consumers:
                self.during["load_phases"] = phase
                return
        raise SetupError(
            f"{LOAD_PHASES_FOR_JOIN} load phases ended before the `during` "
            "consumer joined"
        )

    def short_gaps(self, load_done: threading.Event) -> None:
        """``short`` loses ``SHORT_GAP`` batches as the load starts, then
        again every ``GAP_EVERY_S`` while it runs, ``--short-gaps`` times in
        all (each one a replay recovery, under load)."""
        for _ in range(self.args.short_gaps):
            self.consumers["short"].link(cut=False, lose=SHORT_GAP)
            if load_done.wait(GAP_EVERY_S):
                return

    def close_relayed(self, scenario: Scenario) -> None:
        """Stop the relay and the routers behind it, once, while the server
        still runs (their last state is then the engine's); what they
        showed goes into ``relay_figures``."""
        if self.relayed is not None and self.relay_figures is None:
            with scenario.live.lock:
                keys = len(scenario.live.view.set.keys)
            self.relay_figures = self.relayed.close(keys)

    def run(self) -> dict[str, Any]:
        server, scenario = self.start()
        try:
            scenario.quiesce()
            self.join(scenario, "short")
            self.join(scenario, "long")
            self.load(scenario)
            self.join(scenario, "late")
            if self.args.dynamo_python is not None:
                self.start_relayed(scenario)
            self.probe_phase(scenario, "after load")
            if self.relayed is not None:
                self.relay_gap(scenario)
                self.probe_phase(scenario, "after the relay's link lost a phase")
            self.record_rebuild = self.kill_the_record(server)
            if self.record_rebuild is not None:
                self.join(scenario, "rebuilt")
                self.probe_phase(scenario, "after the record was rebuilt")
            if self.args.restart:
                cli = self.cli()
                self.clis.append(cli)
                cli.await_synced(60.0)
                scenario.close()
                server.close()
                down = time.monotonic()
                time.sleep(DOWN_BEFORE_START_S)
                server, scenario = self.start()
                down_s = time.monotonic() - down
                scenario.quiesce()
                scenario.load(self.args.jobs)
                self.probe_phase(scenario, "after restart and load")
                if self.relayed is not None:
                    self.relayed.restart_relay()
                    self.probe_phase(scenario, "after the relay restarted")
                time.sleep(3.0)  # a state line after the probes' last batch
                with scenario.live.lock:
                    keys = len(scenario.live.view.set.keys)
                self.restart = {"down_s": round(down_s, 1), "cli": cli.close(keys)}
            self.close_relayed(scenario)
        except (SetupError, urllib.error.URLError, OSError) as e:
            raise SetupError(f"{self.args.label}: {server.failure(e)}") from e
        finally:
            self.close_relayed(scenario)
            scenario.close()
            server.close()
            figures = {
                n: {"source": self.source, **c.figures()}
                for n, c in self.consumers.items()
            }
            for c in self.consumers.values():
                c.close()
            if self.host is not None:
                self.host.close()
            for cli in self.clis:
                if cli.process.poll() is None:
                    cli.process.kill()
            self.witness.close()
        # A consumer predicts the probes made after it joined.
        names = [*self.consumers, *(self.relayed.predictors if self.relayed else ())]
        made = {n: [p for p in self.probes if n in p["predicted"]] for n in names}
        wrong = {
            n: [p for p in probes if p["predicted"][n] != p["served"]]
            for n, probes in made.items()
        }
        return {
            "label": self.args.label,
            "policy": self.args.policy,
            "seed": self.args.seed,
            "buffer_steps": BUFFER_STEPS,
            "short_gap": SHORT_GAP,
            "short_gaps": self.args.short_gaps,
            "kv_blocks": load_scenario.NUM_BLOCKS,
            "server_starts": self.servers,
            "startup_s": self.startup_s,
            "probes": len(self.probes),
            "probes_per_phase": self.args.probes,
            "probes_served_a_hit": sum(p["served"] > 0 for p in self.probes),
            "probes_exact": {n: len(made[n]) - len(w) for n, w in wrong.items()},
            "probes_wrong": wrong,
            "witness_mismatches": self.witness_mismatches,
            "during": self.during,
            "record_rebuild": self.record_rebuild,
            "restart": self.restart,
            "relay": self.relay_figures,
            "consumers": figures,
            "silences_after_recovery": self.silences(figures),
        }

    def silences(self, figures: dict[str, Any]) -> list[dict[str, Any]]:
        """Each recovery after which the consumer's next live batch came
        ``SILENCE_S`` or more later (or never), with the batches the witness
        got in that time and when its first one came (to within
        ``WitnessTimeline.STEP_S``): none, or a first one as late as the
        consumer's, means the engine sent none; an earlier one means it was
        held or lost on the consumer's side."""
        found = []
        for name, f in figures.items():
            for r in f["recovered"]:
                wait = r["next_live_s"]
                if wait is None or wait >= SILENCE_S:
                    end = r["at"] + (wait if wait is not None else 3600.0)
                    found.append(
                        {
                            "consumer": name,
                            "by": r["by"],
                            "next_live_s": wait,
                            "witness_batches_meanwhile": self.witness.batches_between(
                                r["at"], end
                            ),
                            "witness_next_batch_s": self.witness.next_batch_s(r["at"]),
                        }
                    )
        return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--restart", action="store_true", help="restart the server, load again"
    )
    ap.add_argument(
        "--short-gaps",
        type=int,
        default=1,
        help="times the short consumer loses SHORT_GAP batches in a load phase",
    )
    ap.add_argument(
        "--consumer-python",
        type=Path,
        help="run the consumers in this python's venv, the standalone consumer "
        "wheel's (overlay_harness.consumer_host)",
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
