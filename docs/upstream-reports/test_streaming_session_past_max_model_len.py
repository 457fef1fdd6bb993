# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A streaming-input session must not be scheduled past ``max_model_len``.

The front door checks each streaming chunk on its own
(``InputProcessor._validate_prompt_len``), but ``Scheduler`` appends each
chunk to the session (``_update_request_as_session``) without checking the
session's total length. A session that grows past ``max_model_len`` is then
scheduled whole: ``KVCacheManager.allocate_slots`` caps the slots at
``max_model_len`` but caches up to ``request.num_tokens``, so with KV events
``BlockPool.cache_full_blocks`` reads past the request's blocks (IndexError);
without events the step schedules tokens that have no KV slot.

Real Scheduler, full attention + sliding window (16-token blocks), no model.
"""

import json

import pytest
import torch

from tests.v1.core.block_pool_view import model_runner_output
from tests.v1.core.test_duplicate_block_identity_scheduler import (
    BLOCK_SIZE,
    EOS_TOKEN_ID,
    MAX_MODEL_LEN,
    SAMPLED_TOKEN_ID,
    TINY_OPT_CONFIG,
    tiny_model_config,
)
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.config.kv_events import KVEventsConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

SESSION_ID = "session"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_opt")
    (path / "config.json").write_text(json.dumps(TINY_OPT_CONFIG))
    return str(path)


def make_scheduler(model_dir: str, enable_kv_cache_events: bool) -> Scheduler:
    init_none_hash(sha256)
    model_config = tiny_model_config(model_dir)
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=4096,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            watermark=0.0,
        ),
        model_config=model_config,
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=enable_kv_cache_events, publisher="null"
        ),
    )
    num_blocks = 600
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    specs = [
        FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
        ),
        SlidingWindowSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=1,
            dtype=torch.float32,
            sliding_window=BLOCK_SIZE,
        ),
    ]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)
        ],
    )
    register_all_kvcache_specs(vllm_config)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        log_stats=True,
    )


def streaming_chunk(start: int, num_tokens: int) -> Request:
    """One input chunk of the session, as ``AsyncLLM`` sends it: each chunk
    alone is shorter than ``max_model_len``."""
    sampling_params = SamplingParams(ignore_eos=True, max_tokens=1)
    sampling_params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=SESSION_ID,
        prompt_token_ids=[t % 997 + 3 for t in range(start, start + num_tokens)],
        sampling_params=sampling_params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        resumable=True,
    )


def run_chunk(scheduler: Scheduler) -> None:
    """Step until the session has consumed its current chunk."""
    for _ in range(20):
        session = scheduler.requests.get(SESSION_ID)
        if (
            session is None
            or session.status in (RequestStatus.WAITING_FOR_STREAMING_REQ,)
            or session.is_finished()
        ):
            return
        output = scheduler.schedule()
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            # No token is ever scheduled without a KV slot inside the model.
            assert request.num_computed_tokens <= MAX_MODEL_LEN
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([SAMPLED_TOKEN_ID] if done else [])
        scheduler.update_from_output(output, model_runner_output(req_ids, sampled))
    pytest.fail("the session made no progress")


@pytest.mark.parametrize("enable_kv_cache_events", [True, False])
def test_streaming_session_stops_at_max_model_len(model_dir, enable_kv_cache_events):
    scheduler = make_scheduler(model_dir, enable_kv_cache_events)
    first = 2000  # < MAX_MODEL_LEN: accepted by the front door
    scheduler.add_request(streaming_chunk(0, first))
    run_chunk(scheduler)
    session = scheduler.requests[SESSION_ID]
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ

    # The second chunk alone is also valid, but the session would reach
    # 4000 tokens: more than MAX_MODEL_LEN.
    scheduler.add_request(streaming_chunk(first, 2000))
    run_chunk(scheduler)

    # However the fix ends the session (an error or a length cap), the
    # scheduler never computed past max_model_len and the session is over.
    assert session.num_computed_tokens <= MAX_MODEL_LEN
    assert session.is_finished() or SESSION_ID not in scheduler.requests
