# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A lost snapshot record comes back by itself, rebuilt from the block
pool, without an engine restart: after its process is killed, after it
fell behind a 250,000-batch burst, and after it passed its cap and the
engine then held fewer keys. Each time a consumer that joins late (the
reference ``Follower``, over ZMQ on 127.0.0.1) holds exactly the pool's
resident keys, and under "physical" their copies.

The real v1 ``Scheduler`` publishes; this test's thread is its engine
thread, which steps it with made-up model outputs and, when the publisher
wakes it (as ``EngineCoreProc`` does on an idle engine), calls
``publish_kv_events``.
"""

import random
import socket
import threading
import time
from collections.abc import Callable

import msgspec
import psutil
import pytest

from tests.distributed.test_kv_event_snapshot_protocol import _one_block_store
from tests.v1.core import test_kv_event_stream_edges as edges
from tests.v1.core.test_kv_event_stream_edges import (
    POLICIES,
    make_request,
    make_scheduler,
    prompt,
    resident,
    run_to_completion,
)
from vllm.distributed import kv_events_record
from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    BlockRemoved,
    KVEventBatch,
)
from vllm.distributed.kv_events_consumer import Follower
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as external
from vllm.v1.core.sched.scheduler import Scheduler

pytestmark = pytest.mark.cpu_test

# The stream-edge tests' fixtures, by the names the tests here take.
model_dir = edges.model_dir
schedulers = edges.schedulers

# The promise: back within 10 s of the cause clearing.
BACK_WITHIN_S = 10.0
NUM_GPU_BLOCKS = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """A Scheduler whose publisher binds a PUB and a replay socket, with
    this thread as its engine thread."""

    def __init__(self, built, model_dir: str, policy: str, **kv_events) -> None:
        pub, replay = _free_port(), _free_port()
        self.scheduler: Scheduler = make_scheduler(
            built,
            model_dir,
            f"tcp://*:{pub}",
            policy,
            num_gpu_blocks=NUM_GPU_BLOCKS,
            replay_endpoint=f"tcp://*:{replay}",
            **kv_events,
        )
        self.endpoints = (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
        self.woken = threading.Event()
        self.scheduler.set_kv_event_wakeup(self.woken.set)
        self.rng = random.Random(policy)
        self.requests = 0

    def serve(self, requests: int) -> None:
        """Run ``requests`` requests, three at a time, on a few prompt
        families: hits, evictions and (three alike at once) copies."""
        for _ in range(0, requests, 3):
            family = self.rng.randrange(12)
            batch = []
            for _ in range(3):
                if self.rng.random() < 0.5:
                    family = self.rng.randrange(12)
                self.requests += 1
                tokens = prompt(family, self.rng.randrange(1, 4))
                batch.append(make_request(f"r{self.requests}", tokens))
            run_to_completion(self.scheduler, batch)

    def idle_until(self, done: Callable[[], bool], timeout_s: float) -> None:
        """Idle as EngineCoreProc does: act only when woken."""
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"not done within {timeout_s} s"
            if self.woken.wait(0.05):
                self.woken.clear()
                self.scheduler.publish_kv_events()

    def snapshot_status(self) -> dict:
        follower = Follower(*self.endpoints)
        try:
            status = follower.status()
        finally:
            follower.close()
        assert status is not None
        return status["snapshot"]

    def snapshots_on(self) -> bool:
        return self.snapshot_status()["enabled"]

    def assert_a_late_consumer_is_exact(self, policy: str) -> None:
        follower = Follower(*self.endpoints)
        try:
            follower.sync()
            pool = self.scheduler.kv_cache_manager.block_pool
            keys = resident(pool, MEDIUM_GPU)
            assert keys, "the test stored nothing"
            assert follower.mirror.held_keys() == keys
            if policy == "physical":
                index = pool.cached_block_hash_to_block
                copies = {
                    (
                        MEDIUM_GPU,
                        get_group_id(key),
                        external(get_block_hash(key)),
                    ): index.num_copies(key)
                    for key in index.resident_keys
                }
                assert follower.mirror.view.counts == copies
        finally:
            follower.close()


def _record_process() -> psutil.Process:
    (child,) = [
        p
        for p in psutil.Process().children()
        if kv_events_record.__file__ in p.cmdline()
    ]
    return child


# Each policy with the default integer hashes, and the bytes hashes of
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 once.
@pytest.mark.parametrize(
    "policy,int_hashes", [(p, "1") for p in POLICIES] + [("logical", "0")]
)
def test_a_killed_record_is_rebuilt_from_the_block_pool(
    model_dir, schedulers, monkeypatch, policy, int_hashes
):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", int_hashes)
    engine = Engine(schedulers, model_dir, policy)
    engine.serve(30)
    engine.idle_until(engine.snapshots_on, 30)
    _record_process().kill()
    engine.idle_until(lambda: not engine.snapshots_on(), 10)
    engine.serve(15)  # the engine goes on while the record is off
    engine.idle_until(engine.snapshots_on, BACK_WITHIN_S)
    engine.assert_a_late_consumer_is_exact(policy)
    engine.serve(15)  # and the rebuilt record follows the stream from there
    engine.assert_a_late_consumer_is_exact(policy)


def _burst_batch(i: int) -> KVEventBatch:
    """A batch that stores a key no request has and removes it at once: it
    leaves every consumer's view as it was, and takes about 300 bytes of
    the record's ring."""
    batch = _one_block_store((1 << 62) + i, 48)
    batch.events.append(
        BlockRemoved(block_hashes=[(1 << 62) + i], medium=MEDIUM_GPU, group_idx=0)
    )
    return batch


