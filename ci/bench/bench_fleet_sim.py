"""What the exact stream is worth to a fleet at fleet scale: a simulated
fleet of real vLLM Schedulers behind a KV-aware router, deterministic and
seeded.

Engines: ``N`` real v1 ``Scheduler``s (``make_cpu_scheduler``: the real
``KVCacheManager`` and ``BlockPool``, a small GPU cache each), stepped in
lockstep with made-up model outputs (no forward pass), publishing through
the real event path: the scheduler hands each ``KVEventBatch`` to the
publisher, here a tap (``FeedTap``) that sizes it as ``ZmqEventPublisher``
sends it and passes it on, one step late, to the router.

Indexes, all fed from the same stream:

* ``set``: Dynamo's real ``RadixTree`` (``ai-dynamo-runtime``, the index of
  its KV router) fed raw, as AIBrix-style routers use an index: a store
  inserts, a removal deletes (``bench_fleet.DynamoFeed``);
* ``counting``: the same tree behind a reference-counting filter, as Dynamo
  and llm-d apply (a removal is forwarded when its key's count reaches 0);
* ``oracle``: the engines' block pools read directly (the truth);
* ``round-robin``: no index.

Routing: ``longest`` (longest predicted prefix, ties to the engine with
fewer requests, then the lower id) and ``dynamo`` (Dynamo's default cost:
blocks still to prefill plus the engine's active blocks, the lowest wins).
Every run keeps all three indexes, whichever one routes: each request's
prediction by each index is scored against the oracle's (per-request
exactness at the engine the index would choose), and each index's choice
against the oracle's choice.

Workloads (one window of requests per seed): ``chat-0.25/0.5/0.75``,
multi-turn conversations over shared system prompts, that share of them
opening with one of a few identical block-aligned openers; the Mooncake
FAST'25 ``conversation`` and ``synthetic`` traces (``data/mooncake``, one
16-token block per 512-token Mooncake block, prompts capped at
``MAX_PROMPT_BLOCKS`` blocks, arrivals paced by the trace's timestamps).

Item 2, a gap: a third into the trace the router misses every batch for ``GAP_TICKS``
ticks, more than the publisher's ``buffer_steps``. Upstream's stream has no
way back: the router goes on (``ignore``), drops what it knew and relearns
(``relearn``), or resets every engine's prefix cache (``reset``). Ours: the
router restarts with the shipped consumer (its ``Follower``, this
checkout's ``overlay/vllm/distributed/kv_events_consumer.py``) on the real
``ZmqEventPublisher`` on 127.0.0.1, which recovers by snapshot
(``snapshot``).

    python ci/bench/bench_fleet_sim.py --patched-tree build/tree \\
        --unpatched-tree "$(ci/overlay pristine-tree)" --python PY \\
        --out docs/benchmarks [--quick] [--jobs 2]

``--python`` is the workers' base Python (vLLM's dependencies); Dynamo's
runtime is layered over it (``bench_fleet.fleet_env``). The report goes to
``<out>/fleet_sim.json``; ``run_all.py --render-only`` renders it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

sys.path[:0] = [
    str(Path(__file__).resolve().parents[1]),
    str(Path(__file__).resolve().parent),
]
import bench_fleet  # noqa: E402
import benchlib as bl  # noqa: E402

# The report's names; REPORT and headline also for tests/test_docs.py, which
# reads them here.
from fleet_sim_report import (  # noqa: E402, F401
    OURS,
    REPORT,
    ROUTINGS,
    UPSTREAM_RECOVERY,
    headline,
)

from overlay_harness.relay_scenario import DYNAMO  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "tests" / "data" / "tiny-model"
MOONCAKE = Path(__file__).resolve().parent / "data" / "mooncake"
BS = bl.BLOCK_SIZE
MAX_MODEL_LEN = 2048
MAX_SEQS = 4
KV_BLOCKS = 64
# Prompt tokens a step computes: a long prefill takes several steps.
MAX_BATCHED = 256
# The longest prompt, in blocks: well within one engine's cache.
MAX_PROMPT_BLOCKS = 28
MAX_TOKENS = 8
# Arrivals per engine per tick, all workloads.
LOAD = 0.4
BUFFER_STEPS = 8
GAP_TICKS = 30
FLEETS = (8, 16)
SEEDS = (0, 1, 2)
WORKLOADS = ("chat-0.25", "chat-0.5", "chat-0.75", "conversation", "synthetic")
INDEXES = ("set", "counting", "oracle")
# (index that routes, routing); round-robin has neither.
ROUTERS: tuple[tuple[str, str], ...] = (
    *((i, r) for r in ROUTINGS for i in INDEXES),
    ("round-robin", "-"),
)
GAP_WORKLOADS = ("chat-0.5", "conversation")


# --------------------------------------------------------------------------
# workloads (numpy only: the driver and the workers build the same ones)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    tick: int
    prompt: list[int]
    max_tokens: int


def chat_workload(dup: float, seed: int, requests: int, engines: int) -> list[Arrival]:
    """Multi-turn conversations: a shared system prompt (4 of them, skewed
    popularity), then with probability ``dup`` one of 6 identical
    block-aligned openers, else a user message of its own; each later turn
    is the previous prompt, a stand-in reply and a new message (a third of
    them ending on a block boundary), at least 10 ticks after the turn
    before. Arrivals: Poisson, ``LOAD`` per engine per tick."""
    import numpy as np

    rng = np.random.default_rng([seed, int(dup * 100)])

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(1000, 32000, size=n)]

    systems = [tokens(BS * int(rng.integers(4, 9))) for _ in range(4)]
    openers = [tokens(BS * int(rng.integers(1, 4))) for _ in range(6)]
    popularity = 1.0 / np.arange(1, len(systems) + 1)
    popularity /= popularity.sum()
    live: list[tuple[list[int], int, int]] = []  # prompt, turns left, last tick
    out: list[Arrival] = []
    tick = 0
    while len(out) < requests:
        for _ in range(int(rng.poisson(LOAD * engines))):
            ready = [i for i, c in enumerate(live) if tick - c[2] >= 10]
            if ready and rng.random() < 0.7:
                i = ready[int(rng.integers(0, len(ready)))]
                prompt, left, _ = live[i]
                prompt = (
                    prompt
                    + tokens(int(rng.integers(2, 9)))
                    + tokens(int(rng.integers(3, 40)))
                )
                if rng.random() < 1 / 3:
                    prompt = prompt + tokens(-len(prompt) % BS)
                if left <= 1 or len(prompt) > (MAX_PROMPT_BLOCKS - 4) * BS:
                    live.pop(i)
                else:
                    live[i] = (prompt, left - 1, tick)
            else:
                system = systems[int(rng.choice(len(systems), p=popularity))]
                if rng.random() < dup:
                    prompt = system + openers[int(rng.integers(0, len(openers)))]
                else:
                    prompt = system + tokens(int(rng.integers(3, 60)))
                live.append((prompt, int(rng.integers(1, 7)), tick))
            out.append(Arrival(tick, prompt, int(rng.integers(1, MAX_TOKENS + 1))))
        tick += 1
    return out[:requests]


# Per trace, each block id's tokens (the same in every window and run).
BLOCK_TOKENS: dict[str, dict[int, list[int]]] = {}


def mooncake_workload(
    trace: str, seed: int, requests: int, engines: int
) -> list[Arrival]:
    """Window ``seed`` (``requests`` lines from line ``seed * requests``) of
    a Mooncake trace: each 512-token block id is 16 tokens of its own (equal
    ids, equal tokens), a partial last block its share of them (1 to 15),
    prompts cut at ``MAX_PROMPT_BLOCKS`` blocks (plus 8 tokens of the next);
    output lengths scaled by 1/32 (1 to ``MAX_TOKENS``); the window's
    timestamps scaled to ``LOAD`` arrivals per engine per tick."""
    import numpy as np

    path = MOONCAKE / f"{trace}_trace.jsonl"
    with path.open() as f:
        lines = f.readlines()[seed * requests : (seed + 1) * requests]
    if len(lines) < requests:
        raise SystemExit(f"{path}: {len(lines)} requests for window {seed}")
    rows = [json.loads(line) for line in lines]
    t0, t1 = rows[0]["timestamp"], rows[-1]["timestamp"]
    ms_per_tick = max(t1 - t0, 1) / (requests / (LOAD * engines))
    block_tokens = BLOCK_TOKENS.setdefault(trace, {})

    def block(h: int) -> list[int]:
        if h not in block_tokens:
            g = np.random.default_rng([h, len(trace)])
            block_tokens[h] = [int(t) for t in g.integers(1000, 32000, size=BS)]
        return block_tokens[h]

    out = []
    for r in rows:
        ids = r["hash_ids"]
        full, rest = divmod(r["input_length"], 512)
        prompt = [t for h in ids[: min(full, MAX_PROMPT_BLOCKS)] for t in block(h)]
        if full >= MAX_PROMPT_BLOCKS and len(ids) > MAX_PROMPT_BLOCKS:
            prompt += block(ids[MAX_PROMPT_BLOCKS])[:8]
        elif rest:
            # Its share of the block's tokens, never all of them: a prompt
            # the trace does not align stays unaligned.
            prompt += block(ids[full])[: min(-(-rest * BS // 512), BS - 1)]
        max_tokens = min(max(round(r["output_length"] / 32), 1), MAX_TOKENS)
        tick = int((r["timestamp"] - t0) / ms_per_tick)
        out.append(Arrival(tick, prompt, max_tokens))
    return out


def workload(name: str, seed: int, requests: int, engines: int) -> list[Arrival]:
    if name.startswith("chat-"):
        return chat_workload(float(name[5:]), seed, requests, engines)
    if name in ("conversation", "synthetic"):
        return mooncake_workload(name, seed, requests, engines)
    raise SystemExit(f"unknown workload {name!r}")


def workload_stats(arrivals: Sequence[Arrival]) -> dict[str, float]:
    """How much of a workload repeats: exact repeats of an earlier prompt,
    and block-aligned prompts."""
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for a in arrivals:
        key = tuple(a.prompt)
        repeats += key in seen
        seen.add(key)
    n = len(arrivals)
    return {
        "requests": n,
        "repeated_prompts": repeats / n,
        "block_aligned": sum(len(a.prompt) % BS == 0 for a in arrivals) / n,
        "mean_prompt_tokens": sum(len(a.prompt) for a in arrivals) / n,
    }


# --------------------------------------------------------------------------
# worker side: engines and indexes
# --------------------------------------------------------------------------


class FeedTap(bl.EventTap):
    """The scheduler's publisher: each batch sized as ZMQ sends it and kept
    for the router (``take``)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[Any] = []

    def publish(self, batch: Any) -> None:
        super().publish(batch)
        self.batches.append(batch)

    def take(self) -> list[Any]:
        out, self.batches = self.batches, []
        return out


