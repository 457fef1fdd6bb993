"""The reference consumers of ``recovery_scenario``, each on its own thread as
its CLI runs it, with a link that can be cut; in the scenario's process, or
in another venv's python as a router runs it (``main``: the standalone
consumer wheel, ``vllm_kv_events_consumer``, in a venv without torch or
vLLM).

``main`` reads one JSON request per line on stdin and answers one JSON line
on stdout: ``join``, ``link``, ``predict``, ``held``, ``figures``; it
closes its consumers and exits at the end of stdin. It imports only the
standard library and the consumer package.

    python -m overlay_harness.consumer_host
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import threading
import time
from typing import Any

# The reference CLI's default idle interval before a status poll.
POLL_S = 1.0


class Cli:
    """The reference CLI in a process of its own (``python -m MODULE``), its
    state lines kept as they come."""

    def __init__(
        self,
        python: str,
        module: str,
        endpoint: str,
        replay: str,
        options: tuple[str, ...] = ("--interval", "1"),
    ) -> None:
        self.process = subprocess.Popen(
            [python, "-m", module, "--endpoint", endpoint]
            + ["--replay-endpoint", replay, *options],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.states: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None  # narrows type for mypy
        for line in self.process.stdout:
            if line.startswith("{"):
                self.states.append(json.loads(line))

    def await_synced(self, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while not (self.states and self.states[-1]["synced"]):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the reference CLI did not sync: {self.states[-1:]}"
                )
            time.sleep(0.1)

    def close(self, keys: int) -> dict[str, Any]:
        """Stop it (SIGTERM); what it showed, against the ``keys`` a
        subscriber that saw every batch holds."""
        running = self.process.poll() is None
        self.process.terminate()
        exit_code = self.process.wait(30)
        self._reader.join(10)
        last = self.states[-1] if self.states else {}
        return {
            "running_until_stopped": running,
            "exit_code": exit_code,
            "state_lines": len(self.states),
            "stale_lines": sum(s.get("stale_since") is not None for s in self.states),
            "synced_epochs": list(
                dict.fromkeys(s["epoch"] for s in self.states if s["synced"])
            ),
            "last": last,
            "last_set_keys": sum(
                row.get("set_keys", 0) for row in last.get("tiers", {}).values()
            ),
            "witness_keys": keys,
        }


class Consumer:
    """One reference consumer (``module.Follower``) on its own thread, and a
    link that can be cut: while ``cut``, or for the next ``lose`` batches,
    the live batches that arrive are lost to it."""

    def __init__(
        self,
        module: Any,
        endpoint: str,
        replay_endpoint: str,
        block_size: int,
    ) -> None:
        outer = self

        class Linked(module.Follower):  # type: ignore[misc]
            def on_live(self, seq: int, payload: bytes) -> None:
                # Delivered to its SUB socket, whatever the link then does.
                if outer.recovered and outer.recovered[-1]["next_live_s"] is None:
                    last = outer.recovered[-1]
                    last["next_live_s"] = round(time.time() - last["at"], 3)
                if outer.cut or outer.lose > 0:
                    outer.lose -= not outer.cut
                    outer.dropped += 1
                    return
                super().on_live(seq, payload)

            def recover(self, status: Any = None) -> None:
                before = dict(self.stats.recoveries)
                super().recover(status)
                kinds = [
                    k for k, n in self.stats.recoveries.items() if n > before.get(k, 0)
                ]
                # When it ended (wall clock, comparable with the witness's),
                # and how long until the next live batch reached it.
                outer.recovered.append(
                    {"by": kinds, "at": time.time(), "next_live_s": None}
                )

        self.module = module
        self.block_size = block_size
        self.cut = False
        self.lose = 0
        self.dropped = 0
        self.recovered: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.follower = Linked(endpoint, replay_endpoint)
        joined = time.monotonic()
        with self.lock:
            self.follower.sync()
            self.join_s = time.monotonic() - joined
            self.join_keys = len(self.follower.mirror.held_keys())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                # Through a restart too: stale while the server is down.
                self.follower.follow(0.02, POLL_S)

    def link(self, cut: bool, lose: int) -> None:
        self.cut, self.lose = cut, lose

    def predict(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` this consumer expects served from the cache,
        once it is up to date with what the publisher has sent (the status
        check its idle poll makes)."""
        with self.lock:
            self.follower.sync()
            matched = self.follower.mirror.match(prompt)
        blocks = min(
            max(matched.values(), default=0), (len(prompt) - 1) // self.block_size
        )
        return blocks * self.block_size

    def held(self) -> set[str]:
        """The held keys, each as its ``repr`` (comparable across processes)."""
        with self.lock:
            return {repr(key) for key in self.follower.mirror.held_keys()}

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
            "applied_batches": f.stats.applied,
            "unknown_removals": {
                "set": len(f.mirror.set.unknown_removals),
                "count": len(f.mirror.count.unknown_removals),
            },
            "join_s": round(self.join_s, 3),
            "join_keys": self.join_keys,
            "recovered": self.recovered,
        }

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.follower.close()


class RemoteConsumer:
    """A ``Consumer`` in ``host``'s process, with the same interface."""

    def __init__(self, host: Host, name: str, **join: Any) -> None:
        self.host, self.name = host, name
        joined = host.call("join", name, **join)
        self.join_s, self.join_keys = joined["join_s"], joined["join_keys"]

    def link(self, cut: bool, lose: int) -> None:
        self.host.call("link", self.name, cut=cut, lose=lose)

    def predict(self, prompt: list[int]) -> int:
        tokens: int = self.host.call("predict", self.name, prompt=prompt)["tokens"]
        return tokens

    def held(self) -> set[str]:
        return set(self.host.call("held", self.name)["keys"])

    def figures(self) -> dict[str, Any]:
        figures: dict[str, Any] = self.host.call("figures", self.name)
        return figures

    def close(self) -> None:
        """Closed with its host."""


class Host:
    """``python -m overlay_harness.consumer_host`` of another venv, and one
    request at a time to it (the scenario's threads share it)."""

    def __init__(self, process: Any) -> None:
        self.process = process
        self.lock = threading.Lock()

    def call(self, op: str, name: str, **args: Any) -> dict[str, Any]:
        with self.lock:
            line = json.dumps({"op": op, "name": name, **args})
            self.process.stdin.write(line + "\n")
            self.process.stdin.flush()
            answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(
                f"the consumer host exited ({self.process.wait()}) on {op} {name}"
            )
        reply: dict[str, Any] = json.loads(answer)
        if "error" in reply:
            raise RuntimeError(f"consumer host, {op} {name}: {reply['error']}")
        return reply

    def close(self) -> None:
        with self.lock:
            self.process.stdin.close()
        self.process.wait(timeout=60)


def serve(module: Any) -> None:
    consumers: dict[str, Consumer] = {}
    for line in sys.stdin:
        request = json.loads(line)
        op, name = request.pop("op"), request.pop("name")
        try:
            if op == "join":
                c = consumers[name] = Consumer(module, **request)
                reply: dict[str, Any] = {"join_s": c.join_s, "join_keys": c.join_keys}
            elif op == "link":
                consumers[name].link(**request)
                reply = {}
            elif op == "predict":
                reply = {"tokens": consumers[name].predict(**request)}
            elif op == "held":
                reply = {"keys": sorted(consumers[name].held())}
            elif op == "figures":
                reply = consumers[name].figures()
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # answered, so the scenario can say what failed
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    for c in consumers.values():
        c.close()


def main() -> int:
    serve(importlib.import_module("vllm_kv_events_consumer.kv_events_consumer"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
