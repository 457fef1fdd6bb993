# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One process follows a fleet (``kv_events_consumer.Fleet``): several real
ZmqEventPublishers over ZMQ on 127.0.0.1, each with its own keys, a late
join, a gap past one's replay buffer and one's restart; each follower
holds exactly its publisher's keys and matches its prefixes."""

import time

import pytest

from tests.distributed.test_kv_event_relay import removed
from tests.distributed.test_kv_event_snapshot_protocol import (
    _bind_known_ports,
    _rebind,
    _stores,
    stored,
)
from vllm.distributed.kv_events import KVEventBatch
from vllm.distributed.kv_events_consumer import CompactMirror, Fleet

pytestmark = pytest.mark.cpu_test

ENGINES = 3
BUFFER_STEPS = 8


def follow_until(fleet: Fleet, want: dict[str, set[int]], what: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        fleet.follow(0.05, 0.2)
        held = {
            name: {key[2] for key in f.mirror.held_keys()}
            for name, f in fleet.followers.items()
        }
        if held == want and all(f.synced for f in fleet.followers.values()):
            return
        assert time.monotonic() < deadline, f"{what}: held {held}, want {want}"


def test_one_process_follows_each_publisher_of_a_fleet_exactly():
    pubs, endpoints = {}, {}
    for e in range(ENGINES):
        pubs[f"e{e}"], ports = _bind_known_ports(buffer_steps=BUFFER_STEPS)
        endpoints[f"e{e}"] = [f"tcp://127.0.0.1:{p}" for p in ports]
    fleet = None
    try:
        # Keys before the fleet joins: each engine a chain of its own.
        for e, pub in enumerate(pubs.values()):
            pub.publish(KVEventBatch(ts=0.0, events=[stored([10 * e + 1, 10 * e + 2])]))
        fleet = Fleet({name: tuple(eps) for name, eps in endpoints.items()})
        assert all(
            isinstance(f.mirror, CompactMirror) for f in fleet.followers.values()
        )
        want = {f"e{e}": {10 * e + 1, 10 * e + 2} for e in range(ENGINES)}
        follow_until(fleet, want, "a late join")
        # stored() gives block h the tokens h*10 .. h*10+3.
        chain = [t for h in (1, 2) for t in range(h * 10, h * 10 + 4)]
        assert fleet.match(chain + [0]) == {"e0": 2, "e1": 0, "e2": 0}

        # One engine's live batches lost past its buffer (its link drops
        # them, as a SUB past its high-water mark): it alone recovers.
        lossy = fleet.followers["e1"]
        receive, lost = lossy.on_live, []

        def on_live(seq: int, payload: bytes) -> None:
            if len(lost) < 2 * BUFFER_STEPS:
                lost.append(seq)
            else:
                receive(seq, payload)

        lossy.on_live = on_live
        _stores(pubs["e1"], range(100, 100 + 2 * BUFFER_STEPS))
        pubs["e1"].publish(removed(11))
        _stores(pubs["e0"], (3,))
        want["e0"].add(3)
        want["e1"] = {12, *range(100, 100 + 2 * BUFFER_STEPS)}
        follow_until(fleet, want, "a gap past one buffer")
        assert lossy.stats.recoveries["snapshot"] >= 2

        # One engine restarts on its ports: the new one's keys only.
        pubs["e2"].shutdown()
        pubs["e2"] = _rebind([e.replace("127.0.0.1", "*") for e in endpoints["e2"]])
        _stores(pubs["e2"], (50,))
        want["e2"] = {50}
        follow_until(fleet, want, "a restart")
    finally:
        if fleet is not None:
            fleet.close()
        for pub in pubs.values():
            pub.shutdown()
