# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The snapshot protocol's edges on the real ZmqEventPublisher, over ZMQ on
127.0.0.1: malformed requests get an error and the live stream goes on; the
cap and the off switch refuse with a reason; an engine restart is told from
a gap by its epoch; the snapshot sends a parent before its child whatever
order they were stored in, with the metadata they were announced with."""

import contextlib
import gc
import json
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from typing import Any

import msgspec
import psutil
import pytest
import zmq

from vllm.config.kv_events import KV_EVENTS_COPY_SEMANTICS
from vllm.distributed import (
    kv_events_answers,
    kv_events_consumer,
    kv_events_record,
)
from vllm.distributed.kv_events import (
    RECORD_SCHEMA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.distributed.kv_events_consumer import Follower, block_fields
from vllm.distributed.kv_events_record import KVEventRecord

pytestmark = pytest.mark.cpu_test


def stored(hashes, parent=None, **fields) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=[h * 10 + i for h in hashes for i in range(4)],
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
        **fields,
    )


def publisher(replay: str = "tcp://*:0", **kwargs) -> ZmqEventPublisher:
    return ZmqEventPublisher(0, endpoint="tcp://*:0", replay_endpoint=replay, **kwargs)


def ask(pub: ZmqEventPublisher, *frames: bytes) -> list[list[bytes]]:
    """Send raw frames to the replay socket; every message up to the end."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(pub.get_publisher_config().replay_endpoint)
    try:
        dealer.send_multipart(frames)
        messages = []
        while True:
            assert dealer.poll(5000), f"no answer to {frames}"
            message = dealer.recv_multipart()
            messages.append(message)
            if message[-2] == ZmqEventPublisher.END_SEQ:
                return messages
    finally:
        dealer.close(linger=0)


def end_info(messages: list[list[bytes]]) -> dict:
    return msgspec.msgpack.decode(messages[-1][-1])


def recorded_status(pub: ZmqEventPublisher, seq: int) -> dict:
    """The status once the publisher has sent ``seq`` batches and its record
    (a process of its own, reporting every 50 ms) has applied them or is off."""
    deadline = time.monotonic() + 10
    while True:
        status = end_info(ask(pub, b"", msgspec.msgpack.encode({"op": "status"})))
        record_seq = status["snapshot"]["next_seq"]
        if status["next_seq"] >= seq and (record_seq is None or record_seq >= seq):
            return status
        assert time.monotonic() < deadline, f"the record did not reach seq {seq}"
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def _loopback(monkeypatch):
    # tcp://*:0 binds VLLM_HOST_IP on a free port.
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")


def test_malformed_requests_get_an_error_and_live_goes_on():
    pub = publisher()
    follower = Follower(*_endpoints(pub))
    try:
        follower.sync()
        pack = msgspec.msgpack.encode
        for frames in [
            (b"", b""),
            (b"", b"\xc1\xc1"),  # not msgpack
            (b"", pack([1, 2])),
            (b"", pack({"op": "dump"})),
            (b"", pack({"op": "replay", "start_seq": -1, "epoch": 0})),
            (b"", pack({"op": "replay", "start_seq": 99, "epoch": 0})),
            (pack({"op": "status"}),),  # no empty delimiter frame
            (b"x", pack({"op": "status"})),  # a first frame that is not empty
            (b"", pack({"op": "replay", "start_seq": 0, "epoch": "1"})),
            (b"", pack({"op": "replay", "start_seq": 0, "epoch": -1})),
        ]:
            info = end_info(ask(pub, *frames))
            assert info["status"] == "error" and info["reason"], frames
        pub.publish(KVEventBatch(ts=0.0, events=[stored([1, 2])]))
        follower.sync(min_next_seq=1)
        assert follower.mirror.held_keys() == {("GPU", 0, 1), ("GPU", 0, 2)}
        assert not follower.stats.anomalies
        # A boolean is no sequence number, though Python counts True as 1.
        epoch = end_info(ask(pub, b"", pack({"op": "status"})))["epoch"]
        request = pack({"op": "replay", "start_seq": True, "epoch": epoch})
        info = end_info(ask(pub, b"", request))
        assert info["status"] == "error" and "start_seq" in info["reason"]
    finally:
        follower.close()
        pub.shutdown()


def _endpoints(pub: ZmqEventPublisher) -> tuple[str, str]:
    config = pub.get_publisher_config()
    assert config.replay_endpoint is not None
    return config.endpoint, config.replay_endpoint


@pytest.mark.parametrize("max_keys", [0, 2])
def test_snapshot_refused_when_off_or_above_the_cap(max_keys):
    """Off, or past the cap, the record is gone (its memory with it): status
    says so with the reason, and a snapshot is refused."""
    pub = publisher(snapshot_max_keys=max_keys)
    try:
        pub.publish(KVEventBatch(ts=0.0, events=[stored([1, 2, 3])]))
        status = recorded_status(pub, 1)
        assert status["snapshot"]["enabled"] is False
        assert status["snapshot"]["held_keys"] is None
        assert status["snapshot"]["next_seq"] is None
        assert "snapshot_max_keys" in status["snapshot"]["reason"]
        messages = ask(pub, b"", msgspec.msgpack.encode({"op": "snapshot"}))
        assert len(messages) == 1, "a refused snapshot sends no batch"
        info = end_info(messages)
        assert info["status"] == "refused"
        assert info["reason"] == status["snapshot"]["reason"]
        # The live stream and replay are untouched.
        replay = ask(pub, b"", (0).to_bytes(8, "big"))
        assert [int.from_bytes(m[2], "big") for m in replay[:-1]] == [0]
    finally:
        pub.shutdown()


