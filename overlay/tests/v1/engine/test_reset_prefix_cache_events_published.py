# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A prefix-cache reset's KV events leave the engine before the reset returns.

The engine publishes KV events from its steps; a reset on an idle engine
(the weight-update flow: reset, then new requests) must not wait for the
next request's step, or a router routes that request on the stale view.

Through the real ``EngineCore`` (its scheduler, block pools and ZMQ
publisher) with a real ZMQ subscriber bound on 127.0.0.1 that decodes the
stream with the stock msgspec schema. The model side is made up (no model
runs on this machine's CPU): every scheduled request samples one token,
and every transfer of the simple CPU offload connector completes in the step
that submits it. Right after ``EngineCore.reset_prefix_cache`` returns, and
with no step in between, the subscriber publishes a marker batch through the
engine's publisher and reads up to it (``Subscriber.sync``); the publisher
sends in the order of its ``publish`` calls, so an event read before the
marker was published before the call returned. A set-style and a counting
consumer fed from the stream must then hold exactly the keys the pools
hold.

For every ``copy_semantics`` policy; the device pool alone in the stream
(its reset is ``AllBlocksCleared``) or with a CPU tier (each pool removes its
keys under its medium); with and without ``reset_connector`` (the HTTP API's
``reset_external``); on an idle engine and on one with running requests.
Sequence numbers must have no gap.
"""

import time
from concurrent.futures import Future

import pytest

from tests.v1.core.block_pool_view import model_runner_output
from tests.v1.core.test_duplicate_block_identity_scheduler import (
    MAX_MODEL_LEN,
    SAMPLED_TOKEN_ID,
    tiny_model_config,
)
from tests.v1.core.test_kv_event_stream_edges import (
    Subscriber,
    apply,
    assert_exact,
    completed_transfers,
    model_dir,  # noqa: F401
    prompt,
    resident,
    subscriber,  # noqa: F401
)
from tests.v1.simple_kv_offload.test_scheduler import (
    _BYTES_PER_BLOCK,
    BLOCK_SIZE,
    DTYPE,
    HEAD_SIZE,
    NUM_KV_HEADS,
)
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.config.kv_events import KV_EVENTS_COPY_SEMANTICS, KVEventsConfig
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared
from vllm.distributed.kv_events_consumer import Mirror
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

POLICIES = KV_EVENTS_COPY_SEMANTICS
# The engine requires room for one request of the model's maximum length.
NUM_GPU_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE + 1
NUM_CPU_BLOCKS = 32


class MadeUpExecutor(Executor):
    """The workers' side of ``EngineCore`` without a model: one
    full-attention layer, and one sampled token for every scheduled request
    (prompts are short enough to be computed in one step)."""

    uses_ray = False
    supports_pp = False

    def _init_executor(self) -> None:
        pass

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, **_):
        replies = {
            "get_kv_cache_spec": {
                "layer": FullAttentionSpec(
                    block_size=BLOCK_SIZE,
                    num_kv_heads=NUM_KV_HEADS,
                    head_size=HEAD_SIZE,
                    dtype=DTYPE,
                )
            },
            "get_supported_kv_cache_layouts": ["LBNHC"],
            "determine_available_memory": _BYTES_PER_BLOCK * NUM_GPU_BLOCKS,
            "get_simple_cpu_offload_num_cpu_blocks": NUM_CPU_BLOCKS,
        }
        return [replies.get(method)]

    def compile_or_warm_up_model(self) -> None:
        pass

    def execute_model(self, scheduler_output, non_block=False):
        req_ids = list(scheduler_output.num_scheduled_tokens)
        output = model_runner_output(
            req_ids,
            [[SAMPLED_TOKEN_ID] for _ in req_ids],
            completed_transfers(scheduler_output),
        )
        if not non_block:
            return output
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(output)
        return future

    def check_health(self) -> None:
        pass


def make_engine(
    model_dir: str,  # noqa: F811
    endpoint: str,
    policy: str,
    cpu_tier: bool,
) -> EngineCore:
    kv_transfer_config = (
        KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use_per_rank": _BYTES_PER_BLOCK * NUM_CPU_BLOCKS
            },
        )
        if cpu_tier
        else None
    )
    vllm_config = VllmConfig(
        model_config=tiny_model_config(model_dir),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=MAX_MODEL_LEN,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
            async_scheduling=False,
        ),
        cache_config=CacheConfig(
            block_size=BLOCK_SIZE,
            enable_prefix_caching=True,
            num_gpu_blocks_override=NUM_GPU_BLOCKS,
        ),
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=endpoint,
            topic="kv-events",
            copy_semantics=policy,
        ),
    )
    return EngineCore(vllm_config, MadeUpExecutor, log_stats=False)


def add_request(engine: EngineCore, family: int, max_tokens: int) -> None:
    request = EngineCoreRequest(
        request_id=f"r{family}",
        prompt_token_ids=prompt(family),
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    engine.add_request(*engine.preprocess_add_request(request))


def run_until_idle(engine: EngineCore) -> None:
    """Step as the engine's busy loop does, until it would wait for work."""
    for _ in range(50):
        if not engine.scheduler.has_requests():
            return
        engine.step()
    raise AssertionError("the engine did not become idle in 50 steps")


class Consumers:
    """The stream as consumers see it, checked against the pools."""

    def __init__(self, engine: EngineCore, sub: Subscriber, policy: str) -> None:
        self.engine = engine
        self.sub = sub
        self.policy = policy
        self.mirror = Mirror(policy)
        sub.connect(engine.scheduler)

    def check(self) -> list:
        """Read everything published so far; the consumers must then hold
        exactly the keys of every pool. Returns the events read."""
        events = self.sub.sync(self.engine.scheduler)
        apply(self.mirror, events)
        scheduler = self.engine.scheduler
        keys = resident(scheduler.kv_cache_manager.block_pool, MEDIUM_GPU)
        connector = scheduler.get_kv_connector()
        if connector is not None:
            keys |= resident(connector.scheduler_manager.cpu_block_pool, MEDIUM_CPU)
        assert_exact(self.mirror, keys)
        seqs = self.sub.seqs
        assert all(b == a + 1 for a, b in zip(seqs, seqs[1:])), seqs
        return events

    def device_keys(self) -> set[tuple]:
        return {key for key in self.mirror.held_keys() if key[0] == MEDIUM_GPU}


def assert_reset_events(events: list, cpu_tier: bool) -> None:
    """The device pool's reset is upstream's AllBlocksCleared when it is the
    only tier in the stream, and removals by key otherwise."""
    assert events
    if not cpu_tier:
        assert [type(e) for e in events] == [AllBlocksCleared], events
    else:
        assert not any(isinstance(e, AllBlocksCleared) for e in events), events


@pytest.fixture(params=POLICIES)
def policy(request):
    return request.param


@pytest.fixture(params=[False, True], ids=["device", "cpu_tier"])
def cpu_tier(request):
    return request.param


@pytest.fixture(params=[False, True], ids=["plain", "reset_connector"])
def reset_connector(request):
    return request.param


@pytest.fixture
def consumers(model_dir, subscriber, policy, cpu_tier):  # noqa: F811
    """An engine of ``policy`` (with a CPU tier when ``cpu_tier``) and the
    consumers of its stream; the engine is shut down after the test."""
    engine = make_engine(model_dir, subscriber.endpoint, policy, cpu_tier)
    try:
        yield Consumers(engine, subscriber, policy)
    finally:
        engine.shutdown()


def test_idle_reset_is_published_before_the_call_returns(
    consumers, cpu_tier, reset_connector
):
    engine = consumers.engine
    for family in range(2):
        add_request(engine, family, max_tokens=1)
    run_until_idle(engine)
    consumers.check()
    assert consumers.mirror.held_keys()

    assert engine.reset_prefix_cache(reset_connector=reset_connector)
    assert_reset_events(consumers.check(), cpu_tier)
    assert not consumers.device_keys()
    if cpu_tier and not reset_connector:
        assert consumers.mirror.held_keys(), "the CPU tier keeps its keys"
    else:
        assert not consumers.mirror.held_keys()


def test_busy_reset_is_published_before_the_call_returns(
    consumers, cpu_tier, reset_connector
):
    engine = consumers.engine
    for family in range(2):
        add_request(engine, family, max_tokens=8)
    engine.step()
    engine.step()
    assert len(engine.scheduler.running) == 2
    assert consumers.check()

    # Refused while the running requests hold their blocks: the device keys
    # stay (with reset_connector the CPU tier still resets, as upstream's).
    device_keys = consumers.device_keys()
    assert not engine.reset_prefix_cache(reset_connector=reset_connector)
    consumers.check()
    assert consumers.device_keys() == device_keys

    # Preempting them makes the reset succeed, mid-generation.
    assert engine.reset_prefix_cache(
        reset_running_requests=True, reset_connector=reset_connector
    )
    assert_reset_events(consumers.check(), cpu_tier)
    assert not consumers.device_keys()

    # The preempted requests compute again and finish.
    run_until_idle(engine)
    consumers.check()
    assert consumers.mirror.held_keys()
