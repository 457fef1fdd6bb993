# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Duplicate prefix-cache blocks through the real v1 ``Scheduler``.

Concurrent requests with one prompt materialise their own physical copy of
each full block in the same step. The copies must keep their identities
through completion, eviction and later hits, for a full-attention model and
for a hybrid (full attention + sliding window + Mamba) one under load. Model
outputs are made up: no model runs.
"""

import json
import random

import pytest
import torch

from tests.v1.core.block_pool_view import model_runner_output
from tests.v1.core.test_duplicate_block_identity import (
    assert_index_consistent,
    block_keys,
    copies,
)
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.engine import FinishReason
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

BLOCK_SIZE = 16
EOS_TOKEN_ID = 2
SAMPLED_TOKEN_ID = 7
MAX_MODEL_LEN = 2048

# A tiny local model directory, so ModelConfig needs no model hub.
TINY_OPT_CONFIG = {
    "model_type": "opt",
    "architectures": ["OPTForCausalLM"],
    "hidden_size": 16,
    "ffn_dim": 32,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": MAX_MODEL_LEN,
    "word_embed_proj_dim": 16,
    "torch_dtype": "float16",
    "bos_token_id": EOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": 1,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_opt")
    (path / "config.json").write_text(json.dumps(TINY_OPT_CONFIG))
    return str(path)


def tiny_model_config(model_dir: str) -> ModelConfig:
    """The ModelConfig of ``model_dir`` (``TINY_OPT_CONFIG``); no tokenizer."""
    return ModelConfig(
        model=model_dir,
        dtype="float16",
        seed=42,
        skip_tokenizer_init=True,
        max_model_len=MAX_MODEL_LEN,
    )


@pytest.fixture(autouse=True)
def _init_none_hash():
    init_none_hash(sha256)


def full_attention_spec() -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
    )


def hybrid_specs() -> list[KVCacheSpec]:
    """Full attention, sliding window and Mamba groups, as upstream's
    ``make_kv_cache_config_three_types`` builds them."""
    return [
        full_attention_spec(),
        SlidingWindowSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=1,
            dtype=torch.float32,
            sliding_window=2 * BLOCK_SIZE,
        ),
        MambaSpec(
            block_size=BLOCK_SIZE,
            shapes=((1, 1),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
        ),
    ]


def make_scheduler(
    model_dir: str,
    specs: list[KVCacheSpec],
    num_blocks: int,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 1024,
) -> Scheduler:
    has_mamba = any(isinstance(spec, MambaSpec) for spec in specs)
    model_config = tiny_model_config(model_dir)
    cache_kwargs = {"mamba_cache_mode": "align"} if has_mamba else {}
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            watermark=0.0,
        ),
        model_config=model_config,
        # The scheduler runs no model; do not probe for an accelerator.
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(
            block_size=BLOCK_SIZE, enable_prefix_caching=True, **cache_kwargs
        ),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
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


def make_request(request_id: str, token_ids: list[int], max_tokens: int) -> Request:
    sampling_params = SamplingParams(ignore_eos=True, max_tokens=max_tokens)
    sampling_params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=request_id,
        prompt_token_ids=token_ids,
        sampling_params=sampling_params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def pool_of(scheduler: Scheduler) -> BlockPool:
    return scheduler.kv_cache_manager.block_pool


def step(scheduler: Scheduler) -> tuple[SchedulerOutput, list]:
    """Schedule once and feed back a made-up model output: one sampled token
    for each request whose scheduled tokens reach the end of its sequence."""
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([SAMPLED_TOKEN_ID] if done else [])
    model_output = model_runner_output(req_ids, sampled)
    engine_outputs = scheduler.update_from_output(output, model_output)
    finished = [
        out
        for outputs in engine_outputs.values()
        for out in outputs.outputs
        if out.finish_reason is not None
    ]
    return output, finished


def run_until_done(scheduler: Scheduler, max_steps: int = 1000) -> list:
    finished = []
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return finished
        finished.extend(step(scheduler)[1])
        assert_index_consistent(pool_of(scheduler))
    raise AssertionError("requests did not finish")


def fa_blocks(scheduler: Scheduler, request_id: str):
    """The request's full-attention (group 0) blocks."""
    return scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[
        request_id
    ]


