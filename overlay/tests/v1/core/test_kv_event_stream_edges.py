# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The KV event stream at the edges of a deployment, through the real
v1 ``Scheduler`` and a real ZMQ subscriber on 127.0.0.1.

- Resets with a CPU tier in the stream (the simple CPU offload connector):
  ``reset_prefix_cache()`` leaves the CPU tier's keys with consumers, and
  ``reset_prefix_cache(reset_connector=True)`` removes each key once, never
  one a consumer has already dropped.
- A request's ``kv_cache_report_mode`` (``SamplingParams.extra_args``, what
  ``vllm_xargs`` sets over the API) cannot re-announce resident keys under
  "logical".
- The publisher config the engine reports carries the configured
  ``copy_semantics``.

After each step a set-style and a counting consumer, fed from the decoded
stream, are compared per (medium, group, hash) with every pool's resident
keys. Model outputs are made up: no model runs.
"""

import json
import time
from typing import Any

import msgspec
import pytest
import zmq

from tests.v1.core.block_pool_view import model_runner_output
from tests.v1.core.test_duplicate_block_identity_scheduler import (
    EOS_TOKEN_ID,
    MAX_MODEL_LEN,
    SAMPLED_TOKEN_ID,
    TINY_OPT_CONFIG,
    tiny_model_config,
)
from tests.v1.simple_kv_offload.test_scheduler import (
    _BYTES_PER_BLOCK,
    BLOCK_SIZE,
    _make_kv_cache_config,
)
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.config.kv_events import KV_EVENTS_COPY_SEMANTICS, KVEventsConfig
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
)
from vllm.distributed.kv_events_consumer import Mirror
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request
from vllm.v1.simple_kv_offload.metadata import (
    INVALID_JOB_ID,
    SimpleCPUOffloadMetadata,
    SimpleCPUOffloadWorkerMetadata,
)
from vllm.v1.structured_output import StructuredOutputManager

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

POLICIES = KV_EVENTS_COPY_SEMANTICS
SYNC_TIMEOUT_S = 20.0


@pytest.fixture(autouse=True)
def _init_none_hash():
    init_none_hash(sha256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_opt")
    (path / "config.json").write_text(json.dumps(TINY_OPT_CONFIG))
    return str(path)


class Subscriber:
    """A real ZMQ SUB socket on 127.0.0.1 that decodes the stock schema.

    The publisher connects to ``endpoint``. ``sync`` publishes an empty
    marker batch through the scheduler's own publisher and returns the events
    published before it, so a test reads exactly what each step published.
    """

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.markers = 0
        self.seqs: list[int] = []

    def _recv(self, timeout_s: float) -> KVEventBatch | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        _topic, seq, payload = self.sock.recv_multipart()
        self.seqs.append(int.from_bytes(seq, "big"))
        return self.decoder.decode(payload)

    def connect(self, scheduler: Scheduler) -> None:
        """Publish markers until one arrives: the connection is then up."""
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while time.monotonic() < deadline:
            self.markers += 1
            scheduler.kv_event_publisher.publish(
                KVEventBatch(ts=-float(self.markers), events=[])
            )
            batch = self._recv(0.2)
            while batch is not None:
                assert not batch.events, "events published before the handshake"
                batch = self._recv(0.05)
            if self.seqs:
                self.seqs.clear()
                return
        raise AssertionError(f"no marker arrived within {SYNC_TIMEOUT_S} s")

    def sync(self, scheduler: Scheduler) -> list:
        self.markers += 1
        marker = -float(self.markers)
        scheduler.kv_event_publisher.publish(KVEventBatch(ts=marker, events=[]))
        events: list = []
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while True:
            batch = self._recv(max(0.0, deadline - time.monotonic()))
            assert batch is not None, f"marker {marker} did not arrive"
            if batch.ts == marker:
                return events
            if batch.ts >= 0:
                events.extend(batch.events)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def subscriber():
    sub = Subscriber()
    yield sub
    sub.close()


@pytest.fixture
def schedulers():
    """Schedulers built by a test; shut down (publisher thread, connector)
    after it."""
    built: list[Scheduler] = []
    yield built
    for scheduler in built:
        scheduler.shutdown()


def apply(mirror: Mirror, events: list) -> None:
    """Feed ``events`` to the reference consumer's set-style and counting
    mirrors, keyed (medium, group, hash)."""
    for event in events:
        mirror.apply(event)


def assert_exact(mirror: Mirror, resident: set[tuple]) -> None:
    """Without duplicate copies every policy is exact for both consumers,
    neither of which may see the removal of a key it does not hold."""
    assert not mirror.set.unknown_removals
    assert not mirror.count.unknown_removals
    assert mirror.set.key_set() == resident
    assert mirror.count.key_set() == resident
    if mirror.copy_semantics == "logical":
        assert set(mirror.count.counts.values()) <= {1}


def resident(pool: BlockPool, medium: str) -> set[tuple]:
    return {
        (medium, get_group_id(key), maybe_convert_block_hash(get_block_hash(key)))
        for key in pool.cached_block_hash_to_block.resident_keys
    }


def make_scheduler(
    built: list[Scheduler],
    model_dir: str,
    endpoint: str,
    policy: str,
    num_gpu_blocks: int = 16,
    cpu_offload_blocks: int | None = None,
    **kv_events: Any,
) -> Scheduler:
    """The real Scheduler with KV events over ZMQ to ``endpoint``; with
    ``cpu_offload_blocks``, the simple CPU offload connector (eager stores)
    with that many CPU blocks; ``kv_events``: more KVEventsConfig fields."""
    kv_transfer_config = (
        KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use_per_rank": _BYTES_PER_BLOCK * cpu_offload_blocks
            },
        )
        if cpu_offload_blocks is not None
        else None
    )
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            watermark=0.0,
        ),
        model_config=tiny_model_config(model_dir),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=kv_transfer_config,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=endpoint,
            topic="kv-events",
            copy_semantics=policy,
            **kv_events,
        ),
        # The scheduler runs no model; do not probe for an accelerator.
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
    register_all_kvcache_specs(vllm_config)
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=_make_kv_cache_config(num_gpu_blocks),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        log_stats=True,
    )
    built.append(scheduler)
    return scheduler


def make_request(
    request_id: str, token_ids: list[int], extra_args: dict | None = None
) -> Request:
    sampling_params = SamplingParams(
        ignore_eos=True, max_tokens=2, extra_args=extra_args
    )
    sampling_params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=request_id,
        prompt_token_ids=token_ids,
        sampling_params=sampling_params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def prompt(family: int, num_blocks: int = 2) -> list[int]:
    """``num_blocks`` full blocks unique to ``family``, plus one token."""
    return [100 + family] * (num_blocks * BLOCK_SIZE + 1)


def step(scheduler: Scheduler) -> None:
    """One engine step with a made-up model; every load and store the simple
    CPU offload connector submits this step completes this step."""
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([SAMPLED_TOKEN_ID] if done else [])
    scheduler.update_from_output(
        output,
        model_runner_output(req_ids, sampled, completed_transfers(output)),
    )


def completed_transfers(output: SchedulerOutput) -> KVConnectorOutput | None:
    """The workers' report of a made-up step: every load and store the
    simple CPU offload connector submitted in ``output`` has completed."""
    meta = output.kv_connector_metadata
    if not isinstance(meta, SimpleCPUOffloadMetadata):
        return None
    stored = {} if meta.store_event == INVALID_JOB_ID else {meta.store_event: 1}
    return KVConnectorOutput(
        finished_recving=set(meta.load_event_to_reqs.get(meta.load_event, ())),
        kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(
            completed_store_events=stored
        ),
    )


def run_to_completion(scheduler: Scheduler, requests: list[Request]) -> None:
    for request in requests:
        scheduler.add_request(request)
    for _ in range(50):
        if not scheduler.has_requests():
            break
        step(scheduler)
    assert not scheduler.has_requests()
    # Stores of the last blocks complete in the steps after the requests end.
    for _ in range(3):
        step(scheduler)


# ------------------------------------------------- resets with a CPU tier


@pytest.mark.parametrize("policy", POLICIES)
def test_resets_with_cpu_offload_tier_keep_consumers_exact(
    model_dir, subscriber, schedulers, policy
):
    scheduler = make_scheduler(
        schedulers, model_dir, subscriber.endpoint, policy, cpu_offload_blocks=32
    )
    connector = scheduler.get_kv_connector()
    assert connector is not None
    cpu_pool = connector.scheduler_manager.cpu_block_pool
    gpu_pool = scheduler.kv_cache_manager.block_pool
    subscriber.connect(scheduler)
    mirror = Mirror(policy)

    def check() -> tuple[set[tuple], set[tuple]]:
        apply(mirror, subscriber.sync(scheduler))
        gpu, cpu = resident(gpu_pool, MEDIUM_GPU), resident(cpu_pool, MEDIUM_CPU)
        assert_exact(mirror, gpu | cpu)
        return gpu, cpu

    run_to_completion(scheduler, [make_request(f"a{i}", prompt(i)) for i in range(3)])
    gpu, cpu = check()
    assert gpu and cpu == {(MEDIUM_CPU, g, h) for (_, g, h) in gpu}

    # The default reset (POST /reset_prefix_cache, LLM, AsyncLLM): the device
    # pool only. Consumers must keep the CPU tier's keys.
    assert scheduler.reset_prefix_cache()
    step(scheduler)
    gpu_after, cpu_after = check()
    assert not gpu_after and cpu_after == cpu

    # A hit from the CPU tier after the reset announces nothing new there.
    run_to_completion(
        scheduler,
        [
            make_request("b0", prompt(0)),
            *[make_request(f"b{i}", prompt(i)) for i in (3, 4)],
        ],
    )
    gpu, cpu = check()
    assert gpu and len(cpu) == 10

    # reset_connector=True (?reset_external=true, pause_generation with
    # clear_cache): every tier, each key removed once.
    assert scheduler.reset_prefix_cache(reset_connector=True)
    step(scheduler)
    gpu, cpu = check()
    assert not gpu and not cpu
    assert not mirror.held_keys()


@pytest.mark.parametrize("policy", POLICIES)
def test_reset_without_a_connector_keeps_all_blocks_cleared(
    model_dir, subscriber, schedulers, policy
):
    """With the device pool alone in the stream its reset is upstream's."""
    scheduler = make_scheduler(schedulers, model_dir, subscriber.endpoint, policy)
    subscriber.connect(scheduler)
    run_to_completion(scheduler, [make_request("a", prompt(0))])
    subscriber.sync(scheduler)
    assert scheduler.reset_prefix_cache()
    step(scheduler)
    assert subscriber.sync(scheduler) == [AllBlocksCleared()]


