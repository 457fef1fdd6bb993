# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The reference consumer's relay (``kv_events_consumer.Relay``) on the real
ZmqEventPublisher, over ZMQ on 127.0.0.1: a router that only subscribes to
vLLM's stream, behind the relay, holds exactly the engine's keys after the
relay starts late, loses batches past the replay buffer, follows an engine
restart, restarts itself, and after the router itself subscribes late.

The router here keeps a set and a count (``SetMirror``, ``CountMirror``),
rejects a store under a parent it does not hold, as a radix tree does, and
drops a batch whose seq is not above the last one's, as Dynamo's indexer
does. Dynamo's own indexer behind the relay, on the live CPU server, is
``tests/test_cpu_server_relay.py`` in the project's tests."""

import threading
import time

import msgspec
import pytest
import zmq

from tests.distributed.test_kv_event_snapshot_protocol import (
    _bind_known_ports,
    _free_port,
    _rebind,
    _stores,
    stored,
)
from vllm.distributed.kv_events import BlockRemoved, KVEventBatch
from vllm.distributed.kv_events_consumer import (
    BlockStored,
    CountMirror,
    Relay,
    SetMirror,
    main,
)

pytestmark = pytest.mark.cpu_test

CONVERGE_S = 10.0
BUFFER_STEPS = 8


class Router:
    """A router that subscribes to vLLM's stream and knows nothing else."""

    def __init__(self, endpoint: str) -> None:
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.set = SetMirror()
        self.count = CountMirror()
        self.last_seq = -1
        self.orphans = 0

    def read(self) -> None:
        while self.sub.poll(0):
            _, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.last_seq:
                continue
            self.last_seq = seq
            for event in self.decoder.decode(payload).events:
                if isinstance(event, BlockStored):
                    parent = event.parent_block_hash
                    tier = (event.medium, event.group_idx)
                    if parent is not None and (*tier, parent) not in self.set:
                        self.orphans += 1
                        continue
                self.set.apply(event)
                self.count.apply(event)

    def holds(self, hashes) -> bool:
        want = {("GPU", 0, h) for h in hashes}
        self.read()
        return self.set.key_set() == want and self.count.key_set() == want

    def close(self) -> None:
        self.sub.close(linger=0)


class Driven:
    """A relay driven as its CLI drives it, in a thread of its own; holding
    ``paused`` stops it between two turns."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.stop = threading.Event()
        self.paused = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            with self.paused:
                self.relay.follow(0.05, 0.2)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.relay.close()


class LosesLiveBatches(Relay):
    """A relay whose link loses the next ``lose`` live batches, as a SUB
    past its high-water mark or a dropped connection does."""

    lose = 0

    def on_live(self, seq: int, payload: bytes) -> None:
        if self.lose:
            self.lose -= 1
        else:
            super().on_live(seq, payload)


def relay_on(live: str, replay: str, out: str) -> Relay:
    """A relay on ``out``, which the last one just closed (ZMQ releases it
    in the background)."""
    for _ in range(50):
        try:
            return Relay(live, replay, out)
        except zmq.ZMQError:
            time.sleep(0.1)
    raise AssertionError(f"{out} stayed in use")


def converge(routers, hashes, what: str) -> None:
    deadline = time.monotonic() + CONVERGE_S
    while not all(r.holds(hashes) for r in routers):
        assert time.monotonic() < deadline, (
            f"{what}: a router behind the relay holds "
            f"{[sorted(k[2] for k in r.set.key_set()) for r in routers]}, "
            f"the engine {sorted(hashes)}"
        )
        time.sleep(0.05)
    assert not any(r.orphans for r in routers), "a store came before its parent"


def removed(*hashes: int) -> KVEventBatch:
    return KVEventBatch(
        ts=0.0,
        events=[BlockRemoved(block_hashes=list(hashes), medium="GPU", group_idx=0)],
    )


def test_a_router_behind_the_relay_holds_the_engines_keys_through_recoveries():
    pub, ports = _bind_known_ports(buffer_steps=BUFFER_STEPS)
    endpoints = [f"tcp://*:{p}" for p in ports]
    live, replay = (f"tcp://127.0.0.1:{p}" for p in ports)
    out = f"tcp://127.0.0.1:{_free_port()}"
    routers: list[Router] = []
    driven = None
    try:
        # A relay that starts late: a chain and other keys came before it.
        pub.publish(KVEventBatch(ts=0.0, events=[stored([1, 2, 3])]))
        _stores(pub, (4, 5))
        pub.publish(removed(5))
        driven = Driven(LosesLiveBatches(live, replay, out))
        routers.append(Router(out))
        converge(routers, {1, 2, 3, 4}, "late start")

        # Live batches are forwarded; the chain's head is stored again after
        # its child, so the next view must reorder them.
        _stores(pub, (6, 7))
        pub.publish(removed(4, 1))
        _stores(pub, (1,))
        converge(routers, {1, 2, 3, 6, 7}, "live")

        # A router that subscribes late is sent the view.
        routers.append(Router(out))
        converge(routers, {1, 2, 3, 6, 7}, "a router's late subscription")

        # Far more batches lost than the publisher buffers for replay, all
        # sent while the relay is paused, so that it sees the gap only
        # once it is past the buffer.
        assert isinstance(driven.relay, LosesLiveBatches)
        with driven.paused:
            driven.relay.lose = 2 * BUFFER_STEPS + 1
            _stores(pub, range(100, 100 + 2 * BUFFER_STEPS))
            pub.publish(removed(1, 2, 3))
            _stores(pub, (8,))
            time.sleep(0.5)  # they reach the relay's SUB socket
        held = {6, 7, 8, *range(100, 100 + 2 * BUFFER_STEPS)}
        converge(routers, held, "a gap past the replay buffer")
        assert driven.relay.stats.recoveries["snapshot"] >= 2

        # An engine restart: the same ports, seq from 0, none of the old keys.
        pub.shutdown()
        pub = _rebind(endpoints)
        _stores(pub, (20, 21, 22))
        converge(routers, {20, 21, 22}, "an engine restart")

        # A relay restart on the same endpoint: its seq goes on above the
        # last relay's, which the routers saw.
        driven.close()
        driven = None
        driven = Driven(relay_on(live, replay, out))
        pub.publish(removed(20))
        converge(routers, {21, 22}, "a relay restart")
    finally:
        if driven is not None:
            driven.close()
        for router in routers:
            router.close()
        pub.shutdown()


def test_the_cli_refuses_a_relay_that_would_stop_at_once():
    args = ["--endpoint", "tcp://127.0.0.1:1", "--replay-endpoint", "x"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--relay", "tcp://127.0.0.1:2", "--once"])
    assert exit_info.value.code == 2


def test_an_engine_restart_with_snapshots_off_replaces_the_routers_view():
    # No snapshot: the relay replays the new epoch from seq 0.
    pub, ports = _bind_known_ports(snapshot_max_keys=0)
    endpoints = [f"tcp://*:{p}" for p in ports]
    live, replay = (f"tcp://127.0.0.1:{p}" for p in ports)
    out = f"tcp://127.0.0.1:{_free_port()}"
    driven = Driven(Relay(live, replay, out))
    router = Router(out)
    try:
        _stores(pub, (1, 2))
        converge([router], {1, 2}, "start")
        pub.shutdown()
        pub = _rebind(endpoints, snapshot_max_keys=0)
        _stores(pub, (3,))
        converge([router], {3}, "an engine restart")
        assert driven.relay.stats.recoveries["snapshot"] == 0
    finally:
        driven.close()
        router.close()
        pub.shutdown()