def test_concurrent_duplicates_survive_eviction_and_serve_hits(model_dir):
    """The kvcached #401 scenario end to end.

    Two requests with one prompt share its full blocks, but each computes its
    own partial tail block; decoding the same tokens fills both tails at the
    same step, so two physical blocks materialise the same key before either
    is reusable.
    """
    scheduler = make_scheduler(model_dir, [full_attention_spec()], num_blocks=16)
    pool = pool_of(scheduler)
    # Two full blocks and half a block; 8 decoded tokens fill the tail.
    prompt = list(range(100, 100 + 2 * BLOCK_SIZE + 8))
    a = make_request("a", prompt, max_tokens=10)
    b = make_request("b", prompt, max_tokens=10)
    scheduler.add_request(a)
    scheduler.add_request(b)

    # Run until both tails are full and cached: 8 decode steps after the
    # prefill, which each request computes in the same steps.
    for _ in range(9):
        step(scheduler)
        assert_index_consistent(pool)
    assert a.num_computed_tokens == b.num_computed_tokens == 3 * BLOCK_SIZE
    assert fa_blocks(scheduler, "a")[:2] == fa_blocks(scheduler, "b")[:2]
    a_tail, b_tail = fa_blocks(scheduler, "a")[2], fa_blocks(scheduler, "b")[2]
    key = a_tail.block_hash
    assert key is not None and b_tail.block_hash == key
    assert a_tail.block_id != b_tail.block_id
    assert a_tail.ref_cnt == b_tail.ref_cnt == 1
    assert copies(pool, key).keys() == {a_tail.block_id, b_tail.block_id}

    finished = run_until_done(scheduler)
    assert sorted(out.request_id for out in finished) == ["a", "b"]
    assert [out.finish_reason for out in finished] == [FinishReason.LENGTH] * 2
    assert a_tail.ref_cnt == b_tail.ref_cnt == 0
    assert copies(pool, key).keys() == {a_tail.block_id, b_tail.block_id}

    # Cache pressure: a filler prompt takes every free block up to the first
    # freed tail copy, so exactly one copy of the key goes.
    free_order = [
        block.block_id for block in pool.free_block_queue.get_all_free_blocks()
    ]
    first, second = sorted((a_tail, b_tail), key=lambda b: free_order.index(b.block_id))
    num_filler_blocks = free_order.index(first.block_id) + 1
    filler = make_request(
        "filler",
        list(range(500, 500 + num_filler_blocks * BLOCK_SIZE - 1)),
        max_tokens=1,
    )
    scheduler.add_request(filler)
    run_until_done(scheduler)
    assert key not in block_keys(pool, first)
    assert second.block_hash == key
    assert copies(pool, key) == {second.block_id: second}

    # The surviving copy serves the next request with this prefix.
    c = make_request("c", prompt + [SAMPLED_TOKEN_ID] * 9, max_tokens=1)
    scheduler.add_request(c)
    output, _ = step(scheduler)
    [new_req] = output.scheduled_new_reqs
    assert new_req.num_computed_tokens == 3 * BLOCK_SIZE
    assert new_req.block_ids[0][2] == second.block_id
    run_until_done(scheduler)
    assert_index_consistent(pool)


@pytest.mark.parametrize("seed", [0, 1])
def test_hybrid_many_concurrent_shared_prompts(model_dir, seed):
    """Full attention + sliding window + Mamba under load: many concurrent
    requests with shared block-aligned prompts and cache pressure."""
    rng = random.Random(seed)
    scheduler = make_scheduler(
        model_dir,
        hybrid_specs(),
        num_blocks=120,
        max_num_seqs=12,
        max_num_batched_tokens=256,
    )
    pool = pool_of(scheduler)
    families = [
        list(range(1000 * f, 1000 * f + rng.choice([2, 3, 4]) * BLOCK_SIZE))
        for f in range(1, 5)
    ]
    num_requests = 60
    pending = []
    for i in range(num_requests):
        prompt = list(rng.choice(families))
        if rng.random() < 0.5:
            # A private tail after the shared block-aligned prefix.
            prompt += [900 + i] * rng.randrange(1, 2 * BLOCK_SIZE)
        pending.append(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 6)))

    finished = []
    max_copies = 0
    seen_copies = set()
    for _ in range(2000):
        # Arrivals in bursts, so requests with one prompt run concurrently.
        for _ in range(rng.randrange(0, 5)):
            if pending:
                scheduler.add_request(pending.pop(0))
        if not pending and not scheduler.has_requests():
            break
        finished.extend(step(scheduler)[1])
        assert_index_consistent(pool)
        resident = pool.cached_block_hash_to_block.resident_keys
        seen_copies.update((key, b) for key in resident for b in copies(pool, key))
        max_copies = max([max_copies] + [len(copies(pool, key)) for key in resident])
    else:
        raise AssertionError("requests did not finish")

    assert len(finished) == num_requests
    assert all(out.finish_reason == FinishReason.LENGTH for out in finished)
    # The load did materialise duplicates and did evict copies.
    assert max_copies >= 2
    resident = pool.cached_block_hash_to_block.resident_keys
    assert seen_copies - {(key, b) for key in resident for b in copies(pool, key)}
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