def test_the_record_at_the_cap_still_serves_snapshots():
    pub = publisher(snapshot_max_keys=3)
    try:
        pub.publish(KVEventBatch(ts=0.0, events=[stored([1, 2, 3])]))
        status = recorded_status(pub, 1)
        assert status["snapshot"]["enabled"] is True
        assert status["snapshot"]["held_keys"] == 3
        info = end_info(ask(pub, b"", msgspec.msgpack.encode({"op": "snapshot"})))
        assert info["status"] == "ok"
    finally:
        pub.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bind_known_ports(**kwargs: Any) -> tuple[ZmqEventPublisher, list[int]]:
    """A publisher on two ports the test knows, so that a restart can bind
    them again. Both are probed while held, so they differ; one that another
    process takes before the publisher binds it is traded for fresh ones."""
    for _ in range(20):
        with socket.socket() as live, socket.socket() as replay:
            live.bind(("127.0.0.1", 0))
            replay.bind(("127.0.0.1", 0))
            ports = [live.getsockname()[1], replay.getsockname()[1]]
        try:
            return ZmqEventPublisher(
                0,
                endpoint=f"tcp://*:{ports[0]}",
                replay_endpoint=f"tcp://*:{ports[1]}",
                **kwargs,
            ), ports
        except zmq.ZMQError:
            continue
    raise AssertionError("no two free ports in 20 tries")


def _rebind(endpoints: list[str], **kwargs: Any) -> ZmqEventPublisher:
    """A new publisher on the ports the last one just closed (ZMQ releases
    them in the background)."""
    for _ in range(50):
        try:
            return ZmqEventPublisher(
                0, endpoint=endpoints[0], replay_endpoint=endpoints[1], **kwargs
            )
        except zmq.ZMQError:
            time.sleep(0.1)
    raise AssertionError(f"{endpoints} stayed in use")


def test_an_engine_restart_is_told_from_a_gap():
    # A restarted engine binds the same ports; its seq counts from 0 again.
    first, ports = _bind_known_ports()
    endpoints = [f"tcp://*:{p}" for p in ports]
    follower = Follower(*[f"tcp://127.0.0.1:{p}" for p in ports])
    try:
        follower.sync()
        for h in (1, 2, 3):
            first.publish(KVEventBatch(ts=0.0, events=[stored([h])]))
        follower.sync(min_next_seq=3)
        old_epoch = follower.epoch
        first.shutdown()
        second = _rebind(endpoints)
        try:
            for h in (7, 8, 9, 10):
                second.publish(KVEventBatch(ts=0.0, events=[stored([h])]))
            second.publish(
                KVEventBatch(
                    ts=0.0,
                    events=[BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0)],
                )
            )
            # seqs 0-2 exist in both lifetimes: only the epoch tells them apart.
            follower.sync(min_next_seq=5)
            assert follower.epoch != old_epoch
            assert any(a.startswith("restart") for a in follower.stats.anomalies)
            assert follower.mirror.held_keys() == {
                ("GPU", 0, 8),
                ("GPU", 0, 9),
                ("GPU", 0, 10),
            }
        finally:
            second.shutdown()
    finally:
        follower.close()


def test_a_request_lost_with_its_connection_is_sent_again():
    # What a restart on the same ports can do to a request in flight: the
    # publisher never answers it. The follower asks again on a fresh socket.
    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    follower = Follower(
        f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{port}", timeout_s=0.5
    )
    status = msgspec.msgpack.encode({"op": "status"})
    received = []

    def answer_the_second_request() -> None:
        for _ in range(2):
            assert router.poll(5000)
            received.append(router.recv_multipart())
        identity = received[-1][0]
        end = msgspec.msgpack.encode({})
        router.send_multipart([identity, b"", b"", ZmqEventPublisher.END_SEQ, end])

    helper = threading.Thread(target=answer_the_second_request)
    helper.start()
    try:
        reply = follower.request(status)
        assert reply.end == {} and reply.batches == []
        # the same request twice, from two sockets (identities)
        assert [frames[1:] for frames in received] == [[b"", status]] * 2
        assert received[0][0] != received[1][0]
    finally:
        helper.join()
        follower.close()
        router.close(linger=0)


@pytest.mark.parametrize("policy", KV_EVENTS_COPY_SEMANTICS)
def test_snapshot_sends_parents_first_with_the_announced_metadata(policy):
    record = KVEventRecord(policy, RECORD_SCHEMA)
    child = stored([5, 6], parent=4, locality="LOCAL", session_id="s")
    parent = stored([3, 4], parent=None, extra_keys=[("salt",), None])
    # The child is held while its parent leaves, then the parent comes back:
    # held in child-first order.
    record.apply(
        [
            stored([3, 4]),
            child,
            BlockRemoved(block_hashes=[3, 4], medium="GPU", group_idx=0),
        ]
    )
    record.apply([parent, stored([6])])
    events = [e for batch in record.snapshot(keys_per_batch=1) for e in batch]
    order = [h for e in events[1:] for h in e.block_hashes]
    copies = 2 if policy == "physical" else 1
    assert order[:4] == [3, 4, 5, 6] and order[4:] == [6] * (copies - 1)
    announced = {3: (parent, 0), 4: (parent, 1), 5: (child, 0), 6: (child, 1)}
    for event in events[1:]:
        for i, h in enumerate(event.block_hashes):
            assert block_fields(event, i) == block_fields(*announced[h])


