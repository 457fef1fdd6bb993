"""The seed's KV-event scenario: what the CPU test and the GPU script share.

``tests/test_seed_scenario_zmq.py`` drives vLLM's real ``Scheduler`` with
made-up model outputs; ``server_scenario`` drives a real API server (on the
CPU in ``tests/test_cpu_server.py``, on a GPU in
``ci/gpu/seed_scenario_gpu.py``).  All run the same scenario (8 KV blocks,
prefix caching on: three identical two-block requests, then twelve unique
ones; block size 16 in-process, 32 on a server, since CPU attention needs a
multiple of 32), listen with the same ZMQ subscriber decoding the stock
schema (``vllm.distributed.kv_events.KVEventBatch``), count the events that
name the *target* (the hash of the repeated prompt's 2nd block) and print
the same report.

Only used where vLLM is installed; zmq, msgspec and vLLM are imported inside
the functions that need them, so importing this module is cheap.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Self

BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 8
PROMPT_LEN = 32
NUM_REPEATS = 3
NUM_UNIQUE = 12

POLICY_FIELD = "copy_semantics"
EXPECTED: dict[str, tuple[int, int, int, int]] = {
    # stored before, removed before, removed after, decode errors
    "logical": (1, 0, 1, 0),
    "last_copy": (3, 0, 1, 0),
    # 0006 puts a freed surplus copy of the target at the front of the free
    # queue, so the third repeat evicts it before the pressure phase; the key
    # stays resident, and only "physical" announces each copy's removal.
    "physical": (3, 1, 2, 0),
}
DEFAULT_POLICY = "logical"
# A build without the copy_semantics field (upstream 0.33.0).
EXPECTED_UNPATCHED: tuple[int, int, int, int] = (3, 0, 3, 0)

REPEATED_PROMPT = [1000 + i for i in range(PROMPT_LEN)]
# The tokens of the target block: the repeated prompt's 2nd block.
TARGET_TOKENS = REPEATED_PROMPT[BLOCK_SIZE : 2 * BLOCK_SIZE]


def unique_prompt(i: int) -> list[int]:
    return [2000 + 100 * i + j for j in range(PROMPT_LEN)]


def kv_events_fields(endpoint: str, policy: str | None) -> dict[str, Any]:
    """``KVEventsConfig`` fields; ``policy=None`` leaves ``copy_semantics`` out."""
    fields: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
    }
    if policy is not None:
        fields[POLICY_FIELD] = policy
    return fields


@dataclasses.dataclass(frozen=True)
class Report:
    policy: str
    target_blockstored_before_pressure: int
    target_blockremoved_before_pressure: int
    target_blockremoved_after_pressure: int
    subscriber_decode_errors: int
    # diagnostics (not part of the seed's figures)
    target_blockstored_after_pressure: int
    batches: int
    events: int
    seq_gaps: int

    @classmethod
    def from_stream(
        cls,
        policy: str,
        before: list[Any],
        after: list[Any],
        target: Any,
        sub: Subscriber,
        **extra: Any,
    ) -> Self:
        """The figures of the batches before and after the pressure phase."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        return cls(
            policy=policy,
            target_blockstored_before_pressure=count_target(
                before, target, BlockStored
            ),
            target_blockremoved_before_pressure=count_target(
                before, target, BlockRemoved
            ),
            target_blockremoved_after_pressure=count_target(
                after, target, BlockRemoved
            ),
            subscriber_decode_errors=sub.decode_errors,
            target_blockstored_after_pressure=count_target(after, target, BlockStored),
            batches=len(before) + len(after),
            events=sum(len(b.events) for b in before + after),
            seq_gaps=sub.seq_gaps(),
            **extra,
        )

    def figures(self) -> tuple[int, int, int, int]:
        return (
            self.target_blockstored_before_pressure,
            self.target_blockremoved_before_pressure,
            self.target_blockremoved_after_pressure,
            self.subscriber_decode_errors,
        )

    def line(self) -> str:
        return " ".join(
            f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
        )


class Subscriber:
    """A real ZMQ SUB socket decoding the stock schema.

    By default it binds a free port on 127.0.0.1 chosen by the OS and the
    publisher connects to ``endpoint`` (vLLM 0.33.0 connects for an endpoint
    with a concrete host); with ``connect`` it connects to a bound publisher.
    Malformed messages are counted in ``decode_errors``, every message's
    sequence number is kept in ``seqs``.
    """

    def __init__(self, connect: str | None = None) -> None:
        """``connect``: subscribe to a publisher bound there instead."""
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        if connect is not None:
            self.sock.connect(connect)
            self.endpoint = connect
        else:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._decode_error = msgspec.DecodeError
        self.decode_errors = 0
        self.seqs: list[int] = []

    def _take(self) -> Any | None:
        """Receive one message: its batch, or None (a decode error, counted)."""
        frames = self.sock.recv_multipart()
        if len(frames) != 3:
            self.decode_errors += 1
            return None
        _topic, seq, payload = frames
        self.seqs.append(int.from_bytes(seq, "big"))
        try:
            return self._decoder.decode(payload)
        except self._decode_error:
            self.decode_errors += 1
            return None

    def recv(self, timeout_s: float) -> Any | None:
        """One decoded batch, or None on timeout (decode errors are counted)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.sock.poll(left_ms):
                return None
            batch = self._take()
            if batch is not None:
                return batch

    def recv_until_marker(self, ts: float, timeout_s: float) -> list[Any]:
        """The batches before the empty marker batch ``ts`` (a negative ts)."""
        got: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while True:
            batch = self.recv(max(0.0, deadline - time.monotonic()))
            if batch is None:
                raise AssertionError(
                    f"no marker batch ts={ts} within {timeout_s} s "
                    f"({len(got)} batches received)"
                )
            if not batch.events and batch.ts < 0:
                if batch.ts == ts:
                    return got
                continue  # a leftover handshake probe
            got.append(batch)

    def drain(self, quiet_s: float, max_s: float) -> list[Any]:
        """Receive until nothing arrived for ``quiet_s`` (at most ``max_s``)."""
        got: list[Any] = []
        deadline = time.monotonic() + max_s
        while time.monotonic() < deadline:
            if not self.sock.poll(int(quiet_s * 1000)):
                break
            batch = self._take()
            if batch is not None:
                got.append(batch)
        return got

    def seq_gaps(self) -> int:
        return sum(1 for a, b in itertools.pairwise(self.seqs) if b != a + 1)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def block_tokens(ev: Any, i: int, block_size: int = BLOCK_SIZE) -> list[int]:
    """The token ids of the ``i``-th block of a ``BlockStored`` event."""
    tokens: list[int] = ev.token_ids[i * block_size : (i + 1) * block_size]
    return tokens


def find_target(
    batches: list[Any],
    block_size: int = BLOCK_SIZE,
    target_tokens: list[int] = TARGET_TOKENS,
) -> Any | None:
    """The hash of the block holding ``target_tokens`` (by default the
    repeated prompt's 2nd block), as the stream names it."""
    from vllm.distributed.kv_events import BlockStored

    for b in batches:
        for ev in b.events:
            if not isinstance(ev, BlockStored):
                continue
            for i, h in enumerate(ev.block_hashes):
                if block_tokens(ev, i, block_size) == target_tokens:
                    return h
    return None


def count_target(batches: list[Any], target: Any, kind: type[Any]) -> int:
    """How many times events of type ``kind`` name ``target``."""
    return sum(
        ev.block_hashes.count(target)
        for b in batches
        for ev in b.events
        if isinstance(ev, kind)
    )
