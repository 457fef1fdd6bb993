# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The snapshot record of a ZmqEventPublisher, kept in a process of its own.

The record holds what a consumer of one publisher's stream holds, so that
the publisher can send a state snapshot to a consumer that cannot replay.
Applying every batch to it costs more than publishing the batch does, so it
runs outside the engine's process: the publisher spawns a record process,
hands it every batch it publishes (the encoded payload, a chunk of batches
copied into a shared-memory ring, a chunk of batches announced per message
over an IPC channel), forwards snapshot requests to it on the same channel,
so that a snapshot holds exactly the batches sent before it was asked,
relays its answers, and takes the status of the record from its reports.

This file imports only the standard library, msgspec and pyzmq: the record
process runs it by path, without importing vLLM (and torch). It decodes the
stream with structs built from the description of the engine's own schema
that the publisher passes it (`schema_spec`), so the two cannot differ.
"""

import contextlib
import json
import logging
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from array import array
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

# Under vLLM's logger in the publisher's process; the record process
# itself logs nothing (it reports to the publisher).
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecordSchema:
    """The stream's struct classes that the record reads and writes."""

    batch: type[msgspec.Struct]
    stored: type[msgspec.Struct]
    removed: type[msgspec.Struct]
    cleared: type[msgspec.Struct]


_CLASSES = ("batch", "stored", "removed", "cleared")


def schema_spec(schema: RecordSchema) -> dict[str, Any]:
    """What it takes to rebuild ``schema``'s wire format without its module:
    per class, its fields in order with their defaults, and its encoding."""
    spec: dict[str, Any] = {}
    for role in _CLASSES:
        cls = getattr(schema, role)
        config = cls.__struct_config__
        fields = []
        for info in msgspec.structs.fields(cls):
            if info.encode_name != info.name or info.default_factory not in (
                msgspec.NODEFAULT,
                None,
            ):
                raise ValueError(
                    f"{cls.__name__}.{info.name}: a renamed field or a default "
                    "factory cannot be described to the record process"
                )
            required = info.default is msgspec.NODEFAULT
            fields.append([info.name, required, None if required else info.default])
        spec[role] = {
            "name": cls.__name__,
            "tag": config.tag,
            "tag_field": config.tag_field,
            "array_like": config.array_like,
            "omit_defaults": config.omit_defaults,
            "fields": fields,
        }
    return spec


def schema_from_spec(spec: dict[str, Any]) -> RecordSchema:
    """Struct classes that decode and encode what ``spec``'s classes do, byte
    for byte; every field is typed ``Any`` but the batch's events."""
    built: dict[str, type[msgspec.Struct]] = {}
    for role in ("stored", "removed", "cleared", "batch"):
        entry = spec[role]
        fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
        for name, required, default in entry["fields"]:
            kind: Any = Any
            if role == "batch" and name == "events":
                events = built["stored"] | built["removed"] | built["cleared"]
                kind = list[events]  # type: ignore[valid-type]
            fields.append((name, kind) if required else (name, kind, default))
        built[role] = msgspec.defstruct(
            entry["name"],
            fields,
            tag=entry["tag"],
            tag_field=entry["tag_field"],
            array_like=entry["array_like"],
            omit_defaults=entry["omit_defaults"],
            gc=False,
        )
    return RecordSchema(**built)


# A held key's tier: (medium, group_idx), as BlockStored and BlockRemoved name it.
_Tier = tuple[str | None, int | None]
# A block hash as the stream carries it (vLLM's ExternalBlockHash).
_Hash = bytes | int
# A held key's own fields, all a snapshot re-announces it with. Most keys
# are (blob, shared): the blob packs its parent's hash (8 bytes after a 1,
# or a lone 0 where it has none) and its block's tokens (4 bytes each);
# shared is the tuple of its store's shared fields, one tuple for every
# store in a row with the same ones. A key whose parent hash or tokens do
# not fit, or whose store had extra keys or lookahead tokens, is (tokens,
# parent, shared, extra keys, lookahead tokens). A key never keeps another
# key's tokens, so the record's memory is bounded by its held keys, whatever
# the stores were.
_Entry = tuple[Any, ...]