@pytest.mark.parametrize("policy", KV_EVENTS_COPY_SEMANTICS)
def test_the_record_counts_and_snapshots_each_key_once(policy):
    keys = 20_000
    stores = [stored(range(h, h + 8)) for h in range(1, keys + 1, 8)]
    evictions = [
        BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0)
        for h in range(1, keys + 1, 2)
    ]
    record = KVEventRecord(policy, RECORD_SCHEMA)
    record.apply(stores)
    record.apply(evictions)
    record.apply(stores[: len(stores) // 2])
    # Odd keys evicted, then the first half stored again: back are its odd
    # keys, and under "physical" a second copy of its even ones.
    want = set(range(2, keys + 1, 2)) | set(range(1, keys // 2, 2))
    copies = keys // 4 if policy == "physical" else 0
    assert record.num_keys == len(want) and record.num_copies == len(want) + copies
    events = [e for batch in record.snapshot(keys_per_batch=1024) for e in batch]
    held = [h for e in events[1:] for h in e.block_hashes]
    assert len(held) == len(want) + copies and set(held) == want


def _store_of(blocks: int, rng: random.Random) -> BlockStored:
    """One cache_full_blocks call's store: 16-token blocks of real-sized
    token ids under 64-bit hashes, as an engine announces them."""
    hashes = [rng.getrandbits(64) for _ in range(blocks)]
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=rng.getrandbits(64),
        token_ids=[rng.randrange(1000, 150_000) for _ in range(16 * blocks)],
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
    )


# What the record may keep per held key of 16 tokens (issue 40's goal).
RECORD_BYTES_PER_KEY = 400


@pytest.mark.parametrize("policy", KV_EVENTS_COPY_SEMANTICS)
@pytest.mark.parametrize("pattern", ["plain", "head_survivors"])
def test_the_record_keeps_only_each_held_keys_own_fields(policy, pattern):
    """Everything the record holds, events included (traced from before
    they are made to after the test drops them), per held key: a key keeps
    its own block's tokens, never its store's. "head_survivors" is what LRU
    leaves of finished requests: each store's head block, the rest evicted."""
    rng = random.Random(0)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        record = KVEventRecord(policy, RECORD_SCHEMA)
        for _ in range(40 if pattern == "plain" else 400):
            store = _store_of(256 if pattern == "plain" else 64, rng)
            record.apply([store])
            if pattern == "head_survivors":
                removed = BlockRemoved(
                    block_hashes=store.block_hashes[1:], medium="GPU", group_idx=0
                )
                record.apply([removed])
            del store
        gc.collect()
        held_bytes = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert record.num_keys == (40 * 256 if pattern == "plain" else 400)
    assert held_bytes / record.num_keys <= RECORD_BYTES_PER_KEY


# A value of its own for each BlockStored field, per block where the field
# holds one entry per block (block 1 of two blocks of 4 tokens).
_FIELD_VALUES: dict[str, tuple[Any, Any]] = {
    # field: (the event's value, what block 1 carries)
    "block_hashes": ([101, 102], 101),  # block 1's parent is block 0
    "parent_block_hash": (100, None),
    "token_ids": (list(range(8)), (4, 5, 6, 7)),
    "block_size": (4, 4),
    "lora_id": (7, 7),
    "medium": ("M", "M"),
    "lora_name": ("L", "L"),
    "extra_keys": ([("e0",), ("e1",)], ("e1",)),
    "group_idx": (3, 3),
    "kv_cache_spec_kind": ("K", "K"),
    "kv_cache_spec_sliding_window": (9, 9),
    "locality": ("LOC", "LOC"),
    "ownership": ("OWN", "OWN"),
    "session_id": ("S", "S"),
    "lookahead_token_ids": ([[1, 2], [3, 4]], [3, 4]),
}


def test_block_fields_reads_every_field_by_the_schemas_name():
    """Every field of the engine's own BlockStored reaches ``block_fields``
    by its name in the schema: each set to a value of its own, block 1's
    tuple carries each (a misnamed ``getattr`` reads None, and a test that
    compares the helper with itself cannot see it)."""
    names = BlockStored.__struct_fields__
    unknown = set(names) - set(_FIELD_VALUES)
    assert not unknown, f"BlockStored has new fields {unknown}: add them here"
    event = BlockStored(**{n: _FIELD_VALUES[n][0] for n in names})
    fields = block_fields(event, 1)
    for name in names:
        if name != "parent_block_hash":  # block 1's parent is block 0's hash
            assert _FIELD_VALUES[name][1] in fields, (name, fields)


def test_cli_once_prints_the_state_and_the_prefix_match(capsys):
    pub = publisher()
    try:
        run = stored([11, 12])
        pub.publish(KVEventBatch(ts=0.0, events=[run]))
        while (
            end_info(ask(pub, b"", msgspec.msgpack.encode({"op": "status"})))[
                "next_seq"
            ]
            < 1
        ):
            time.sleep(0.01)
        endpoint, replay = _endpoints(pub)
        tokens = ",".join(map(str, run.token_ids + [1, 2]))
        rc = kv_events_consumer.main(
            ["--endpoint", endpoint, "--replay-endpoint", replay, "--once"]
            + ["--match", tokens]
        )
        state = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert rc == 0
        assert state["next_seq"] == 1 and state["recoveries"] == {"snapshot": 1}
        assert state["tiers"] == {
            "GPU/0": {"set_keys": 2, "count_keys": 2, "count_copies": 2}
        }
        assert state["match"] == {"GPU/0": 2}
    finally:
        pub.shutdown()


def test_cli_once_follows_a_publisher_with_snapshots_off():
    """Snapshots off, but the replay buffer holds the whole epoch (here: an
    empty one, and one of two batches): the CLI replays from 0."""
    pub = publisher(snapshot_max_keys=0)
    try:
        endpoint, replay = _endpoints(pub)
        args = ["--endpoint", endpoint, "--replay-endpoint", replay, "--once"]
        assert kv_events_consumer.main(args) == 0
        _stores(pub, (1, 2))
        recorded_status(pub, 2)
        assert kv_events_consumer.main(args) == 0
    finally:
        pub.shutdown()


class _CLI:
    """The reference CLI in a process of its own, its state lines read as
    they come."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vllm.distributed.kv_events_consumer"]
            + ["--endpoint", endpoint, "--replay-endpoint", replay]
            + ["--interval", "0.2", "--poll-interval", "0.2"],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.states: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                self.states.append(json.loads(line))

    def state_where(self, holds, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the CLI exited: {self.states[-1:]}"
            if self.states and holds(self.states[-1]):
                return self.states[-1]
            time.sleep(0.05)
        raise AssertionError(f"no such state in {timeout_s} s: {self.states[-1:]}")

    def stop(self) -> int:
        self.process.terminate()
        return self.process.wait(10)


def _set_keys(state: dict) -> int:
    return sum(row.get("set_keys", 0) for row in state["tiers"].values())


def test_the_cli_outlives_an_engine_restart_and_follows_the_new_engine():
    """The publisher goes away for longer than the CLI's requests wait
    (three tries of 5 s) and comes back on the same ports with a new
    epoch: the CLI marks its view stale at once, keeps running, and then
    follows the new publisher; SIGTERM ends it with status 0."""
    pub = publisher()
    endpoint, replay = _endpoints(pub)
    ports = [e.rsplit(":", 1)[1] for e in (endpoint, replay)]
    cli = _CLI(endpoint, replay)
    try:
        _stores(pub, (1, 2, 3))
        old = cli.state_where(lambda s: s["synced"] and _set_keys(s) == 3)
        pub.shutdown()
        down = time.monotonic()
        stale = cli.state_where(lambda s: s.get("stale_since") is not None, 10.0)
        assert not stale["synced"]
        time.sleep(max(0.0, 20.0 - (time.monotonic() - down)))
        pub = ZmqEventPublisher(
            0,
            endpoint=f"tcp://*:{ports[0]}",
            replay_endpoint=f"tcp://127.0.0.1:{ports[1]}",
        )
        _stores(pub, (7,))
        new = cli.state_where(
            lambda s: s["synced"] and s["epoch"] != old["epoch"] and _set_keys(s) == 1
        )
        assert new["stale_since"] is None
    finally:
        assert cli.stop() == 0
        pub.shutdown()


def test_poll_returns_within_its_timeout_under_sustained_load():
    """Batches published without a pause for 10 s: ``poll(0.1)`` returns
    long before they stop, and so does ``poll(0)``."""
    pub = publisher()
    follower = Follower(*_endpoints(pub))
    stop = threading.Event()

    def flood() -> None:
        # Each batch stores 8 keys and removes them: the record stays small.
        removed = BlockRemoved(
            block_hashes=list(range(1, 9)), medium="GPU", group_idx=0
        )
        batch = KVEventBatch(ts=0.0, events=[stored(range(1, 9)), removed])
        while not stop.is_set():
            try:
                pub.publish(batch)
            except queue.Full:  # as fast as the publisher sends
                time.sleep(0.001)

    flooder = threading.Thread(target=flood, daemon=True)
    try:
        follower.sync()
        started = time.monotonic()
        flooder.start()
        time.sleep(0.5)
        for timeout_s in (0.1, 0.0):
            before = time.monotonic()
            assert follower.poll(timeout_s) > 0
            assert time.monotonic() - before < 5.0, "poll() did not return"
        assert time.monotonic() - started < 8.0  # the flood still runs
    finally:
        stop.set()
        if flooder.is_alive():
            flooder.join()
        follower.close()
        # Its queue full, the publisher takes the end only once it drains.
        deadline = time.monotonic() + 30
        while True:
            try:
                pub.shutdown()
                break
            except queue.Full:
                assert time.monotonic() < deadline
                time.sleep(0.05)


def _stores(pub: ZmqEventPublisher, hashes) -> None:
    for h in hashes:
        pub.publish(KVEventBatch(ts=0.0, events=[stored([h])]))


def _follow(follower: Follower, until, timeout_s: float = 10.0) -> None:
    """Read the live stream only (no status poll, as under steady traffic)
    until ``until()`` holds."""
    deadline = time.monotonic() + timeout_s
    while not until() and time.monotonic() < deadline:
        follower.poll(0.05)


def test_a_restart_that_reaches_the_next_seq_is_not_applied_blindly():
    # The old engine sent seqs 0-2; the new one, on the same ports, sends
    # seqs 0-2 before the consumer's SUB socket reconnects, then seq 3, the
    # consumer's next seq, under steady traffic: only the epoch tells.
    first, ports = _bind_known_ports()
    endpoints = [f"tcp://*:{p}" for p in ports]
    follower = Follower(*[f"tcp://127.0.0.1:{p}" for p in ports])
    try:
        follower.sync()
        _stores(first, (1, 2, 3))
        follower.sync(min_next_seq=3)
        assert follower.next_seq == 3
        first.shutdown()
        second = _rebind(endpoints)
        try:
            _stores(second, (7, 8, 9))
            # Let the SUB socket reconnect and subscribe (ZMQ retries every
            # 100 ms), without reading anything.
            time.sleep(1.0)
            _stores(second, (10, 11, 12, 13))
            second.publish(
                KVEventBatch(
                    ts=0.0,
                    events=[BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0)],
                )
            )
            # Steady traffic goes on: a SUB socket that reconnects reports
            # itself connected before the publisher holds its subscription,
            # so batches published in between are lost to it, and only a
            # later batch's seq shows the gap (the consumer then replays).
            # Under load the subscription can take longer than the sleep
            # above: an empty batch every poll, as long as it takes.
            want = {("GPU", 0, h) for h in (8, 9, 10, 11, 12, 13)}
            deadline = time.monotonic() + 10
            while (follower.next_seq or 0) < 9 or follower.mirror.held_keys() != want:
                assert time.monotonic() < deadline, follower.mirror.held_keys()
                second.publish(KVEventBatch(ts=0.0, events=[]))
                follower.poll(0.05)
            assert any(a.startswith("restart") for a in follower.stats.anomalies)
        finally:
            second.shutdown()
    finally:
        follower.close()


class SmallSnapshotBatches(ZmqEventPublisher):
    """The real publisher, with snapshots of a few keys per batch."""

    SNAPSHOT_KEYS_PER_BATCH = 2


class LosesOneSnapshotBatch(Follower):
    """A consumer whose transport drops one data frame of its first
    snapshot answer (as a ROUTER at its send high-water mark does)."""

    lost = 0

    def _request_once(self, request: bytes):
        reply, dropped = super()._request_once(request)
        is_snapshot = msgspec.msgpack.decode(request) == {"op": "snapshot"}
        if is_snapshot and not self.lost:
            del reply.batches[1]
            self.lost += 1
        return reply, dropped


def test_a_snapshot_missing_a_batch_is_an_anomaly_and_asked_again():
    pub = SmallSnapshotBatches(0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    try:
        pub.publish(KVEventBatch(ts=0.0, events=[stored([1, 2, 3, 4, 5, 6])]))
        follower = LosesOneSnapshotBatch(*_endpoints(pub))
        try:
            follower.sync(min_next_seq=1)
            assert follower.lost == 1
            assert follower.mirror.held_keys() == {("GPU", 0, h) for h in range(1, 7)}
            anomalies = follower.stats.anomalies
            assert any(a.startswith("snapshot incomplete") for a in anomalies)
        finally:
            follower.close()
    finally:
        pub.shutdown()


def _every_field(hashes) -> BlockStored:
    """A store with every field the schema has set to a non-default value."""
    extra = {
        "extra_keys": [("lora", 7), None],
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 128,
        "locality": "LOCAL",
        "ownership": "tier-2",
        "session_id": "s",
        "lookahead_token_ids": [[1, 2], [3, 4]],
    }
    fields = BlockStored.__struct_fields__
    return stored(hashes, 3, **{k: v for k, v in extra.items() if k in fields})


def test_the_record_process_schema_is_the_engines_byte_for_byte():
    """The record process decodes and re-encodes the stream with structs
    rebuilt from the description the publisher passes it."""
    spec = kv_events_record.schema_spec(RECORD_SCHEMA)
    rebuilt = kv_events_record.schema_from_spec(spec)
    batch = KVEventBatch(
        ts=1.5,
        events=[
            _every_field([4, 5]),
            stored([6]),
            BlockRemoved(block_hashes=[b"\x01" * 32], medium="CPU", group_idx=1),
            AllBlocksCleared(),
        ],
        data_parallel_rank=2,
    )
    payload = msgspec.msgpack.encode(batch)
    decoded = msgspec.msgpack.Decoder(rebuilt.batch).decode(payload)
    assert msgspec.msgpack.encode(decoded) == payload
    # Snapshots built on either schema are the same bytes.
    snapshots = []
    for schema, events in ((RECORD_SCHEMA, batch.events), (rebuilt, decoded.events)):
        record = KVEventRecord("physical", schema)
        record.apply(events[:2] + events[:1])
        snapshots.append(
            [
                msgspec.msgpack.encode(schema.batch(ts=0.0, events=events))
                for events in record.snapshot(keys_per_batch=2)
            ]
        )
    assert snapshots[0] == snapshots[1] and len(snapshots[0]) == 3
    # The check can fail: a description that lost a field differs.
    spec["stored"]["fields"].pop()
    lossy = kv_events_record.schema_from_spec(spec)
    assert (
        msgspec.msgpack.encode(msgspec.msgpack.Decoder(lossy.batch).decode(payload))
        != payload
    )


def test_the_record_process_imports_neither_vllm_nor_torch():
    # What the record process runs (RecordProcess), without __main__.
    code = (
        "import runpy, sys; runpy.run_path(sys.argv[1]); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, kv_events_record.__file__],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "[]"


def _record_process() -> psutil.Process:
    """This test process's record process (a publisher's child)."""
    children = [
        p
        for p in psutil.Process().children()
        if kv_events_record.__file__ in p.cmdline()
    ]
    assert len(children) == 1, children
    return children[0]


def test_the_record_has_every_batch_sent_before_its_process_started():
    # Published at once, while the record process is still starting.
    pub = publisher()
    try:
        _stores(pub, range(1, 201))
        status = recorded_status(pub, 200)
        assert status["snapshot"]["held_keys"] == 200
        info = end_info(ask(pub, b"", msgspec.msgpack.encode({"op": "snapshot"})))
        assert info["status"] == "ok" and info["keys"] == 200
        assert info["resume_seq"] == 200
    finally:
        pub.shutdown()


def test_a_dead_record_process_turns_snapshots_off_and_the_stream_goes_on():
    pub = publisher()
    try:
        _stores(pub, (1, 2))
        recorded_status(pub, 2)
        child = _record_process()
        child.kill()
        child.wait(10)
        deadline = time.monotonic() + 10
        while recorded_status(pub, 2)["snapshot"]["enabled"]:
            assert time.monotonic() < deadline, "status still says enabled"
            time.sleep(0.05)
        reason = recorded_status(pub, 2)["snapshot"]["reason"]
        assert "record process exited" in reason
        info = end_info(ask(pub, b"", msgspec.msgpack.encode({"op": "snapshot"})))
        assert info == {**info, "status": "refused", "reason": reason}
        _stores(pub, (3,))
        replay = ask(pub, b"", (0).to_bytes(8, "big"))
        assert [int.from_bytes(m[2], "big") for m in replay[:-1]] == [0, 1, 2]
    finally:
        pub.shutdown()


def _one_block_store(block_hash: int, tokens: int) -> KVEventBatch:
    """A batch of one block of ``tokens`` tokens, 5 bytes each encoded."""
    return KVEventBatch(
        ts=0.0,
        events=[
            BlockStored(
                block_hashes=[block_hash],
                parent_block_hash=None,
                token_ids=list(range(1 << 20, (1 << 20) + tokens)),
                block_size=tokens,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
            )
        ],
    )


def test_a_record_process_that_falls_behind_is_stopped_and_the_stream_goes_on():
    """One that stops reading (stopped here, as a starved one is) is
    stopped once the publisher has written its ring's worth of batches past
    it: the ring bounds what waits for it. Live and replay go on."""
    pub = publisher()
    child = _record_process()
    try:
        _stores(pub, (1,))
        recorded_status(pub, 1)
        child.suspend()
        batch = _one_block_store(2, 200_000)
        size = len(msgspec.msgpack.encode(batch))
        behind = kv_events_record.RecordProcess.RING_BYTES // size + 2
        for _ in range(behind):
            pub.publish(batch)
        deadline = time.monotonic() + 30
        while (status := recorded_status(pub, 1))["snapshot"]["enabled"]:
            assert time.monotonic() < deadline, "status still says enabled"
            time.sleep(0.05)
        assert "fell more than" in status["snapshot"]["reason"]
        child.wait(10)
        _stores(pub, (3,))
        last = recorded_status(pub, behind + 2)["next_seq"] - 1
        replay = ask(pub, b"", last.to_bytes(8, "big"))
        assert [int.from_bytes(m[2], "big") for m in replay[:-1]] == [last]
    finally:
        if child.is_running():
            child.resume()
        pub.shutdown()


def test_a_batch_too_large_for_the_ring_still_reaches_the_record():
    """A batch over RecordProcess.INLINE_ABOVE bytes goes in the channel's
    message instead of the ring, in its place among the others."""
    pub = publisher()
    try:
        inline_above = kv_events_record.RecordProcess.INLINE_ABOVE
        big = _one_block_store(7, inline_above // 5 + 1)
        assert len(msgspec.msgpack.encode(big)) > inline_above
        for batch in (KVEventBatch(ts=0.0, events=[stored([1])]), big):
            pub.publish(batch)
        _stores(pub, (2,))
        assert recorded_status(pub, 3)["snapshot"]["held_keys"] == 3
        messages = ask(pub, b"", msgspec.msgpack.encode({"op": "snapshot"}))
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        events = [e for m in messages[:-1] for e in decoder.decode(m[3]).events]
        stores = {e.block_hashes[0]: e for e in events if isinstance(e, BlockStored)}
        assert stores.keys() == {1, 2, 7}
        assert stores[7] == big.events[0]
    finally:
        pub.shutdown()


# An engine in a process of its own, for the tests that kill it: prints its
# replay endpoint, then waits for its standard input to close.
_ENGINE = (
    "import os, sys\n"
    "os.environ['VLLM_HOST_IP'] = '127.0.0.1'\n"
    "from vllm.distributed.kv_events import ZmqEventPublisher\n"
    "pub = ZmqEventPublisher(0, endpoint='tcp://*:0', replay_endpoint='tcp://*:0')\n"
    "print(pub.get_publisher_config().replay_endpoint, flush=True)\n"
    "sys.stdin.read()\n"
    "os._exit(0)\n"
)


def _channel_dir(record_process: psutil.Process) -> str:
    """Where a record process's IPC channel was made (its command line)."""
    config = json.loads(record_process.cmdline()[-1])
    return os.path.dirname(config["channel"].removeprefix("ipc://"))


def _status_at(replay_endpoint: str) -> dict:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    try:
        dealer.send_multipart((b"", msgspec.msgpack.encode({"op": "status"})))
        assert dealer.poll(10_000), "no status from the engine"
        return msgspec.msgpack.decode(dealer.recv_multipart()[-1])
    finally:
        dealer.close(linger=0)


def _start_engine(**popen: Any) -> tuple[subprocess.Popen, psutil.Process]:
    """_ENGINE in a process of its own, once it answers a status request;
    with its record process."""
    engine = subprocess.Popen(
        [sys.executable, "-c", _ENGINE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        **popen,
    )
    assert engine.stdout is not None
    _status_at(engine.stdout.readline().strip())
    (child,) = psutil.Process(engine.pid).children()
    return engine, child


def test_a_record_process_outlives_no_dead_publisher():
    """A publisher killed without shutdown: its record process exits, and
    nothing of theirs is left in the temp directory."""
    engine, child = _start_engine()
    try:
        channel_dir = _channel_dir(child)
    finally:
        engine.communicate("", timeout=60)
    child.wait(10)
    assert not os.path.exists(channel_dir)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_nothing_is_left_when_the_engine_and_its_record_die_together(sig):
    """A container stop or a cgroup kill signals the whole process group:
    the publisher cannot clean up, and neither can its record process."""
    engine, child = _start_engine(start_new_session=True)
    try:
        channel_dir = _channel_dir(child)
        # Running: the record process has spoken (the publisher then removes
        # the channel's file). Before that, see the next test.
        deadline = time.monotonic() + 10
        while os.path.exists(channel_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(engine.pid, getattr(signal, sig))
        engine.wait(10)
        child.wait(10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.pid, signal.SIGKILL)
    assert not os.path.exists(channel_dir)


def test_the_next_start_sweeps_what_a_killed_engine_left():
    """Killed in the short start-up window, before the record answered, an
    engine leaves its IPC directory; the next publisher on the host removes
    it (its process is gone), and leaves a live one's alone."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tempfile.mkdtemp(prefix=f"vllm-kv-record-{gone.pid}-")
    alive = tempfile.mkdtemp(prefix=f"vllm-kv-record-{os.getpid()}-")
    try:
        pub = publisher()
        pub.shutdown()
        assert not os.path.exists(dead)
        assert os.path.exists(alive)
    finally:
        shutil.rmtree(alive, ignore_errors=True)
        shutil.rmtree(dead, ignore_errors=True)


def _request(replay_endpoint: str, request: dict, **options) -> zmq.Socket:
    """A client that has sent ``request`` and reads nothing yet."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    for option, value in options.items():
        dealer.setsockopt(getattr(zmq, option), value)
    dealer.connect(replay_endpoint)
    dealer.send_multipart((b"", msgspec.msgpack.encode(request)))
    return dealer


def _read_answer(dealer: zmq.Socket, timeout_s: float = 30.0) -> tuple[int, list]:
    """Read up to the end: (batches before it, every end it got, with what
    arrives in the second after the first)."""
    batches, ends = 0, []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not dealer.poll(1000 if ends else 5000):
            break
        message = dealer.recv_multipart()
        if message[-2] == ZmqEventPublisher.END_SEQ:
            ends.append(msgspec.msgpack.decode(message[-1]))
        else:
            batches += 1
    return batches, ends


def _many_keys(pub: ZmqEventPublisher, keys: int, first: int = 1) -> int:
    """Store ``keys`` keys of 16 large tokens each, 1,000 per batch; the
    number of batches published."""
    rng = random.Random(first)
    batches = 0
    for start in range(first, first + keys, 1000):
        hashes = range(start, min(start + 1000, first + keys))
        event = stored(hashes)
        event.token_ids = [rng.randrange(1000, 150_000) for _ in range(4 * len(hashes))]
        pub.publish(KVEventBatch(ts=0.0, events=[event]))
        batches += 1
    return batches


def test_every_snapshot_request_gets_one_end_to_its_own_client():
    """A large snapshot, then a small one that ends first, then the record
    dies with the large one under way: each client gets exactly one end,
    its own; the large one's says why it stopped."""
    pub = publisher()
    try:
        sent = _many_keys(pub, 300_000)
        recorded_status(pub, sent)
        replay = _endpoints(pub)[1]
        # Reads nothing until the record is gone (a small receive queue).
        large = _request(replay, {"op": "snapshot"}, RCVHWM=1, RCVBUF=4096)
        time.sleep(0.2)  # the record takes the large one first
        pub.publish(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
        _stores(pub, (1,))
        recorded_status(pub, sent + 2)
        small = _request(replay, {"op": "snapshot"})
        batches, ends = _read_answer(small)
        assert [e["status"] for e in ends] == ["ok"] and ends[0]["keys"] == 1
        _record_process().kill()
        # The publisher sees the death at its next check (every 0.2 s).
        time.sleep(1.0)
        late = _request(replay, {"op": "snapshot"})
        batches, ends = _read_answer(large)
        assert len(ends) == 1, ends
        assert ends[0]["status"] == "refused" and "exited" in ends[0]["reason"]
        assert 0 < batches < 300
        assert _read_answer(small, 2.0) == (0, [])
        assert [e["status"] for e in _read_answer(late)[1]] == ["refused"]
        for dealer in (large, small, late):
            dealer.close(linger=0)
    finally:
        pub.shutdown()


# The request cap that docs/snapshot-protocol.md states.
REQUEST_CAP = 1024


def test_a_request_over_the_cap_is_refused_at_the_socket():
    """Requests are under 100 bytes: a larger one than REQUEST_MAX_BYTES
    is refused by ZMQ itself (its client is disconnected unanswered), and
    never reaches the engine's memory or log; others go on."""
    pub = publisher()
    try:
        replay = _endpoints(pub)[1]
        big = bytes(REQUEST_CAP + 1)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart((b"", big))
        assert not dealer.poll(1000), "a request over the cap was answered"
        dealer.close(linger=0)
        _stores(pub, (1,))
        assert recorded_status(pub, 1)["snapshot"]["held_keys"] == 1
    finally:
        pub.shutdown()


def test_errors_and_logs_quote_little_of_a_request(caplog_vllm):
    pub = publisher()
    try:
        request = msgspec.msgpack.encode({"op": "x" * 900})
        assert len(request) < REQUEST_CAP
        info = end_info(ask(pub, b"", request))
        assert info["status"] == "error"
        assert len(info["reason"]) <= 300 and "x" * 300 not in info["reason"]
        epoch = {"op": "replay", "start_seq": 0, "epoch": "y" * 900}
        info = end_info(ask(pub, b"", msgspec.msgpack.encode(epoch)))
        assert info["status"] == "error" and len(info["reason"]) <= 300
        assert "x" * 300 not in caplog_vllm.text
    finally:
        pub.shutdown()


def test_a_client_that_reads_nothing_is_cut_off_and_told_why(monkeypatch):
    """Its answer waits in the engine a few messages at a time, not whole;
    once it has read nothing for STALL_S it is cut off, with an end that
    says so when it reads again."""
    monkeypatch.setattr(kv_events_answers.ReplayAnswers, "STALL_S", 1.0)
    pub = publisher()
    try:
        sent = _many_keys(pub, 300_000)
        recorded_status(pub, sent)
        slow = _request(_endpoints(pub)[1], {"op": "snapshot"}, RCVHWM=1, RCVBUF=4096)
        time.sleep(4.0)
        batches, ends = _read_answer(slow)
        slow.close(linger=0)
        assert len(ends) == 1 and ends[0]["status"] == "refused", ends
        assert "cut off" in ends[0]["reason"]
        assert batches < 300
        # The engine serves the next client whole.
        info = end_info(ask(pub, b"", msgspec.msgpack.encode({"op": "snapshot"})))
        assert info["status"] == "ok" and info["keys"] == 300_000
    finally:
        pub.shutdown()


def test_what_clients_leave_unread_is_bounded_in_total(monkeypatch):
    """Clients that ask and never read, each on a connection of its own,
    are not counted: past HELD_MAX_BYTES of answers unread in the engine
    (all of them together), answers wait and new ones are refused as busy;
    once those clients disconnect, whole answers are served again."""
    monkeypatch.setattr(kv_events_answers.ReplayAnswers, "HELD_MAX_BYTES", 2**20)
    monkeypatch.setattr(kv_events_answers.ReplayAnswers, "STALL_S", 1.0)
    pub = publisher()
    try:
        sent = _many_keys(pub, 100_000)  # 100 batches of about 30 kB
        epoch = recorded_status(pub, sent)["epoch"]
        replay = msgspec.msgpack.encode(
            {"op": "replay", "start_seq": 0, "epoch": epoch}
        )
        slow = [
            _request(
                _endpoints(pub)[1],
                msgspec.msgpack.decode(replay),
                RCVHWM=1,
                RCVBUF=4096,
            )
            for _ in range(12)
        ]
        reasons = []
        deadline = time.monotonic() + 10
        while not any("have not read" in r for r in reasons):
            assert time.monotonic() < deadline, f"never refused as busy: {reasons[-3:]}"
            info = end_info(ask(pub, b"", replay))
            reasons.append(info.get("reason") or info["status"])
        for dealer in slow:
            dealer.close(linger=0)
        deadline = time.monotonic() + 10
        while (info := end_info(messages := ask(pub, b"", replay)))["status"] != "ok":
            assert time.monotonic() < deadline, f"not served again: {info}"
            time.sleep(0.1)
        assert len(messages) == sent + 1
    finally:
        pub.shutdown()


def test_a_stalled_record_is_reported_and_comes_back_by_itself():
    """A record process that stops answering (stopped here): within
    RECORD_STALL_S status says so, the snapshot it owes is ended and new
    ones are refused with the reason; resumed, it serves again."""
    pub = publisher()
    child = _record_process()
    try:
        _stores(pub, (1, 2))
        recorded_status(pub, 2)
        child.suspend()
        owed = _request(_endpoints(pub)[1], {"op": "snapshot"})
        batches, ends = _read_answer(owed, 10.0)
        assert [e["status"] for e in ends] == ["refused"], ends
        status = recorded_status(pub, 2)["snapshot"]
        assert status["enabled"] is False and status["stalled"] is True
        info = end_info(ask(pub, b"", msgspec.msgpack.encode({"op": "snapshot"})))
        assert info["status"] == "refused" and "stalled" in info["reason"]
        child.resume()
        deadline = time.monotonic() + 10
        while not recorded_status(pub, 2)["snapshot"]["enabled"]:
            assert time.monotonic() < deadline, "the record stayed stalled"
            time.sleep(0.05)
        info = end_info(ask(pub, b"", msgspec.msgpack.encode({"op": "snapshot"})))
        assert info["status"] == "ok" and info["keys"] == 2
        owed.close(linger=0)
    finally:
        if child.is_running():
            child.resume()
        pub.shutdown()


@pytest.mark.parametrize("state", ["idle", "busy", "stopped"])
def test_shutdown_stops_the_record_process(caplog_vllm, state):
    """Within the publisher's RECORD_EXIT_TIMEOUT_S, whatever the record
    does: a small idle record, a record of a million keys busy applying a
    burst of as many, and one that has stopped (as a stuck one does)."""
    keys = 2 if state == "idle" else 1_000_000
    pub = publisher(snapshot_max_keys=2 * keys)  # the burst stays under it
    sent = _many_keys(pub, keys)
    recorded_status(pub, sent)
    child = _record_process()
    if state == "busy":
        _many_keys(pub, keys, first=keys + 1)
    elif state == "stopped":
        child.suspend()
    pub.shutdown()
    assert not child.is_running()
    assert "record process did not exit" not in caplog_vllm.text
