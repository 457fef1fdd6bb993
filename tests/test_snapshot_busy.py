"""A snapshot refused as busy is asked again, as docs/snapshot-protocol.md
advises: the reference consumer of this checkout against the real
``ZmqEventPublisher`` of the installed (main) wheel, while four other
clients' snapshots (the most it has under way) are being built and sent.

The publisher holds 200,000 keys, so each snapshot is about 200 batches,
which its record process sends a batch of each in turn; the consumer joins
once the four have started. It must be refused, pause, ask again and end
with every key. The consumer before this (issue 31) stopped at the first
refusal with ``RecoveryFailed``.
"""

from __future__ import annotations

import tempfile
import time

import msgspec
import zmq

from overlay_harness.replay_hwm import END_SEQ, ask
from overlay_harness.router_view import checkout_consumer
from overlay_harness.server_scenario import free_port

KEYS = 200_000
PER_BATCH = 1_000
STATUS = msgspec.msgpack.encode({"op": "status"})


def test_consumer_asks_again_after_a_busy_refusal() -> None:
    from vllm.distributed.kv_events import (
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    module = checkout_consumer()
    replay = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as tmp:
        live = f"ipc://{tmp}/kv-events"
        publisher = ZmqEventPublisher(
            0, endpoint=live, replay_endpoint=replay, copy_semantics="logical"
        )
        holders: list[zmq.Socket[bytes]] = []
        follower = None
        try:
            batches = KEYS // PER_BATCH
            for i in range(batches):
                hashes = list(range(i * PER_BATCH, (i + 1) * PER_BATCH))
                store = BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                )
                publisher.publish(KVEventBatch(ts=time.time(), events=[store]))
            deadline = time.monotonic() + 60
            # Until the record (a process of its own) has applied them all.
            while (status := ask(replay, STATUS, 0)["end"])["snapshot"][
                "next_seq"
            ] < batches:
                assert time.monotonic() < deadline, status
                time.sleep(0.05)
            assert status["snapshot"]["held_keys"] == KEYS, status
            # Four snapshots under way, their clients not reading the rest.
            for _ in range(publisher.MAX_SNAPSHOTS):
                holder: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
                holder.connect(replay)
                holder.send_multipart((b"", msgspec.msgpack.encode({"op": "snapshot"})))
                holders.append(holder)
            for holder in holders:
                assert holder.poll(10_000), "a snapshot did not start"
                _, _, seq, _ = holder.recv_multipart()
                assert seq != END_SEQ, "a holder's snapshot was refused"
            follower = module.Follower(live, replay)
            follower.sync()
        finally:
            for holder in holders:
                holder.close(linger=0)
            if follower is not None:
                follower.close()
            publisher.shutdown()
    anomalies = follower.stats.anomalies
    assert follower.synced and follower.next_seq == batches, anomalies
    assert follower.stats.recoveries == {"snapshot": 1}, follower.stats
    assert any(a.startswith("snapshot refused, busy") for a in anomalies), anomalies
    assert len(follower.mirror.held_keys()) == KEYS