# The per-block fields of BlockStored (one entry per block hash), besides
# block_hashes and parent_block_hash; any field not named here is shared by
# every block of a store. A schema without one of them (vLLM 0.32.0 has no
# lookahead tokens) simply has none.
_PER_BLOCK = ("token_ids", "extra_keys", "lookahead_token_ids")
# In a long _Entry: the store's field was None (not: its entry for this
# block was None).
_ABSENT: Any = object()
_NO_PARENT, _PARENT = b"\x00", b"\x01"


def _entry(tokens: list[int], parent: Any, shared: tuple, extra: Any, ahead: Any):
    """A held key's _Entry (see there)."""
    if extra is _ABSENT and ahead is _ABSENT:
        try:
            packed = array("I", tokens).tobytes()
            if parent is None:
                return (_NO_PARENT + packed, shared)
            if type(parent) is int:
                return (_PARENT + parent.to_bytes(8, "little") + packed, shared)
        except OverflowError:  # a negative or a 64-bit token id or hash
            pass
    return (tuple(tokens), parent, shared, extra, ahead)


def _parent(entry: _Entry) -> Any:
    if len(entry) > 2:
        return entry[1]
    blob = entry[0]
    return int.from_bytes(blob[1:9], "little") if blob[0] else None


def _tokens(entry: _Entry) -> list[int]:
    if len(entry) > 2:
        return list(entry[0])
    blob = entry[0]
    return array("I", blob[9 if blob[0] else 1 :]).tolist()


def _shared(entry: _Entry) -> tuple:
    return entry[1] if len(entry) == 2 else entry[2]


def _num_tokens(entry: _Entry) -> int:
    if len(entry) > 2:
        return len(entry[0])
    blob = entry[0]
    return (len(blob) - (9 if blob[0] else 1)) // 4