# ------------------------------------------- a request's report mode


@pytest.mark.parametrize("policy", POLICIES)
def test_request_report_mode_cannot_re_announce_under_logical(
    model_dir, subscriber, schedulers, policy
):
    scheduler = make_scheduler(schedulers, model_dir, subscriber.endpoint, policy)
    gpu_pool = scheduler.kv_cache_manager.block_pool
    subscriber.connect(scheduler)
    mirror = Mirror(policy)
    full = {"kv_cache_report_mode": "full"}
    # The second request hits the first one's blocks, and a third runs
    # beside a fourth that holds the same prefix.
    run_to_completion(scheduler, [make_request("a", prompt(0), full)])
    run_to_completion(scheduler, [make_request("b", prompt(0), full)])
    run_to_completion(
        scheduler,
        [make_request("c", prompt(0), full), make_request("d", prompt(0), full)],
    )
    events = subscriber.sync(scheduler)
    keys = resident(gpu_pool, MEDIUM_GPU)
    assert len(keys) == 2
    stores = [e for e in events if isinstance(e, BlockStored)]
    if policy == "logical":
        apply(mirror, events)
        assert_exact(mirror, keys)
        assert len(stores) == 1
    else:
        # The request's setting reaches the pool: each hit re-announces.
        assert len(stores) >= 3


# ------------------------------------------------ the reported config


@pytest.mark.parametrize("policy", POLICIES)
def test_reported_publisher_config_carries_copy_semantics(
    model_dir, subscriber, schedulers, policy
):
    """What EngineCore sends in its handshake (and GET /kv_event_sources)."""
    scheduler = make_scheduler(schedulers, model_dir, subscriber.endpoint, policy)
    reported = scheduler.get_kv_event_publisher_config()
    assert reported is not None
    assert reported.copy_semantics == policy
    assert reported.endpoint == subscriber.endpoint
    assert reported.topic == "kv-events"