BURST_BATCHES = 250_000


def test_a_record_behind_a_burst_is_rebuilt(model_dir, schedulers, caplog_vllm):
    """The record process is stopped (as a starved one is) while 250,000
    batches go out at full speed: more than its ring holds, so it is
    dropped; it is then rebuilt and a late consumer is exact."""
    engine = Engine(schedulers, model_dir, "logical")
    engine.serve(12)
    engine.idle_until(engine.snapshots_on, 30)
    stopped = _record_process()
    batch = _burst_batch(0)
    assert len(msgspec.msgpack.encode(batch)) * BURST_BATCHES > (
        kv_events_record.RecordProcess.RING_BYTES
    )
    stopped.suspend()
    try:
        publisher = engine.scheduler.kv_event_publisher
        for i in range(BURST_BATCHES):
            publisher.publish(_burst_batch(i))
        # Killed by the publisher once it fell the ring behind (waited for
        # here, not polled: a dead child stays a zombie until reaped).
        stopped.wait(60)
    finally:
        if stopped.is_running():
            stopped.resume()
    assert "fell more than" in caplog_vllm.text
    engine.idle_until(engine.snapshots_on, BACK_WITHIN_S)
    engine.assert_a_late_consumer_is_exact("logical")


def test_a_record_past_its_cap_is_rebuilt_once_the_engine_holds_fewer(
    model_dir, schedulers
):
    engine = Engine(schedulers, model_dir, "logical", snapshot_max_keys=6)
    engine.serve(30)
    engine.idle_until(lambda: not engine.snapshots_on(), 10)
    assert "snapshot_max_keys=6" in engine.snapshot_status()["reason"]
    assert len(resident(engine.scheduler.kv_cache_manager.block_pool, "GPU")) > 6
    # While the engine holds more, the record stays off, and says why.
    time.sleep(2 * engine.scheduler.kv_event_publisher.RECORD_REBUILD_S)
    engine.idle_until(lambda: "holds" in (engine.snapshot_status()["reason"] or ""), 10)
    assert engine.scheduler.reset_prefix_cache()
    run_to_completion(engine.scheduler, [make_request("small", prompt(0, 2))])
    engine.idle_until(engine.snapshots_on, BACK_WITHIN_S)
    engine.assert_a_late_consumer_is_exact("logical")
