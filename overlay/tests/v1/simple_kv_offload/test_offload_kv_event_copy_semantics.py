# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV events of the simple CPU offload manager's CPU pool: copies and reset.

Two GPU copies of one key whose stores complete together become two CPU
copies of that key. Per ``KVEventsConfig.copy_semantics`` the CPU medium then
gets one ``BlockStored`` ("logical") or one per copy ("last_copy",
"physical", as upstream), and one ``BlockRemoved`` when the last copy leaves
("logical", "last_copy") or one per copy ("physical"). A reset of the CPU
tier removes its keys under its medium instead of clearing every tier.

The model config comes from a local directory, so no model hub is needed.
"""

import json

import pytest

from tests.v1.core.test_duplicate_block_identity_scheduler import (
    MAX_MODEL_LEN,
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
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request
from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

POLICIES = KV_EVENTS_COPY_SEMANTICS


@pytest.fixture(autouse=True)
def _init_none_hash():
    init_none_hash(sha256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_opt")
    (path / "config.json").write_text(json.dumps(TINY_OPT_CONFIG))
    return str(path)


def make_offload_scheduler(
    model_dir: str, policy: str, num_gpu_blocks: int = 8, num_cpu_blocks: int = 4
) -> tuple[SimpleCPUOffloadScheduler, BlockPool]:
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=64,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        model_config=tiny_model_config(model_dir),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both"
        ),
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, copy_semantics=policy
        ),
        device_config=DeviceConfig("cpu"),
    )
    scheduler = SimpleCPUOffloadScheduler(
        vllm_config=vllm_config,
        kv_cache_config=_make_kv_cache_config(num_gpu_blocks),
        cpu_capacity_bytes=_BYTES_PER_BLOCK * num_cpu_blocks,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        lazy_offload=False,
    )
    gpu_pool = BlockPool(
        num_gpu_blocks=num_gpu_blocks,
        enable_caching=True,
        hash_block_size=BLOCK_SIZE,
    )
    scheduler.bind_gpu_block_pool(gpu_pool)
    return scheduler, gpu_pool


def one_block_request(request_id: str) -> Request:
    """A request whose first (only full) block has the same key every time."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(BLOCK_SIZE + 1)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def count_target(events, event_type, target) -> int:
    return sum(
        e.block_hashes.count(target)
        for e in events
        if isinstance(e, event_type) and e.medium == MEDIUM_CPU
    )


def store_two_copies(scheduler: SimpleCPUOffloadScheduler, gpu_pool: BlockPool):
    """Two GPU copies of one key, as two requests computing one prompt in the
    same step leave them, whose stores complete together: two CPU copies.

    Returns the key and the CPU blocks.
    """
    gpu_blocks = []
    for request_id in ("r0", "r1"):
        request = one_block_request(request_id)
        blocks = gpu_pool.get_new_blocks(1)
        gpu_pool.cache_full_blocks(request, blocks, 0, 1, BLOCK_SIZE, 0)
        gpu_blocks += blocks
    key = gpu_blocks[0].block_hash
    assert key == make_block_hash_with_group_id(request.block_hashes[0], 0)
    assert gpu_blocks[1].block_hash == key
    cpu_blocks = scheduler.cpu_block_pool.get_new_blocks(2)
    scheduler._process_store_completion(
        [b.block_id for b in gpu_blocks], [b.block_id for b in cpu_blocks]
    )
    assert scheduler.cpu_block_pool.cached_block_hash_to_block.num_copies(key) == 2
    return key, cpu_blocks


@pytest.mark.parametrize("policy", POLICIES)
def test_cpu_copies_follow_copy_semantics(model_dir, policy):
    scheduler, gpu_pool = make_offload_scheduler(model_dir, policy)
    cpu_pool = scheduler.cpu_block_pool
    assert cpu_pool.kv_events_copy_semantics == policy

    key, cpu_blocks = store_two_copies(scheduler, gpu_pool)
    target = maybe_convert_block_hash(get_block_hash(key))
    stored = list(scheduler.take_events())
    assert count_target(stored, BlockStored, target) == (
        1 if policy == "logical" else 2
    )

    # Evict one CPU copy, then the other.
    removed_after = []
    for block in cpu_blocks:
        cpu_pool.evict_blocks({block.block_id})
        removed_after.append(
            count_target(scheduler.take_events(), BlockRemoved, target)
        )
    assert cpu_pool.cached_block_hash_to_block.num_copies(key) == 0
    assert removed_after == ([1, 1] if policy == "physical" else [0, 1])


@pytest.mark.parametrize("policy", POLICIES)
def test_cpu_reset_removes_its_keys_under_its_medium(model_dir, policy):
    """The connector resets even when the device pool refuses, so the CPU
    tier's reset must not publish AllBlocksCleared (no medium: consumers
    would drop the device tier's keys too)."""
    scheduler, gpu_pool = make_offload_scheduler(model_dir, policy)
    key, _ = store_two_copies(scheduler, gpu_pool)
    target = maybe_convert_block_hash(get_block_hash(key))
    list(scheduler.take_events())

    assert scheduler.reset()
    events = list(scheduler.take_events())
    assert not [e for e in events if isinstance(e, AllBlocksCleared)]
    assert count_target(events, BlockRemoved, target) == (
        2 if policy == "physical" else 1
    )
    assert not scheduler.cpu_block_pool.cached_block_hash_to_block.resident_keys