class KVEventRecord:
    """What a consumer of one publisher's stream holds, kept compact.

    Applied to every batch of the stream, in order, it keeps the keys the
    stream has stored and not yet removed, per (medium, group), each with
    its own fields only (an _Entry: its block's tokens, its parent, the
    store's shared fields, and its extra keys and lookahead tokens where
    the store had them). Keys are counted as a consumer of ``copy_semantics``
    counts them: present or not under "logical" and "last_copy", once per
    stored copy under "physical". A removal of a key the record does not
    hold changes nothing, as in a consumer, and so does an event of any
    other type. Locality and ownership are metadata, not part of the key:
    the CPU offload tier stores with ``locality="LOCAL"`` and removes with
    none.
    """

    def __init__(self, copy_semantics: str, schema: RecordSchema) -> None:
        self._schema = schema
        self._counting = copy_semantics == "physical"
        self._held: dict[_Tier, dict[_Hash, _Entry]] = {}
        # "physical" only: per tier, the copies of a key beyond its first.
        self._extra: dict[_Tier, dict[_Hash, int]] = {}
        names = [f.name for f in msgspec.structs.fields(schema.stored)]
        self._shared_names = tuple(
            n
            for n in names
            if n not in ("block_hashes", "parent_block_hash", *_PER_BLOCK)
        )
        self._has_lookahead = "lookahead_token_ids" in names
        self._block_size_at = self._shared_names.index("block_size")
        # The last store's shared fields: the stores that follow it with the
        # same ones share its tuple (no table of every value ever seen).
        self._last_shared: tuple[Any, ...] = ()

    def apply(self, events: list[Any]) -> None:
        # One type check per event, the tier's dict looked up again only when
        # the tier changes, then one dict operation per key.
        held_by_tier, counting = self._held, self._counting
        stored_type, removed_type = self._schema.stored, self._schema.removed
        cleared_type = self._schema.cleared
        held: dict[_Hash, _Entry] | None = None
        extra: dict[_Hash, int] = {}
        medium: str | None = None
        group: int | None = None
        for event in events:
            kind = type(event)
            if kind is removed_type or kind is stored_type:
                if held is None or event.medium != medium or event.group_idx != group:
                    medium, group = event.medium, event.group_idx
                    held = held_by_tier.get((medium, group))
                    if held is None:
                        held = held_by_tier[(medium, group)] = {}
                    if counting:
                        extra = self._extra.setdefault((medium, group), {})
                hashes = event.block_hashes
                if kind is stored_type:
                    self._store(event, held, extra if counting else None)
                elif counting:
                    self._count_removed(hashes, held, extra)
                elif len(hashes) == 1:  # an eviction: one event per block
                    held.pop(hashes[0], None)
                else:
                    for block_hash in hashes:
                        held.pop(block_hash, None)
            elif kind is cleared_type:
                held_by_tier.clear()
                self._extra.clear()
                held = None

    def _store(
        self,
        event: Any,
        held: dict[_Hash, _Entry],
        extra: dict[_Hash, int] | None,
    ) -> None:
        """Apply a BlockStored to one tier: each key not held yet gets its
        own entry; under "physical" (``extra`` given) a held one counts one
        more copy."""
        hashes = event.block_hashes
        new = [h for h in hashes if h not in held]
        if extra is not None:
            for block_hash in hashes:
                if block_hash in held:
                    extra[block_hash] = extra.get(block_hash, 0) + 1
        if not new:
            return
        shared = tuple(getattr(event, name) for name in self._shared_names)
        if shared == self._last_shared:
            shared = self._last_shared
        else:
            self._last_shared = shared
        extra_keys = event.extra_keys
        lookahead = event.lookahead_token_ids if self._has_lookahead else None
        token_ids, size = event.token_ids, event.block_size
        parent = event.parent_block_hash
        one = len(hashes) == 1
        for i, block_hash in enumerate(hashes):
            if block_hash not in held:
                held[block_hash] = _entry(
                    token_ids if one else token_ids[i * size : (i + 1) * size],
                    parent,
                    shared,
                    _ABSENT if extra_keys is None else extra_keys[i],
                    _ABSENT if lookahead is None else lookahead[i],
                )
            parent = block_hash

    @staticmethod
    def _count_removed(
        hashes: list[_Hash], held: dict[_Hash, _Entry], extra: dict[_Hash, int]
    ) -> None:
        """Apply a BlockRemoved of ``hashes`` to one tier under "physical"."""
        for block_hash in hashes:
            copies = extra.get(block_hash, 0)
            if copies > 1:
                extra[block_hash] = copies - 1
            elif copies == 1:
                del extra[block_hash]
            else:
                held.pop(block_hash, None)

    @property
    def num_keys(self) -> int:
        return sum(map(len, self._held.values()))

    @property
    def num_copies(self) -> int:
        return self.num_keys + sum(sum(e.values()) for e in self._extra.values())

    def snapshot(self, keys_per_batch: int) -> Iterator[list[Any]]:
        """The events that take a consumer from any state to this record's.

        The record is copied now (the only work done at once); the returned
        iterator then yields batches of about ``keys_per_batch`` keys: an
        AllBlocksCleared first, then every held key's BlockStored (several
        keys per event where their shared fields agree and their blocks are
        full), a parent before its child when both are held, and under
        "physical" one more single-key store per further copy.
        """
        held = {tier: keys.copy() for tier, keys in self._held.items()}
        extra = {tier: copies.copy() for tier, copies in self._extra.items()}
        return self._batches(held, extra, keys_per_batch)

    def _batches(
        self,
        held: dict[_Tier, dict[_Hash, _Entry]],
        extra: dict[_Tier, dict[_Hash, int]],
        keys_per_batch: int,
    ) -> Iterator[list[Any]]:
        batch: list[Any] = [self._schema.cleared()]
        room = keys_per_batch
        for tier, entries in held.items():
            copies_of = extra.get(tier, {})
            sent: set[_Hash] = set()
            for block_hash in entries:
                # Walk up to the oldest held ancestor not sent yet; marking
                # on the way also ends the walk on a (corrupt) cycle.
                chain: list[_Hash] = []
                while block_hash in entries and block_hash not in sent:
                    sent.add(block_hash)
                    chain.append(block_hash)
                    block_hash = _parent(entries[block_hash])
                chain.reverse()
                start = 0
                while start < len(chain):
                    end = start + 1
                    while (
                        end < len(chain)
                        and end - start < room
                        and self._joins(entries[chain[end - 1]], entries[chain[end]])
                    ):
                        end += 1
                    run = chain[start:end]
                    batch.append(self._stored(run, entries))
                    for h in run:
                        copies = copies_of.get(h, 0)
                        batch.extend(self._stored([h], entries) for _ in range(copies))
                        room -= copies
                    room -= end - start
                    start = end
                    if room <= 0:
                        yield batch
                        batch, room = [], keys_per_batch
        if batch:
            yield batch

    def _joins(self, parent: _Entry, child: _Entry) -> bool:
        """Whether one BlockStored can carry both keys with all their fields:
        the same shared fields and optional fields, and a full parent block
        (a consumer splits the run's tokens by block size)."""
        shared, child_shared = _shared(parent), _shared(child)
        if len(parent) != len(child) or not (
            child_shared is shared or child_shared == shared
        ):
            return False
        if _num_tokens(parent) != shared[self._block_size_at]:
            return False
        return len(parent) == 2 or (
            (parent[3] is _ABSENT) == (child[3] is _ABSENT)
            and (parent[4] is _ABSENT) == (child[4] is _ABSENT)
        )

    def _stored(self, run: list[_Hash], entries: dict[_Hash, _Entry]) -> Any:
        """One BlockStored for a parent-to-child run of held keys."""
        first = entries[run[0]]
        fields = dict(zip(self._shared_names, _shared(first), strict=True))
        token_ids: list[int] = []
        for h in run:
            token_ids.extend(_tokens(entries[h]))
        if len(first) > 2:
            if first[3] is not _ABSENT:
                fields["extra_keys"] = [entries[h][3] for h in run]
            if first[4] is not _ABSENT:
                fields["lookahead_token_ids"] = [entries[h][4] for h in run]
        return self._schema.stored(
            block_hashes=list(run),
            parent_block_hash=_parent(first),
            token_ids=token_ids,
            **fields,
        )