class Engine:
    """One real Scheduler with a made-up model, and its publisher."""

    def __init__(self, policy: str | None, seed: int, publisher: Any = None) -> None:
        import numpy as np
        from vllm.config import KVEventsConfig

        fields: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "null"}
        if policy is not None:
            fields["copy_semantics"] = policy
        self.scheduler = bl.make_cpu_scheduler(
            str(MODEL_DIR),
            KV_BLOCKS,
            MAX_SEQS,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=MAX_BATCHED,
            seed=0,
            kv_events_config=KVEventsConfig(**fields),
        )
        self.tap = FeedTap()
        self.scheduler.kv_event_publisher = publisher or self.tap
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.rng = np.random.default_rng(seed)

    def held_prefix(self, hashes: Sequence[Any]) -> int:
        """The oracle: leading blocks of ``hashes`` resident in the pool."""
        return bl.prefix_len(
            hashes, lambda h: self.pool.get_cached_block(h, [0]) is not None
        )

    def load(self) -> tuple[int, int]:
        """Requests in the engine, and the blocks they hold or will."""
        reqs = self.scheduler.requests.values()
        return len(reqs), sum(-(-r.num_tokens // BS) for r in reqs)

    def step(self) -> list[Any]:
        """One step if there is work; the outputs that carry tokens."""
        if not self.scheduler.has_unfinished_requests():
            return []
        _, outputs = bl.step(
            self.scheduler, lambda _r: int(self.rng.integers(1000, 32000))
        )
        return [o for eco in outputs.values() for o in eco.outputs if o.new_token_ids]


class DynamoIndex:
    """Dynamo's RadixTree over the fleet, raw (a set) or behind a counting
    filter; one ``DynamoFeed`` per engine."""

    def __init__(self, engines: int, counting: bool) -> None:
        from dynamo._core import RadixTree, compute_block_hash_for_seq

        self.tree = RadixTree()
        self.hash_blocks = compute_block_hash_for_seq
        self.feeds = [
            bench_fleet.DynamoFeed(self.tree, w, counting, block_size=BS)
            for w in range(engines)
        ]

    def predict(self, prompt: Sequence[int], cap: int) -> list[int]:
        return bench_fleet.predicted_blocks(
            self.tree, self.hash_blocks, prompt, cap, len(self.feeds), BS
        )

    def rejections(self) -> int:
        return sum(sum(f.rejected.values()) for f in self.feeds)

    def below_zero(self) -> int:
        return sum(f.counts_below_zero for f in self.feeds)


def choose(routing: str, held: Sequence[int], need: int, loads: Sequence[Any]) -> int:
    """The engine a router picks from its predicted prefixes ``held``."""
    engines = range(len(held))
    if routing == "longest":
        return min(engines, key=lambda w: (-held[w], loads[w][0], w))
    # Dynamo's default cost (overlap weight 1): blocks to prefill plus the
    # blocks the engine is already decoding.
    return min(engines, key=lambda w: (need - held[w] + loads[w][1], w))


@dataclass
class Served:
    """What the engines did with the requests (from their outputs)."""

    arrival: dict[str, int] = field(default_factory=dict)
    ttft: dict[str, int] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    prompt: dict[str, int] = field(default_factory=dict)

    def record(self, tick: int, outputs: Sequence[Any]) -> None:
        for o in outputs:
            rid = o.request_id
            if rid not in self.ttft:
                self.ttft[rid] = tick + 1 - self.arrival[rid]
            if o.prefill_stats is not None and rid not in self.cached:
                self.cached[rid] = o.prefill_stats.num_cached_tokens

    def figures(self, ids: Sequence[str]) -> dict[str, Any]:
        prompt = sum(self.prompt[r] for r in ids)
        cached = sum(self.cached.get(r, 0) for r in ids)
        ttft = [self.ttft[r] for r in ids]
        return {
            "requests": len(ids),
            "prompt_tokens": prompt,
            "hit_ratio": cached / prompt if prompt else float("nan"),
            "tokens_computed": prompt - cached,
            "ttft_steps_mean": sum(ttft) / len(ttft) if ttft else float("nan"),
            "ttft_steps_p90": bl.percentile(ttft, 0.9),
        }


class Scores:
    """Per index: predictions at the engine it would choose, vs the oracle."""

    def __init__(self) -> None:
        self.n = 0
        self.exact = 0
        self.over = 0
        self.under = 0
        self.agree = 0

    def add(self, predicted: int, true: int, agree: bool) -> None:
        self.n += 1
        self.exact += predicted == true
        self.over += predicted > true
        self.under += predicted < true
        self.agree += agree

    def figures(self) -> dict[str, float]:
        n = max(self.n, 1)
        return {
            "exact": self.exact / n,
            "over": self.over / n,
            "under": self.under / n,
            "agree_with_oracle": self.agree / n,
        }


@dataclass(frozen=True)
class Arrived:
    """A request as it reaches the router, and what the engines hold of it."""

    number: int
    prompt: list[int]
    request: Any
    cap: int  # blocks a hit can cover (the last prompt token is computed)
    need: int  # blocks the request takes
    loads: list[tuple[int, int]]
    truth: list[int]  # per engine, the oracle's prefix


class Fleet:
    """The engines in lockstep, the trace's arrivals, what they served."""

    def __init__(self, arrivals: list[Arrival], engines: list[Engine]) -> None:
        self.arrivals = arrivals
        self.engines = engines
        self.served = Served()
        self.hasher = bl.make_hasher()
        self.tick = 0
        self.next = 0

    def running(self) -> bool:
        return self.next < len(self.arrivals) or any(
            e.scheduler.has_unfinished_requests() for e in self.engines
        )

    def arriving(self) -> Iterator[Arrived]:
        """The requests that arrive at this tick; each must be ``send``."""
        while (
            self.next < len(self.arrivals)
            and self.arrivals[self.next].tick <= self.tick
        ):
            a = self.arrivals[self.next]
            req = bl.make_request(f"r{self.next}", a.prompt, self.hasher, a.max_tokens)
            cap = (req.num_tokens - 1) // BS
            yield Arrived(
                self.next,
                a.prompt,
                req,
                cap,
                -(-req.num_tokens // BS),
                [e.load() for e in self.engines],
                [e.held_prefix(req.block_hashes[:cap]) for e in self.engines],
            )
            self.next += 1

    def send(self, arrived: Arrived, engine: int) -> None:
        req = arrived.request
        self.served.arrival[req.request_id] = self.tick
        self.served.prompt[req.request_id] = req.num_tokens
        self.engines[engine].scheduler.add_request(req)

    def step(self) -> None:
        """One step of every engine with work (the tick ends with ``tick += 1``)."""
        for e in self.engines:
            self.served.record(self.tick, e.step())
        if self.tick > 50 * len(self.arrivals) + 1000:
            raise RuntimeError(f"the fleet did not finish in {self.tick} ticks")

    def shutdown(self) -> None:
        for e in self.engines:
            e.scheduler.shutdown()


@dataclass(frozen=True)
class Case:
    """What a fleet run and a gap run share: the engines' copy semantics,
    the traffic, the fleet's size and seed, and the router's index."""

    policy: str | None
    workload: str
    engines: int
    seed: int
    requests: int
    index: str

    @classmethod
    def of(cls, job: dict[str, Any]) -> Case:
        return cls(*(job[f.name] for f in fields(cls)))

    def header(self) -> dict[str, Any]:
        """The fields every result starts with."""
        return {
            "workload": self.workload,
            "engines": self.engines,
            "seed": self.seed,
            "index": self.index,
        }

    def fleet(self, publishers: list[Any] | None = None) -> tuple[list[Any], Fleet]:
        """The case's arrivals, and a fleet of fresh engines to serve them
        (each publishing through ``publishers[w]`` if given)."""
        arrivals = workload(self.workload, self.seed, self.requests, self.engines)
        engines = [
            Engine(
                self.policy,
                self.seed * 1000 + w,
                None if publishers is None else publishers[w],
            )
            for w in range(self.engines)
        ]
        return arrivals, Fleet(arrivals, engines)


def run_fleet(case: Case, routing: str) -> dict[str, Any]:
    """One fleet run routed by ``case.index`` under ``routing``."""
    engines_n, index = case.engines, case.index
    arrivals, fleet = case.fleet()
    trees = {
        "set": DynamoIndex(engines_n, False),
        "counting": DynamoIndex(engines_n, True),
    }
    scores = {k: Scores() for k in INDEXES}
    # Round-robin's shadow indexes are scored as longest-prefix routers.
    policy_of = routing if routing != "-" else "longest"
    while fleet.running():
        for a in fleet.arriving():
            held = {k: t.predict(a.prompt, a.cap) for k, t in trees.items()}
            held["oracle"] = a.truth
            picks = {k: choose(policy_of, h, a.need, a.loads) for k, h in held.items()}
            for k, h in held.items():
                w = picks[k]
                scores[k].add(h[w], a.truth[w], w == picks["oracle"])
            fleet.send(
                a, a.number % engines_n if index == "round-robin" else picks[index]
            )
        fleet.step()
        for w, e in enumerate(fleet.engines):
            for batch in e.tap.take():
                for t in trees.values():
                    t.feeds[w].apply(batch)
        fleet.tick += 1
    wire = [e.tap.totals() for e in fleet.engines]
    fleet.shutdown()
    return {
        **case.header(),
        "routing": routing,
        "ticks": fleet.tick,
        **fleet.served.figures([f"r{j}" for j in range(len(arrivals))]),
        "scores": {k: s.figures() for k, s in scores.items()},
        "tree_rejections": {k: t.rejections() for k, t in trees.items()},
        "counts_below_zero": trees["counting"].below_zero(),
        "wire_bytes_per_request": sum(x["frame_bytes"] for x in wire) / len(arrivals),
        "events_per_request": sum(
            x["stored_events"] + x["removed_events"] + x["cleared_events"] for x in wire
        )
        / len(arrivals),
    }


# -- item 2: a gap mid-trace ------------------------------------------------


class CountedPublisher:
    """The real ZmqEventPublisher on 127.0.0.1 (buffer ``BUFFER_STEPS``,
    snapshot record on), counting batches so the consumer knows what to
    wait for."""

    def __init__(self, policy: Any) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        self.zmq = ZmqEventPublisher(
            data_parallel_rank=0,
            # A free port on the node's IP: 127.0.0.1 (VLLM_HOST_IP, set by
            # the worker).
            endpoint="tcp://*:0",
            replay_endpoint="tcp://*:0",
            buffer_steps=BUFFER_STEPS,
            copy_semantics=policy,
        )
        config = self.zmq.get_publisher_config()
        assert config.replay_endpoint is not None
        self.endpoints = (config.endpoint, config.replay_endpoint)
        self.published = 0

    def publish(self, batch: Any) -> None:
        self.published += 1
        self.zmq.publish(batch)

    def shutdown(self) -> None:
        self.zmq.shutdown()


class ConsumerView:
    """The router's view of one engine through the shipped consumer."""

    def __init__(self, publisher: CountedPublisher) -> None:
        self.publisher = publisher
        # The checkout's consumer, as the mirrors beside it: one copy of the
        # module per process, whatever the wheel holds.
        self.follower = bl.checkout_consumer().Follower(*publisher.endpoints)
        self.follower.sync(publisher.published)

    def catch_up(self) -> None:
        """Apply every batch published so far: from the live stream, or by
        ``sync`` (a status request, and a recovery if one is missing)."""
        f, published = self.follower, self.publisher.published
        deadline = time.monotonic() + 1.0
        while (
            f.synced
            and f.next_seq is not None
            and f.next_seq < published
            and time.monotonic() < deadline
        ):
            f.poll(0.002)
        if not (f.synced and f.next_seq == published):
            f.sync(published)

    def predict(self, prompt: Sequence[int], cap: int) -> int:
        matched = self.follower.mirror.match(list(prompt[: cap * BS]))
        return min(max(matched.values(), default=0), cap)

    def close(self) -> None:
        self.follower.close()


class GapRouter:
    """A gap run's router: its view of each engine (the shipped consumer's
    on ours, a mirror fed from the engines' taps on upstream's), the batches
    it missed, and its scores before and after the gap."""

    def __init__(
        self,
        case: Case,
        recovery: str,
        publishers: list[CountedPublisher],
        gap_start: int,
    ) -> None:
        from vllm.distributed.kv_events import MEDIUM_GPU
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self.medium, self.convert = MEDIUM_GPU, maybe_convert_block_hash
        self.recovery = recovery
        self.ours = recovery == "snapshot"
        self.publishers = publishers
        self.gap_start = gap_start
        self.gap_end = gap_start + GAP_TICKS
        self.views = [ConsumerView(p) for p in publishers]
        consumer = bl.checkout_consumer()
        self.mirrors = [
            consumer.CountMirror() if case.index == "counting" else consumer.SetMirror()
            for _ in range(case.engines)
        ]
        self.after = Scores()
        self.after_ids: list[str] = []
        self.before = Scores()
        # Per engine, the batches the router missed.
        self.missed_batches = [0] * case.engines

    def recover(self, fleet: Fleet) -> None:
        """At the gap's end: ``recovery``."""
        if self.recovery == "relearn":
            self.mirrors = [type(m)() for m in self.mirrors]
        elif self.recovery == "reset":
            for e in fleet.engines:
                if not e.scheduler.reset_prefix_cache(reset_running_requests=True):
                    raise RuntimeError("reset_prefix_cache refused")
            self.mirrors = [type(m)() for m in self.mirrors]
        elif self.ours:
            # The router restarts: new consumers, recovered by snapshot.
            for v in self.views:
                v.close()
            self.views = [ConsumerView(p) for p in self.publishers]

    def held(self, a: Arrived) -> list[int]:
        """Per engine, the prefix of ``a`` the router's view predicts."""
        if self.ours:
            return [v.predict(a.prompt, a.cap) for v in self.views]
        keys = [
            (self.medium, 0, self.convert(h)) for h in a.request.block_hashes[: a.cap]
        ]
        return [bl.prefix_len(keys, m.__contains__) for m in self.mirrors]

    def route(self, fleet: Fleet) -> None:
        """Send this tick's arrivals by longest prefix, scored before the
        gap and after it."""
        for a in fleet.arriving():
            held = self.held(a)
            w = choose("longest", held, 0, a.loads)
            w_true = choose("longest", a.truth, 0, a.loads)
            if fleet.tick >= self.gap_end:
                self.after.add(held[w], a.truth[w], w == w_true)
                self.after_ids.append(a.request.request_id)
            elif fleet.tick < self.gap_start:
                self.before.add(held[w], a.truth[w], w == w_true)
            fleet.send(a, w)

    def follow(self, fleet: Fleet, published: list[int]) -> None:
        """After a step: the batches it published, missed inside the gap
        (``published``: each publisher's count before the step)."""
        missed = self.gap_start <= fleet.tick < self.gap_end
        if self.ours:
            if missed:
                for w, p in enumerate(self.publishers):
                    self.missed_batches[w] += p.published - published[w]
            else:
                for v in self.views:
                    v.catch_up()
            return
        for w, e in enumerate(fleet.engines):
            for batch in e.tap.take():
                if missed:
                    self.missed_batches[w] += 1
                else:
                    for ev in batch.events:
                        self.mirrors[w].apply(ev)

    def recoveries(self) -> dict[str, int]:
        """The consumers' recoveries, summed by kind."""
        recoveries: dict[str, int] = {}
        for v in self.views:
            for k, n in v.follower.stats.recoveries.items():
                recoveries[k] = recoveries.get(k, 0) + n
        return recoveries

    def close(self) -> None:
        for v in self.views:
            v.close()


def run_gap(case: Case, recovery: str) -> dict[str, Any]:
    """A fleet routed by longest prefix whose router misses every batch for
    ``GAP_TICKS`` ticks from the tick a third of the requests have arrived,
    then recovers by ``recovery``."""
    ours = recovery == "snapshot"
    publishers = (
        [CountedPublisher(case.policy) for _ in range(case.engines)] if ours else []
    )
    arrivals, fleet = case.fleet(publishers if ours else None)
    gap_start = arrivals[len(arrivals) // 3].tick
    router = GapRouter(case, recovery, publishers, gap_start)
    try:
        while fleet.running():
            if fleet.tick == router.gap_end:
                router.recover(fleet)
            router.route(fleet)
            published = [p.published for p in publishers]
            fleet.step()
            router.follow(fleet, published)
            fleet.tick += 1
    finally:
        router.close()
        fleet.shutdown()
    return {
        **case.header(),
        "recovery": recovery,
        "gap": {
            "start_tick": gap_start,
            "ticks": GAP_TICKS,
            "buffer_steps": BUFFER_STEPS,
            "missed_batches": router.missed_batches,
        },
        "after": {**fleet.served.figures(router.after_ids), **router.after.figures()},
        "before": router.before.figures(),
        "consumer_recoveries_at_end": router.recoveries(),
    }


def worker_handler(argv: list[str]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    # Dynamo's tree logs each rejection; the count is what is reported.
    os.environ["DYN_LOG"] = "error"
    # The publishers of the gap runs bind 127.0.0.1 only.
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"

    def handle(command: dict[str, Any]) -> dict[str, Any]:
        job = command["job"]
        cpu = time.process_time()
        if job["kind"] == "fleet":
            result = run_fleet(Case.of(job), job["routing"])
        else:
            result = run_gap(Case.of(job), job["recovery"])
        # CPU seconds, not wall: the matrix's cost on dedicated cores.
        return {**result, "cpu_s": time.process_time() - cpu}

    return handle


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """The matrix one run measures."""

    requests: int
    fleets: tuple[int, ...]
    seeds: tuple[int, ...]
    workloads: tuple[str, ...]
    gap_workloads: tuple[str, ...]
    gap_engines: int


FULL = Plan(400, FLEETS, SEEDS, WORKLOADS, GAP_WORKLOADS, 8)
QUICK = Plan(200, (8,), (0,), ("chat-0.75",), ("chat-0.75",), 8)


def jobs(
    plan: Plan, tree: str, policies: Sequence[str | None]
) -> Iterator[dict[str, Any]]:
    for policy in policies:
        base = {"tree": tree, "policy": policy, "requests": plan.requests}
        for name in plan.workloads:
            for n in plan.fleets:
                for seed in plan.seeds:
                    for index, routing in ROUTERS:
                        yield {
                            **base,
                            "kind": "fleet",
                            "workload": name,
                            "engines": n,
                            "seed": seed,
                            "index": index,
                            "routing": routing,
                        }
        recoveries = UPSTREAM_RECOVERY if policy is None else ("snapshot",)
        for name in plan.gap_workloads:
            for seed in plan.seeds:
                for recovery in recoveries:
                    for index in (
                        ("set", "counting") if policy is None else ("consumer",)
                    ):
                        yield {
                            **base,
                            "kind": "gap",
                            "workload": name,
                            "engines": plan.gap_engines,
                            "seed": seed,
                            "index": index,
                            "recovery": recovery,
                        }


def run_matrix(
    python: str,
    trees: dict[str, Path],
    plan: Plan,
    workers_per_tree: dict[str, int],
    log: Any = sys.stderr,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every job of ``plan`` on worker processes (one tree each); results in
    job order, and each tree's provenance."""
    script = Path(__file__).resolve()
    started: dict[str, list[bl.Worker]] = {}
    infos: dict[str, Any] = {}
    try:
        for tree, n in workers_per_tree.items():
            ws, info = bl.start_workers(
                python, script, {f"{tree}{k}": trees[tree] for k in range(n)}, []
            )
            started[tree] = list(ws.values())
            infos[tree] = next(iter(info.values()))
        todo: list[dict[str, Any]] = []
        for tree in trees:
            todo += jobs(plan, tree, list(infos[tree]["policies"]))
        queues = {t: queue.Queue[int]() for t in trees}
        for k, job in enumerate(todo):
            queues[job["tree"]].put(k)
        results: list[dict[str, Any] | None] = [None] * len(todo)
        errors: list[BaseException] = []

        def serve(tree: str, worker: bl.Worker) -> None:
            while not errors:
                try:
                    k = queues[tree].get_nowait()
                except queue.Empty:
                    return
                try:
                    results[k] = {**todo[k], **worker.call({"job": todo[k]})}
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    errors.append(e)
                    return
                done = sum(r is not None for r in results)
                if done % 50 == 0:
                    print(f"[fleet_sim] {done}/{len(todo)}", file=log, flush=True)

        threads = [
            threading.Thread(target=serve, args=(t, w))
            for t, ws in started.items()
            for w in ws
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
    finally:
        for pool in started.values():
            for w in pool:
                w.close()
    return [r for r in results if r is not None], infos


def stream_of(r: dict[str, Any]) -> str:
    return bl.policy_label(r["policy"])


def aggregate(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and min - max over seeds, per configuration."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in results:
        if r["kind"] == "fleet":
            key = (
                "fleet",
                r["workload"],
                r["engines"],
                stream_of(r),
                r["index"],
                r["routing"],
            )
        else:
            key = (
                "gap",
                r["workload"],
                r["engines"],
                stream_of(r),
                r["index"],
                r["recovery"],
            )
        groups.setdefault(key, []).append(r)
    fleet, gap = [], []
    for key, rs in groups.items():
        row: dict[str, Any] = dict(
            zip(
                ("kind", "workload", "engines", "stream", "index", "routing"),
                key,
                strict=True,
            )
        )
        row["seeds"] = len(rs)
        if key[0] == "fleet":
            for m in (
                "hit_ratio",
                "tokens_computed",
                "ttft_steps_mean",
                "ttft_steps_p90",
                "wire_bytes_per_request",
                "events_per_request",
            ):
                row[m] = bl.spread([r[m] for r in rs])
            own = key[4] if key[4] != "round-robin" else None
            if own is not None:
                for m in ("exact", "agree_with_oracle", "over", "under"):
                    row[m] = bl.spread([r["scores"][own][m] for r in rs])
                if own != "oracle":
                    row["tree_rejections"] = bl.spread(
                        [r["tree_rejections"][own] for r in rs]
                    )
            fleet.append(row)
        else:
            row["recovery"] = row.pop("routing")
            for m in (
                "hit_ratio",
                "tokens_computed",
                "exact",
                "agree_with_oracle",
                "ttft_steps_mean",
            ):
                row[m] = bl.spread([r["after"][m] for r in rs])
            row["exact_before_gap"] = bl.spread([r["before"]["exact"] for r in rs])
            row["snapshots"] = sum(
                r["consumer_recoveries_at_end"].get("snapshot", 0) for r in rs
            )
            missed = [n for r in rs for n in r["gap"]["missed_batches"]]
            row["missed_batches"] = {"min": min(missed), "max": max(missed)}
            gap.append(row)
    return {"fleet": fleet, "gap": gap, "vs_upstream": paired(results)}


def paired(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each policy of ours against the upstream stream, seed by seed (the
    same workload window, fleet and router): hit-ratio points and tokens
    computed, medians and min - max over seeds."""
    by: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in results:
        if r["kind"] == "fleet":
            key = (r["workload"], r["engines"], r["index"], r["routing"], r["seed"])
            by.setdefault(key, {})[stream_of(r)] = r
    rows: dict[tuple[Any, ...], dict[str, list[float]]] = {}
    for key, streams in by.items():
        up = streams.get(bl.UPSTREAM)
        for stream, r in streams.items():
            if up is None or stream == bl.UPSTREAM:
                continue
            row = rows.setdefault((*key[:4], stream), {"points": [], "computed": []})
            row["points"].append(100 * (r["hit_ratio"] - up["hit_ratio"]))
            row["computed"].append(r["tokens_computed"] / up["tokens_computed"] - 1)
    return [
        {
            **dict(
                zip(
                    ("workload", "engines", "index", "routing", "stream"),
                    key,
                    strict=True,
                )
            ),
            "hit_points": bl.spread(v["points"]),
            "tokens_computed_change": bl.spread(v["computed"]),
        }
        for key, v in rows.items()
    ]


# The CI smoke configuration (tests/test_fleet_sim.py): one run per tree.
SMOKE_JOB: dict[str, Any] = {
    "kind": "fleet",
    "workload": "chat-0.75",
    "engines": 8,
    "seed": 0,
    "requests": 200,
    "index": "set",
    "routing": "longest",
}


def dynamo_python(python: str, cache: Path) -> Path:
    """The workers' Python: ``python``'s venv with Dynamo's runtime layered
    over it."""
    logdir = cache / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    return bench_fleet.fleet_env(
        None, Path(python), cache, logdir / "fleet-sim-env.log"
    )


def smoke(python: str, trees: dict[str, Path], cache: Path) -> dict[str, Any]:
    """``SMOKE_JOB`` on each tree (ours with ``copy_semantics`` ``logical``,
    chosen by what the tree offers, not by its name)."""
    workers, infos = bl.start_workers(
        str(dynamo_python(python, cache)), Path(__file__).resolve(), trees, []
    )
    try:
        return {
            name: w.call(
                {
                    "job": {
                        **SMOKE_JOB,
                        "policy": OURS if infos[name]["has_copy_semantics"] else None,
                    }
                }
            )
            for name, w in workers.items()
        }
    finally:
        for w in workers.values():
            w.close()


def drive(
    python: str,
    patched: Path,
    unpatched: Path,
    quick: bool,
    jobs_n: int,
    cache: Path,
    log: Any = sys.stderr,
) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    dpython = dynamo_python(python, cache)
    trees = {"patched": patched, "unpatched": unpatched}
    # The patched tree runs three policies, the unpatched one stream.
    per_tree = {"patched": max(jobs_n - 1, 1), "unpatched": 1}
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M")
    t0 = time.time()
    load0 = os.getloadavg()[0]
    results, infos = run_matrix(str(dpython), trees, plan, per_tree, log)
    wall = time.time() - t0
    workloads = {
        name: workload_stats(
            workload(name, plan.seeds[0], plan.requests, plan.fleets[0])
        )
        for name in plan.workloads
    }
    return {
        "bench": "fleet_sim",
        "quick": quick,
        # The workers' CPU seconds over the cores: the wall time on
        # dedicated cores, whatever else the machine ran meanwhile.
        "cpu_s": sum(r["cpu_s"] for r in results),
        "started": started,
        "wall_s": wall,
        "workers": per_tree,
        "cpus": os.cpu_count(),
        "load_average_start": load0,
        "load_average_end": os.getloadavg()[0],
        "dynamo": DYNAMO,
        "provenance": {
            t: {
                k: v
                for k, v in i.items()
                if k in ("vllm_version", "python", "has_copy_semantics")
            }
            for t, i in infos.items()
        },
        "plan": {
            "requests": plan.requests,
            "fleets": list(plan.fleets),
            "seeds": list(plan.seeds),
            "workloads": list(plan.workloads),
            "gap_workloads": list(plan.gap_workloads),
            "gap_engines": plan.gap_engines,
            "kv_blocks_per_engine": KV_BLOCKS,
            "block_size": BS,
            "max_num_seqs": MAX_SEQS,
            "load_per_engine_per_tick": LOAD,
            "buffer_steps": BUFFER_STEPS,
            "gap_ticks": GAP_TICKS,
            "max_prompt_blocks": MAX_PROMPT_BLOCKS,
            "max_num_batched_tokens": MAX_BATCHED,
        },
        "workload_stats": workloads,
        **aggregate(results),
        "runs": results,
    }


ROW_LISTS = ("fleet", "gap", "vs_upstream", "runs")


def dump(report: dict[str, Any]) -> str:
    """The report as JSON, one line per table row and per run (a rerun's diff
    is one line per changed run)."""
    head = {k: v for k, v in report.items() if k not in ROW_LISTS}
    text = json.dumps(head, indent=1).removesuffix("\n}")
    for key in ROW_LISTS:
        rows = ",\n".join(f"  {json.dumps(r)}" for r in report[key])
        text += f',\n "{key}": [\n{rows}\n ]'
    return text + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    def drive_main(args: list[str]) -> int:
        ap = bl.driver_parser(__doc__)
        ap.add_argument("--out", type=Path, required=True)
        ap.add_argument("--quick", action="store_true")
        ap.add_argument(
            "--jobs",
            type=int,
            default=3,
            help="worker processes in all (one for the unpatched tree)",
        )
        ap.add_argument("--cache", type=Path, default=ROOT / ".cache")
        a = ap.parse_args(args)
        report = drive(
            a.python, a.patched_tree, a.unpatched_tree, a.quick, a.jobs, a.cache
        )
        a.out.mkdir(parents=True, exist_ok=True)
        tmp = a.out / f".{REPORT}.tmp"
        tmp.write_text(dump(report))
        tmp.replace(a.out / REPORT)
        print(
            f"{a.out / REPORT}: {len(report['runs'])} runs in {report['wall_s']:.0f} s",
            file=sys.stderr,
        )
        return 0

    return bl.cli_main(argv, worker_handler, drive_main)


if __name__ == "__main__":
    sys.exit(main())
