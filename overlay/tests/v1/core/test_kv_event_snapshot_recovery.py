# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Consumers that start late or lose batches get the exact view back.

The real ``Scheduler``, driven as in ``test_kv_event_stream_fuzz.py``,
publishes through the real ``ZmqEventPublisher`` on 127.0.0.1 with a small
``buffer_steps``. Reference consumers (``vllm.distributed.kv_events_consumer``)
join at random steps, drop random batches and go away for random spans, some
shorter and some longer than the replay buffer; they recover by replay or by
snapshot. After every step each consumer that is present equals the pools'
resident keys in the mirror its policy is for, and a consumer that saw every
batch: the same keys, counts and announcing metadata of every held key.
"""

import random
from collections import Counter

import pytest

from tests.v1.core.kv_event_mirrors import resident_copies
from tests.v1.core.test_kv_event_stream_fuzz import CONFIGS, Run, model_dir
from vllm.config.kv_events import KV_EVENTS_COPY_SEMANTICS
from vllm.distributed.kv_events import ZmqEventPublisher
from vllm.distributed.kv_events_consumer import (
    COPY_SEMANTICS,
    Follower,
    block_fields,
)

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

__all__ = ["model_dir"]

STEPS = 120
BUFFER_STEPS = 4
CONSUMERS = 3


class CountingPublisher(ZmqEventPublisher):
    """The real publisher; counts batches so the test knows what to wait for."""

    published = 0

    def publish(self, events) -> None:
        self.published += 1
        super().publish(events)


class Lossy(Follower):
    """A consumer that loses live batches: at random, and all of them while
    away (as a router pod that restarts or a PUB socket at its HWM)."""

    def __init__(self, *args, rng: random.Random, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rng = rng
        self.away_until = -1
        self.dropped = 0

    def on_live(self, seq: int, payload: bytes) -> None:
        if self.away_until >= 0 or self.rng.random() < 0.1:
            self.dropped += 1
            return
        super().on_live(seq, payload)


class RecoveryRun(Run):
    def __init__(self, model_dir: str, config: str, policy: str, seed: int):
        super().__init__(model_dir, config, policy, seed, report_full=False)
        self.publisher = CountingPublisher(
            data_parallel_rank=0,
            endpoint="tcp://*:0",
            replay_endpoint="tcp://*:0",
            buffer_steps=BUFFER_STEPS,
            copy_semantics=policy,
        )
        self.scheduler.kv_event_publisher = self.publisher
        config_ = self.publisher.get_publisher_config()
        self.endpoints = (config_.endpoint, config_.replay_endpoint)
        # Joins before the first batch: the consumer that saw everything.
        self.witness = Follower(*self.endpoints)
        # The consumers' own chances: the engine's workload (self.rng) stays
        # the same whatever they do.
        self.loss_rng = random.Random(seed + 1000)
        self.join_at = sorted(
            self.loss_rng.randrange(STEPS // 2) for _ in range(CONSUMERS)
        )
        self.consumers: list[Lossy] = []

    def close(self) -> None:
        for follower in [self.witness, *self.consumers]:
            follower.close()
        self.publisher.shutdown()

    def check(self) -> None:
        step = self.cov.steps
        while self.join_at and self.join_at[0] <= step:
            self.join_at.pop(0)
            rng = random.Random(self.loss_rng.random())
            self.consumers.append(Lossy(*self.endpoints, rng=rng))
        for consumer in self.consumers:
            if consumer.away_until == step:
                consumer.away_until = -1
            elif consumer.away_until < 0 and self.loss_rng.random() < 0.08:
                consumer.away_until = step + self.loss_rng.randint(1, 5 * BUFFER_STEPS)
        truth = resident_copies(self.pools)
        self.witness.sync(self.publisher.published)
        self._compare(self.witness, truth, "witness")
        for i, consumer in enumerate(self.consumers):
            if consumer.away_until >= 0:
                consumer.poll(0)  # what arrives while away is lost
                continue
            consumer.sync(self.publisher.published)
            self._compare(consumer, truth, f"consumer {i}")

    def _compare(self, follower: Follower, truth, who: str) -> None:
        where = (
            f"config={self.config} policy={self.policy} seed={self.seed} "
            f"step={self.cov.steps} {who} (seq {follower.next_seq}, "
            f"recoveries {dict(follower.stats.recoveries)})"
        )
        mirror, witness = follower.mirror, self.witness.mirror
        assert follower.synced, f"{where}: not synced"
        if "set" in COPY_SEMANTICS[self.policy]:
            assert mirror.set.keys == set(truth), (
                f"{where}: set mirror stale {mirror.set.keys - set(truth)}, "
                f"missing {set(truth) - mirror.set.keys}"
            )
        if "count" in COPY_SEMANTICS[self.policy]:
            want = dict.fromkeys(truth, 1) if self.policy == "logical" else truth
            assert dict(mirror.count.counts) == dict(want), (
                f"{where}: counting mirror differs from the pools"
            )
            assert mirror.count.counts == witness.count.counts, (
                f"{where}: counting mirror differs from the witness"
            )
        assert mirror.held_keys() == witness.held_keys()
        for key in mirror.held_keys():
            assert block_fields(*mirror.announced[key]) == block_fields(
                *witness.announced[key]
            ), f"{where}: {key} announced with other metadata"


@pytest.mark.parametrize("policy", KV_EVENTS_COPY_SEMANTICS)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_late_and_lossy_consumers_recover_the_exact_view(
    model_dir, monkeypatch, config, policy, seed
):
    # tcp://*:0 binds VLLM_HOST_IP on a free port.
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    run = RecoveryRun(model_dir, config, policy, seed)
    try:
        run.run(STEPS)
    finally:
        run.close()
    recoveries = sum((c.stats.recoveries for c in run.consumers), start=Counter())
    print(
        f"{config} {policy} seed={seed}: published {run.publisher.published}, "
        f"recoveries {dict(recoveries)}, dropped "
        f"{[c.dropped for c in run.consumers]}, anomalies "
        f"{sum(len(c.stats.anomalies) for c in run.consumers)}"
    )
    # Both ways back were taken, the snapshot beyond each consumer's start.
    assert recoveries["replay"] > 0
    assert recoveries["snapshot"] > len(run.consumers)
    assert not run.witness.stats.anomalies