class Announcements(KVEventRecord):
    """The announcement of each key a block pool holds, for a record that
    must be rebuilt (its process died, fell behind or passed its cap).

    The pool feeds it the BlockStored events it publishes (a key's first
    one is kept) and names the keys whose last copy left; ``base`` then
    gives what a new record starts from. Fed by the engine's thread, read
    there too: ``base`` copies what it holds before it returns.
    """

    def __init__(self, schema: RecordSchema) -> None:
        super().__init__("logical", schema)

    def forget(self, medium: str | None, group: int | None, block_hash: _Hash) -> None:
        """The key ``block_hash`` of one tier left the pool."""
        held = self._held.get((medium, group))
        if held is not None:
            held.pop(block_hash, None)

    def clear(self) -> None:
        self._held.clear()

    def base(
        self, extra_copies: dict[_Tier, dict[_Hash, int]], keys_per_batch: int
    ) -> Iterator[list[Any]]:
        """The events that take an empty record to the pool's state, as
        ``snapshot`` gives them, with ``extra_copies`` more single-key
        stores per key (under "physical", a key's copies beyond its first).
        """
        held = {tier: keys.copy() for tier, keys in self._held.items()}
        return self._batches(held, extra_copies, keys_per_batch)


# The channel between a publisher and its record process, a PAIR socket the
# record process binds; the first frame of each message names it.
# Publisher to record: ("batches", msgpack [written, seq, item, seq, item,
# ...]) with every batch it sent, in order, where an item is the payload's
# size in the ring (the next one there) or, for one too large for it, the
# payload, and written is the ring's byte count after them; ("snapshot",
# request id) starts a snapshot, which the record sends SNAPSHOT_WINDOW
# batches ahead: ("more", request id) after each batch the publisher has
# passed on, ("cancel", request id) when its client is gone.
# Record to publisher: ("consumed", 8-byte byte count of the ring read and
# decoded) after each "batches"; ("report", msgpack {"held_keys",
# "next_seq"}) when they change and at least every HEARTBEAT_S; for each
# snapshot, ("batch", request id, resume seq, payload) ... ("end", request
# id, msgpack reply); and ("off", reason) before it exits. A request id is
# 8 bytes, the publisher's own count, never a client's word.
BATCHES, SNAPSHOT, MORE, CANCEL = b"batches", b"snapshot", b"more", b"cancel"
CONSUMED, REPORT, BATCH, END, OFF = b"consumed", b"report", b"batch", b"end", b"off"
# Snapshot batches the record process sends ahead of the publisher: what
# waits in the engine's process for one slow client.
SNAPSHOT_WINDOW = 4
# The record process reports at least this often, so the publisher tells a
# stalled record from an idle one.
HEARTBEAT_S = 0.5

