"""A router's view of one engine's prefix cache, built from its KV events.

What a deployed KV-aware router keeps per engine: a *set* mirror (store
adds a key, removal discards it: AIBrix, simple routers) and a *counting*
mirror (one count per stored copy, the key leaves at 0: Dynamo's and
llm-d's filters). Both live in one reference consumer ``Mirror``
(``overlay/vllm/distributed/kv_events_consumer.py``, the one the overlay
tests and the benchmarks use too), loaded from this checkout by path, so
that a run against any wheel, the official one included, judges the stream
with one piece of code. The ``Mirror`` keeps a token index (a router sees
token ids, not block hashes: each ``BlockStored`` names its blocks' tokens
and its parent's hash) of the keys either mirror holds, and matches for
each by name (``match_views``).

``predict`` gives what each mirror expects the engine to serve from its
cache for a prompt: the longest run of leading full blocks the mirror
holds (``Mirror.match``), capped as vLLM caps a hit (the prompt's last
token is always computed), in tokens.

Used only where vLLM is installed (the serving venv).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

MIRRORS = (
    Path(__file__).resolve().parents[2]
    / "overlay"
    / "vllm"
    / "distributed"
    / "kv_events_consumer.py"
)


@functools.cache
def checkout_consumer() -> Any:
    """The reference consumer module of this checkout, whatever the wheel
    (loaded once per process)."""
    spec = importlib.util.spec_from_file_location("kv_events_consumer", MIRRORS)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the router mirrors from {MIRRORS}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RouterView:
    """The set and counting mirrors of one engine's stream, their prefix
    matches, and the stream's defects as a consumer sees them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # Each router style, by the name of the consumer's mirror it keeps.
        self.styles = {"set": "set", "counting": "count"}
        self.mirror = checkout_consumer().Mirror(match_views=self.styles.values())
        self.set = self.mirror.set
        self.counting = self.mirror.count
        # Every block hash stored under a parent the stream had stored.
        self._placed: set[Any] = set()
        self.repeat_stores = 0
        self.orphan_stores = 0
        self.stored = 0
        self.removed = 0
        self.cleared = 0

    def apply(self, batch: Any) -> None:
        from vllm.distributed.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
        )

        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.parent_block_hash is None or ev.parent_block_hash in self._placed:
                    self._placed.update(ev.block_hashes)
                else:
                    # Its tokens cannot be placed: the stream never stored
                    # its parent, so no prompt can be routed to these blocks.
                    self.orphan_stores += 1
                for h in ev.block_hashes:
                    # A store of a key the engine already announced: a
                    # second copy, or a stream that lost its removal.
                    self.repeat_stores += (ev.medium, ev.group_idx, h) in self.counting
                self.stored += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.removed += len(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.cleared += 1
            self.mirror.apply(ev)

    def predict(self, prompt: list[int]) -> dict[str, int]:
        """Tokens of ``prompt`` each mirror expects served from the cache."""
        cap = (len(prompt) - 1) // self.block_size
        out = {}
        for style, view in self.styles.items():
            blocks = max(self.mirror.match(prompt, view).values(), default=0)
            out[style] = min(blocks, cap) * self.block_size
        return out

    def mirrors_agree(self) -> bool:
        return bool(self.set.keys == set(self.counting.counts))

    def figures(self) -> dict[str, int]:
        return {
            "removals_of_unknown_keys": len(self.set.unknown_removals),
            "counts_below_zero": len(self.counting.unknown_removals),
            "repeat_stores": self.repeat_stores,
            "stores_of_unknown_parents": self.orphan_stores,
            "blocks_stored": self.stored,
            "blocks_removed": self.removed,
            "all_blocks_cleared": self.cleared,
        }
