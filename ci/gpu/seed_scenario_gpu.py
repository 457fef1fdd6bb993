"""The seed's KV-event scenario against a real ``vllm serve`` on a GPU machine.

Not part of CI: run it by hand where a GPU exists, with the venv where the
wheel under test is installed (``vllm`` on PATH, or ``--vllm``)::

    python ci/gpu/seed_scenario_gpu.py --policy logical --policy last_copy \
        --policy physical
    python ci/gpu/seed_scenario_gpu.py --policy none  # a wheel without copy_semantics

For each policy it starts ``vllm serve`` of the tiny model whose config ships
in ``tests/data/tiny-model`` with dummy weights (``--load-format dummy``, no
model hub, no tokenizer: prompts are token ids), ``--block-size 16
--num-gpu-blocks-override 8 --enable-prefix-caching`` and KV events over ZMQ;
sends three identical 32-token completion requests one after the other, then
twelve unique ones, over HTTP to 127.0.0.1; decodes the event stream with
the stock schema (``vllm.distributed.kv_events.KVEventBatch``) and prints
the same report as ``tests/test_seed_scenario_zmq.py``.

The subscriber binds ``tcp://127.0.0.1:<free port>`` before the server starts
and the server's publisher connects to it (vLLM 0.33.0 connects for an
endpoint with a concrete host).  Phases are split by draining the stream
until it has been quiet for ``--quiet-s`` seconds after the last response.

Exit status: 0 when every policy's figures match the expected ones (``none``
expects upstream 0.33.0's 3/0/3/0), 1 on a mismatch, 2 on a set-up error.
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from overlay_harness import seed_scenario  # noqa: E402
from overlay_harness.seed_scenario import Subscriber  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = HERE.parents[1] / "tests" / "data" / "tiny-model"
BLOCK_SIZE = seed_scenario.BLOCK_SIZE
NUM_GPU_BLOCKS = seed_scenario.NUM_GPU_BLOCKS
MAX_MODEL_LEN = 64
SERVED_NAME = "tiny"

EXPECTED: dict[str, tuple[int, int, int, int]] = {
    **seed_scenario.EXPECTED,
    # no copy_semantics: unpatched 0.33.0 behaviour
    "none": seed_scenario.EXPECTED_UNPATCHED,
}


@dataclasses.dataclass(frozen=True)
class Report(seed_scenario.Report):
    first_seq: int | None


class SetupError(Exception):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_events_config(endpoint: str, policy: str) -> str:
    fields = seed_scenario.kv_events_fields(
        endpoint, None if policy == "none" else policy
    )
    return json.dumps(fields)


def serve_command(
    vllm: str, model_dir: Path, port: int, kv_cfg: str, extra: list[str]
) -> list[str]:
    return [
        *shlex.split(vllm),
        "serve",
        str(model_dir),
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
        str(NUM_GPU_BLOCKS),
        "--enable-prefix-caching",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "4",
        "--enforce-eager",
        "--kv-events-config",
        kv_cfg,
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
            raise SetupError(f"vllm serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SetupError(f"vllm serve not healthy within {timeout_s} s")


def complete(base: str, prompt: list[int], timeout_s: float) -> None:
    out = http_json(
        base + "/v1/completions",
        {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
            "ignore_eos": True,
        },
        timeout_s,
    )
    if not out or "choices" not in out:
        raise SetupError(f"unexpected completion response: {out!r}")


def find_target(batches: list[Any]) -> Any:
    """The hash of the repeated prompt's 2nd block, as the stream names it."""
    target = seed_scenario.find_target(batches)
    if target is None:
        raise SetupError("no BlockStored carries the repeated prompt's 2nd block")
    return target


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def run_policy(policy: str, args: argparse.Namespace, log_dir: Path) -> Report:
    sub = Subscriber()
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = serve_command(
        args.vllm,
        args.model_dir,
        port,
        kv_events_config(sub.endpoint, policy),
        shlex.split(args.extra_serve_args),
    )
    log_path = log_dir / f"serve-{policy}.log"
    print("$ " + shlex.join(cmd), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            wait_ready(base, proc, args.startup_timeout)
            for _ in range(seed_scenario.NUM_REPEATS):
                complete(base, seed_scenario.REPEATED_PROMPT, args.request_timeout)
            before = sub.drain(args.quiet_s, 60)
            for i in range(seed_scenario.NUM_UNIQUE):
                complete(base, seed_scenario.unique_prompt(i), args.request_timeout)
            after = sub.drain(args.quiet_s, 60)
        except (SetupError, urllib.error.URLError, OSError) as e:
            tail = log_path.read_bytes()[-4000:].decode(errors="replace")
            raise SetupError(f"{policy}: {e}\n--- {log_path} (tail) ---\n{tail}") from e
        finally:
            stop(proc)
            sub.close()
    target = find_target(before)
    return Report.from_stream(
        policy,
        before,
        after,
        target,
        sub,
        first_seq=sub.seqs[0] if sub.seqs else None,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Seed KV-event scenario against a real `vllm serve` (GPU)."
    )
    ap.add_argument(
        "--policy",
        action="append",
        choices=list(EXPECTED),
        help="copy_semantics value; repeatable (default: logical, last_copy, "
        "physical); 'none' leaves the field out",
    )
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--vllm", default="vllm", help="command that runs vllm")
    ap.add_argument("--port", type=int, default=0, help="HTTP port (default: free)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--quiet-s", type=float, default=2.0)
    ap.add_argument("--extra-serve-args", default="", help="appended to vllm serve")
    ap.add_argument("--out", type=Path, help="also write the reports here (JSON)")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: temp dir)")
    args = ap.parse_args(argv)
    policies = args.policy or ["logical", "last_copy", "physical"]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="seed-scenario-gpu-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    reports: list[Report] = []
    ok = True
    try:
        for p in policies:
            r = run_policy(p, args, log_dir)
            reports.append(r)
            good = r.figures() == EXPECTED[p] and r.seq_gaps == 0 and r.first_seq == 0
            ok &= good
            print(("OK   " if good else "FAIL ") + r.line(), flush=True)
    except SetupError as e:
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