_RUN_BY_PATH = "import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name='__main__')"
# The IPC directory of a record process: the publisher's pid after it, so
# a later publisher removes one whose publisher died (see _sweep).
_DIR_PREFIX = "vllm-kv-record-"


class RecordBehind(Exception):
    """The record process has not read the ring far enough back for the
    next batch to fit."""


def _ring_file() -> int:
    """A file descriptor for the ring, in memory where the OS allows it."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("vllm-kv-record-ring")
    with tempfile.TemporaryFile() as f:  # unlinked at once
        return os.dup(f.fileno())


def _ring_slot(count: int, size: int) -> tuple[int, int]:
    """Where in a ring of ``RING_BYTES`` the next ``size`` bytes go, after
    ``count`` bytes: (their offset, the count after them). One that would
    cross the ring's end starts again at 0, its tail left unused; both
    sides take the same slots."""
    at = count % RecordProcess.RING_BYTES
    if at + size > RecordProcess.RING_BYTES:
        count += RecordProcess.RING_BYTES - at
        at = 0
    return at, count + size


def _sweep() -> None:
    """Remove the IPC directories of record processes whose publisher is
    gone: one killed together with its record process (a container stop, a
    process-group kill) before the channel's file was removed."""
    temp = tempfile.gettempdir()
    for name in os.listdir(temp):
        pid = name.removeprefix(_DIR_PREFIX).split("-")[0]
        if name.startswith(_DIR_PREFIX) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(temp, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


class RecordProcess:
    """The publisher's side of its record process: the child process, the
    ring that the publisher copies every batch it publishes into, and the
    channel over which it announces them and forwards snapshot requests.
    The publisher calls ``put`` with each batch, ``send_batches`` once
    ``send_at`` has passed, and ``receive`` for what the record process
    sends."""

    # Batches announced to the record process in one message, and about the
    # longest they wait for it: the publisher's cost per batch is a copy
    # into the ring and two list appends, and a share of one small message
    # (ci/bench/bench_snapshot.py of vllm-overlay). A ring rather than the
    # payloads in the message: a message of payloads cost the engine's
    # process about four times as much, in copies and in the ZMQ I/O
    # thread's writes to a reader that lags.
    CHUNK = 256
    CHUNK_WAIT_S = 0.01
    # Shared memory, written before the engine starts serving (its pages
    # are touched once, not on the publish path). A record process that
    # falls this far behind is stopped: about 15,000 batches of 4 KiB.
    RING_BYTES = 64 << 20
    # A payload larger than this goes in the message instead.
    INLINE_ABOVE = RING_BYTES // 16
    # Messages the channel holds for a record process that falls behind:
    # bounds what the ring does not (the large payloads).
    CHANNEL_HWM = 4096

    def __init__(
        self,
        ctx: zmq.Context,
        schema: RecordSchema,
        *,
        copy_semantics: str,
        max_keys: int,
        keys_per_batch: int,
        data_parallel_rank: int,
    ) -> None:
        _sweep()
        # The channel's file lives only until the record process has
        # answered (see receive): a connected IPC socket needs no path.
        self._dir: str | None = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
        endpoint = f"ipc://{self._dir}/channel"
        config = {
            "schema": schema_spec(schema),
            "copy_semantics": copy_semantics,
            "max_keys": max_keys,
            "keys_per_batch": keys_per_batch,
            "data_parallel_rank": data_parallel_rank,
            "channel": endpoint,
            "parent": os.getpid(),
        }
        # Connecting (the record process binds) queues what is sent before
        # the record process is up: it gets every batch from the first.
        self.channel = ctx.socket(zmq.PAIR)
        self.channel.setsockopt(zmq.SNDHWM, self.CHANNEL_HWM)
        self.channel.connect(endpoint)
        ring_fd = _ring_file()
        try:
            os.ftruncate(ring_fd, self.RING_BYTES)
            self._map = mmap.mmap(ring_fd, self.RING_BYTES)
            config["ring_fd"] = ring_fd
            # Run by path with runpy: importing it as vllm.distributed.*
            # would import vLLM and torch first.
            self.process = subprocess.Popen(
                [sys.executable, "-c", _RUN_BY_PATH, __file__, json.dumps(config)],
                stdin=subprocess.DEVNULL,
                pass_fds=(ring_fd,),
            )
        finally:
            os.close(ring_fd)
        self._ring = memoryview(self._map)
        zeros = bytes(1 << 20)
        for at in range(0, self.RING_BYTES, len(zeros)):
            self._ring[at : at + len(zeros)] = zeros
        # Bytes of the ring written, and read by the record process.
        self._written = 0
        self._consumed = 0
        self.pending: list[int | bytes] = [0]
        self.send_at = 0.0
        # When the record process last sent anything; until its first
        # message, when it started (Python's start-up on a loaded host can
        # take a while: see silent_s).
        self.started_at = time.monotonic()
        self.heard_at: float | None = None
        # What the record process sent while the publisher read its
        # consumed counts, for ``receive``.
        self._inbox = deque[list[bytes]]()

    # The longest a record process may take to start before it counts as
    # silent.
    START_GRACE_S = 30.0

    def silent_s(self) -> float:
        """How long the record process has said nothing (0 while it may
        still be starting)."""
        now = time.monotonic()
        if self.heard_at is None:
            return max(0.0, now - self.started_at - self.START_GRACE_S)
        return now - self.heard_at

    def put(self, seq: int, payload: bytes, inline: bool = False) -> None:
        """Hand the record process the batch ``seq``, announced with
        ``CHUNK - 1`` more; ``inline``: in the message, not the ring (a
        rebuild's base, sent before the process reads anything). Raises
        RecordBehind if it has not read the ring far enough, zmq.Again if
        the channel is full, zmq.ZMQError if it fails."""
        size = len(payload)
        if inline or size > self.INLINE_ABOVE:
            self.pending += (seq, payload)
        else:
            at, written = _ring_slot(self._written, size)
            if written - self._consumed > self.RING_BYTES:
                self._read_consumed()
                if written - self._consumed > self.RING_BYTES:
                    raise RecordBehind(
                        f"the record process fell more than {self.RING_BYTES} "
                        "bytes of batches behind"
                    )
            self._ring[at : at + size] = payload
            self._written = written
            self.pending += (seq, size)
        if len(self.pending) > 2 * self.CHUNK:
            self.send_batches()

    def send_batches(self) -> None:
        """Announce the batches put since the last call, if any, in one
        message. Raises zmq.Again if the channel is full, zmq.ZMQError if
        it fails."""
        self.send_at = time.monotonic() + self.CHUNK_WAIT_S
        if len(self.pending) > 1:
            self.pending[0] = self._written
            message = msgspec.msgpack.encode(self.pending)
            self.channel.send_multipart((BATCHES, message), zmq.NOBLOCK)
            del self.pending[1:]

    def send(self, kind: bytes, request_id: int) -> None:
        """Send "snapshot", "more" or "cancel" for ``request_id``, after the
        batches put so far. Raises as ``send_batches`` does."""
        self.send_batches()
        self.channel.send_multipart((kind, request_id.to_bytes(8, "big")), zmq.NOBLOCK)

    def receive(self) -> list[bytes] | None:
        """The next message from the record process, if one is waiting
        (its consumed counts are read here)."""
        return self._inbox.popleft() if self._inbox else self._next_message()

    def _read_consumed(self) -> None:
        """Read every message waiting: the consumed counts move the ring's
        free space, the rest waits for ``receive``."""
        while (message := self._next_message()) is not None:
            self._inbox.append(message)

    def _next_message(self) -> list[bytes] | None:
        """The channel's next message but a consumed count (which it
        applies), if one is waiting."""
        while True:
            try:
                message = self.channel.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
            self.heard_at = time.monotonic()
            if self._dir is not None:
                # Connected both ways: nothing needs the channel's file now,
                # and nothing is left behind if both processes die.
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None
            if message[0] != CONSUMED:
                return message
            self._consumed = int.from_bytes(message[1], "big")

    def close(self, timeout_s: float) -> None:
        """Stop the record process, waiting up to ``timeout_s`` for it to
        exit (0: not at all; subprocess reaps it later), and free the
        channel and the ring. It is killed: it holds nothing to save, a
        large record would take seconds to free object by object, and a
        stopped or stuck one would never read a request to exit."""
        self.process.kill()
        self.channel.close(linger=0)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            if timeout_s:
                logger.warning(
                    "The KV event record process did not exit within %.1f s "
                    "of SIGKILL (pid %d)",
                    timeout_s,
                    self.process.pid,
                )
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._ring.release()
        self._map.close()


@dataclass
class _Snapshot:
    """A snapshot being sent, a batch at a time between other work, at most
    ``credit`` batches ahead of the publisher."""

    request_id: bytes
    resume_seq: int
    keys: int
    batches: Iterator[list[Any]]
    credit: int = SNAPSHOT_WINDOW
    sent: int = 0


class _Off(Exception):
    """The record stops: the reason goes to the publisher's status."""


class _Orphaned(Exception):
    """The publisher died: nobody reads the channel any more."""


class _Recorder:
    """The record process: applies the batches the publisher sends on the
    channel, answers snapshot requests there, and reports its size."""

    REPORT_INTERVAL_S = 0.05
    # A publisher that stops reading the channel for this long is gone.
    SEND_TIMEOUT_S = 10.0

    def __init__(self, config: dict[str, Any]) -> None:
        self._schema = schema_from_spec(config["schema"])
        self._record = KVEventRecord(config["copy_semantics"], self._schema)
        self._copy_semantics = config["copy_semantics"]
        self._max_keys: int = config["max_keys"]
        self._keys_per_batch: int = config["keys_per_batch"]
        self._dp_rank = config["data_parallel_rank"]
        self._parent = config["parent"]
        self._decoder = msgspec.msgpack.Decoder(self._schema.batch)
        self._encoder = msgspec.msgpack.Encoder()
        self._channel = zmq.Context().socket(zmq.PAIR)
        self._channel.bind(config["channel"])
        self._dir = os.path.dirname(config["channel"].removeprefix("ipc://"))
        ring = mmap.mmap(config["ring_fd"], 0, access=mmap.ACCESS_READ)
        os.close(config["ring_fd"])
        self._ring = memoryview(ring)
        self._consumed = 0
        self._next_seq = 0
        self._reported = -1
        self._last_report = 0.0
        self._snapshots: dict[bytes, _Snapshot] = {}

    def run(self) -> None:
        try:
            # At once: the publisher then removes the channel's file.
            self._report()
            while os.getppid() == self._parent:
                ready = any(s.credit for s in self._snapshots.values())
                wait_s = 0 if ready else self.REPORT_INTERVAL_S
                if self._channel.poll(int(wait_s * 1000)):
                    self._on_message(self._channel.recv_multipart())
                self._send_snapshot_batches()
                self._report()
        except _Off as off:
            # The publisher refuses the snapshots it forwarded and this
            # process did not end; exiting frees the record.
            with contextlib.suppress(_Off, _Orphaned):
                self._send((OFF, str(off).encode()))
            self._channel.close(linger=1000)
        except _Orphaned:
            pass
        if os.getppid() != self._parent:
            # The publisher died before it heard from this process, so the
            # channel's file is still there; nobody else will remove it.
            shutil.rmtree(self._dir, ignore_errors=True)

    def _on_message(self, message: list[bytes]) -> None:
        kind = message[0]
        if kind == BATCHES:
            self._apply(msgspec.msgpack.decode(message[1]))
            self._send((CONSUMED, self._consumed.to_bytes(8, "big")))
        elif kind == SNAPSHOT:
            self._start_snapshot(message[1])
        elif kind == MORE:
            if (snapshot := self._snapshots.get(message[1])) is not None:
                snapshot.credit += 1
        elif kind == CANCEL:
            self._snapshots.pop(message[1], None)
        else:
            raise _Off(f"the record process got {kind[:32]!r}")

    def _apply(self, batches: list[Any]) -> None:
        """Apply ``[written, seq, item, seq, item, ...]`` (the channel's
        "batches")."""
        for i in range(1, len(batches), 2):
            seq, item = batches[i], batches[i + 1]
            if isinstance(item, int):
                at, self._consumed = _ring_slot(self._consumed, item)
                item = self._ring[at : at + item]
            try:
                self._record.apply(self._decoder.decode(item).events)
            except Exception as e:
                raise _Off(f"the snapshot record failed at seq {seq}: {e!r}") from e
            if self._record.num_keys > self._max_keys:
                # Exiting frees the record: its memory stays bounded by the
                # cap. Before any report: no status shows a record past it.
                raise _Off(
                    f"the record passed kv_events_config.snapshot_max_keys="
                    f"{self._max_keys} held keys at seq {seq}"
                )
            self._next_seq = seq + 1
            if not (i >> 1) & 31:
                # A long chunk on a starved core still reports: silence is
                # what tells the publisher that this process stalled.
                self._report()
        if self._consumed != batches[0]:
            raise _Off(
                f"the ring is out of step: read to byte {self._consumed}, "
                f"written to {batches[0]}"
            )

    def _start_snapshot(self, request_id: bytes) -> None:
        """Start answering a snapshot request with the record as it is now,
        once it has applied every batch the publisher sent before it
        forwarded the request (the channel keeps their order)."""
        record = self._record
        self._snapshots[request_id] = _Snapshot(
            request_id,
            self._next_seq,
            record.num_keys,
            record.snapshot(self._keys_per_batch),
        )

    def _send_snapshot_batches(self) -> None:
        """Send the next batch of each snapshot under way that has credit,
        or its end: every client sees its snapshot start at once, whatever
        else is under way."""
        for snapshot in list(self._snapshots.values()):
            if not snapshot.credit:
                continue
            events = next(snapshot.batches, None)
            if events is None:
                reply = {
                    "status": "ok",
                    "resume_seq": snapshot.resume_seq,
                    "keys": snapshot.keys,
                    "batches": snapshot.sent,
                    "copy_semantics": self._copy_semantics,
                }
                del self._snapshots[snapshot.request_id]
                self._send((END, snapshot.request_id, msgspec.msgpack.encode(reply)))
                continue
            batch = self._schema.batch(
                ts=time.time(), events=events, data_parallel_rank=self._dp_rank
            )
            self._send(
                (
                    BATCH,
                    snapshot.request_id,
                    snapshot.resume_seq.to_bytes(8, "big"),
                    self._encoder.encode(batch),
                )
            )
            snapshot.sent += 1
            snapshot.credit -= 1

    def _send(self, frames: tuple[bytes, ...]) -> None:
        """Send to the publisher, waiting while it lives (it reads the
        channel between batches) for up to SEND_TIMEOUT_S. A send that
        blocked instead would outlast a publisher that died."""
        deadline = time.monotonic() + self.SEND_TIMEOUT_S
        while not self._channel.poll(100, zmq.POLLOUT):
            if os.getppid() != self._parent:
                raise _Orphaned
            if time.monotonic() > deadline:
                raise _Off("the publisher stopped reading the record's channel")
        self._channel.send_multipart(frames, zmq.NOBLOCK)

    def _report(self) -> None:
        """Tell the publisher the record's size, at most every
        ``REPORT_INTERVAL_S`` when it has changed, and every HEARTBEAT_S."""
        now = time.monotonic()
        since = now - self._last_report
        if since < self.REPORT_INTERVAL_S or (
            self._next_seq == self._reported and since < HEARTBEAT_S
        ):
            return
        report = {"held_keys": self._record.num_keys, "next_seq": self._next_seq}
        self._send((REPORT, msgspec.msgpack.encode(report)))
        self._reported, self._last_report = self._next_seq, now


if __name__ == "__main__":
    # The publisher stops this process; an interrupt is the engine's.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Below the engine's processes: under load the record falls behind (by
    # up to RecordProcess.RING_BYTES) rather than take their CPU, and
    # catches up when they idle.
    os.nice(10)
    _Recorder(json.loads(sys.argv[1])).run()
