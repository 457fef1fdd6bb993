"""Routers other than the reference consumer, on the live server of
``recovery_scenario``.

A router that speaks no recovery protocol, NVIDIA Dynamo's standalone KV
indexer (``python -m dynamo.indexer`` from ``DYNAMO``, installed from the
package index), on the live server of ``recovery_scenario``: one indexer
behind the reference consumer's relay (``kv_events_consumer --relay``),
one subscribed to the engine's PUB itself (the control).

The relay, in the router's venv like the other consumers, follows the
engine through a ``Link`` that the scenario can cut (a SUB-to-PUB hop in
this process: while cut, the live batches are lost to the relay, as on a
dropped connection), and re-publishes on ``tcp://127.0.0.1``, where its
indexer subscribes. ``recovery_scenario`` starts both after its first load
phase (a late start), cuts the link for a whole load phase (a gap past the
replay buffer), restarts the engine, then restarts the relay, and probes
after each: each indexer's answer to ``/query`` for a probe's tokens,
capped as vLLM caps a hit, is its prediction (``predictors``), recorded
beside the server's ``cached_tokens``.

A router in a second language: the JavaScript follower written from
docs/snapshot-protocol.md alone (``docs/examples/js-follower``: Node.js
with ``zeromq`` and ``@msgpack/msgpack`` from the npm registry, as its
``package-lock.json`` pins them), behind the same link as the relay, so it
sees the same late start, lost phase and engine restart; it answers each
probe's prefix match on its stdin (``JsFollower``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from overlay_harness import server_scenario
from overlay_harness.consumer_host import Cli
from overlay_harness.server_scenario import SetupError
from vllm_overlay.paths import default_layout
from vllm_overlay.venv import tool_venv

# The standalone indexer of Dynamo's KV router, and its runtime.
DYNAMO = "ai-dynamo-runtime==1.6.1"
# The worker id each indexer gives the one engine it follows.
WORKER = 1
READY_WITHIN_S = 60.0
# From the moment the relay has forwarded a batch to the indexer's having
# applied it (an in-process queue; milliseconds, seen here).
APPLIED_WITHIN_S = 0.3
CAUGHT_UP_WITHIN_S = 60.0
JS_FOLLOWER = Path(__file__).resolve().parents[2] / "docs" / "examples" / "js-follower"
# A prefix match of the JavaScript follower: a status round trip, then the
# live batches up to it.
JS_ANSWER_WITHIN_S = 30.0


def dynamo_python(cache: Path, log: Path) -> Path:
    """The python of a venv that holds only ``DYNAMO`` (and its own
    dependencies), keyed by it."""
    return tool_venv(cache, "dynamo-env", DYNAMO, log)


class Indexer:
    """Dynamo's standalone KV indexer, following the engine's stream at
    ``endpoint`` as worker ``WORKER`` (and, for a fleet, ``more`` engines'
    as workers ``WORKER + 1``, ...), answering on a free local port."""

    def __init__(
        self,
        python: Path,
        endpoint: str,
        block_size: int,
        log: Path,
        more: tuple[str, ...] = (),
    ) -> None:
        workers = ",".join(f"{WORKER + i}={e}" for i, e in enumerate((endpoint, *more)))
        self.block_size = block_size
        self.base = f"http://127.0.0.1:{server_scenario.free_port()}"
        self._log = log.open("wb")
        self.process = subprocess.Popen(
            [str(python), "-m", "dynamo.indexer", "--threads", "1"]
            + ["--port", self.base.rsplit(":", 1)[1], "--block-size", str(block_size)]
            + ["--workers", workers],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + READY_WITHIN_S
        while not self._listening():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                tail = log.read_bytes()[-2000:].decode(errors="replace")
                raise SetupError(f"Dynamo's indexer did not start:\n{tail}")
            time.sleep(0.2)

    def _listening(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/workers", timeout=2) as r:
                workers = json.load(r)
        except OSError:
            return False
        return any(
            listener.get("status") == "active"
            for worker in workers
            for listener in worker.get("listeners", {}).values()
        )

    def predict(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` the indexer says the engine holds, once it
        has had the time to apply what reached it, capped as vLLM caps a
        hit (whole blocks, never the last prompt token)."""
        time.sleep(APPLIED_WITHIN_S)
        tokens = self.matched(prompt).get(WORKER, 0)
        blocks = min(tokens // self.block_size, (len(prompt) - 1) // self.block_size)
        return blocks * self.block_size

    def matched(self, token_ids: list[int]) -> dict[int, int]:
        """``/query``: per worker, the leading tokens of ``token_ids`` it
        holds (data-parallel rank 0)."""
        request = urllib.request.Request(
            self.base + "/query",
            data=json.dumps({"token_ids": token_ids, "model_name": "default"}).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            scores = json.load(r)["scores"]
        return {int(w): int(ranks.get("0", 0)) for w, ranks in scores.items()}

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


class Link:
    """A hop between the engine's PUB and the relay that can be cut: while
    ``cut``, what arrives is lost."""

    def __init__(self, endpoint: str) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._pub = ctx.socket(zmq.PUB)
        port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.cut = False
        self.lost = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(50):
                message = self._sub.recv_multipart()
                if self.cut:
                    self.lost += 1
                else:
                    self._pub.send_multipart(message)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sub.close(linger=0)
        self._pub.close(linger=0)


class Relayed:
    """The relay (the reference CLI with ``--relay``, in ``python``'s venv)
    and the two indexers: ``predictors`` for the scenario's probes."""

    def __init__(
        self,
        consumer: tuple[str, str],
        dynamo: Path,
        endpoints: tuple[str, str],
        block_size: int,
        log_dir: Path,
    ) -> None:
        self._consumer = consumer
        self._live, self._replay = endpoints
        self.link = Link(self._live)
        self.endpoint = f"tcp://127.0.0.1:{server_scenario.free_port()}"
        self.relays: list[Cli] = []
        self.relay = self._start_relay()
        self.behind_relay = Indexer(
            dynamo, self.endpoint, block_size, log_dir / "dynamo-behind-relay.log"
        )
        self.direct = Indexer(
            dynamo, self._live, block_size, log_dir / "dynamo-direct.log"
        )
        modules = js_follower_modules(default_layout().cache, log_dir / "npm-ci.log")
        self.js = JsFollower(
            modules, self.link.endpoint, self._replay, block_size, log_dir / "js"
        )
        self.predictors = {
            "dynamo_behind_relay": self._predict_behind_relay,
            "dynamo_direct": self.direct.predict,
            "js_follower": self.js.predict,
        }
        self._engine_next_seq: Callable[[], int] = lambda: 0

    def _start_relay(self) -> Cli:
        python, module = self._consumer
        cli = Cli(
            python,
            module,
            self.link.endpoint,
            self._replay,
            ("--relay", self.endpoint, "--interval", "0.2"),
        )
        self.relays.append(cli)
        return cli

    def follow(self, next_seq: Callable[[], int]) -> None:
        """Probes wait until the relay has applied what the engine sent:
        ``next_seq()`` is the engine's status's."""
        self._engine_next_seq = next_seq

    def caught_up(self) -> None:
        """Until the relay follows the engine, synced, up to its last
        batch."""
        target = self._engine_next_seq()
        deadline = time.monotonic() + CAUGHT_UP_WITHIN_S
        seen = len(self.relay.states)
        while True:
            fresh = self.relay.states[seen:]
            last = fresh[-1] if fresh else None
            if last and last["synced"] and (last["next_seq"] or 0) >= target:
                break
            if time.monotonic() > deadline or self.relay.process.poll() is not None:
                raise SetupError(f"the relay did not catch up to seq {target}: {last}")
            time.sleep(0.05)

    def _predict_behind_relay(self, prompt: list[int]) -> int:
        self.caught_up()
        return self.behind_relay.predict(prompt)

    def restart_relay(self) -> None:
        self.relay.process.terminate()
        self.relay.process.wait(30)
        self.relay = self._start_relay()

    def close(self, keys: int) -> dict[str, Any]:
        figures = {
            "dynamo": DYNAMO,
            "witness_keys": keys,
            "link_lost": self.link.lost,
            "relays": [cli.close(keys) for cli in self.relays],
            "js_follower": self.js.close(),
        }
        self.behind_relay.close()
        self.direct.close()
        self.link.close()
        return figures


def js_follower_modules(cache: Path, log: Path) -> Path:
    """The ``node_modules`` of the JavaScript follower, installed by ``npm
    ci`` from its lock file (install scripts off: the ``zeromq`` package
    carries its compiled addon), under ``cache``, keyed by the lock file."""
    lock = (JS_FOLLOWER / "package-lock.json").read_bytes()
    env = cache / f"js-follower-{hashlib.sha256(lock).hexdigest()[:16]}"
    stamp = env / ".complete"
    env.parent.mkdir(parents=True, exist_ok=True)
    with (env.parent / f"{env.name}.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if not stamp.exists():
            shutil.rmtree(env, ignore_errors=True)
            env.mkdir()
            for name in ("package.json", "package-lock.json"):
                shutil.copy(JS_FOLLOWER / name, env / name)
            with log.open("wb") as out:
                done = subprocess.run(
                    ["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund"],
                    cwd=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            if done.returncode:
                raise SetupError(f"npm ci failed in {env}: see {log}")
            stamp.touch()
    return env / "node_modules"


class JsFollower:
    """``docs/examples/js-follower/follower.mjs`` under Node.js, its state
    lines kept, its prefix matches asked on stdin."""

    def __init__(
        self, modules: Path, endpoint: str, replay: str, block_size: int, run_dir: Path
    ) -> None:
        self.block_size = block_size
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(JS_FOLLOWER / "follower.mjs", run_dir / "follower.mjs")
        (run_dir / "node_modules").symlink_to(modules)
        self.process = subprocess.Popen(
            ["node", "follower.mjs", "--endpoint", endpoint]
            + ["--replay-endpoint", replay, "--interval", "0.5"],
            cwd=run_dir,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.states: list[dict[str, Any]] = []
        self.anomalies: list[str] = []
        self._answers: list[int] = []
        self._answered = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None  # narrows type for mypy
        for line in self.process.stdout:
            if line.startswith("anomaly: "):
                self.anomalies.append(line.removeprefix("anomaly: ").strip())
                continue
            message = json.loads(line)
            if "match" in message:
                with self._answered:
                    self._answers.append(message["match"])
                    self._answered.notify()
            else:
                self.states.append(message)

    def predict(self, prompt: list[int]) -> int:
        """Its prefix match of ``prompt`` once caught up with the engine,
        capped as vLLM caps a hit."""
        assert self.process.stdin is not None  # narrows type for mypy
        self.process.stdin.write(json.dumps({"match": prompt}) + "\n")
        self.process.stdin.flush()
        with self._answered:
            if not self._answered.wait_for(lambda: self._answers, JS_ANSWER_WITHIN_S):
                raise SetupError(
                    f"the JavaScript follower did not answer within "
                    f"{JS_ANSWER_WITHIN_S:g} s: {self.states[-1:]}"
                )
            blocks = self._answers.pop(0)
        return min(blocks, (len(prompt) - 1) // self.block_size) * self.block_size

    def close(self) -> dict[str, Any]:
        running = self.process.poll() is None
        self.process.terminate()
        exit_code = self.process.wait(30)
        self._reader.join(10)
        return {
            "running_until_stopped": running,
            "exit_code": exit_code,
            "state_lines": len(self.states),
            "stale_lines": sum(s["stale_since"] is not None for s in self.states),
            "synced_epochs": list(
                dict.fromkeys(s["epoch"] for s in self.states if s["synced"])
            ),
            "anomalies": self.anomalies,
            "last": self.states[-1] if self.states else {},
        }
