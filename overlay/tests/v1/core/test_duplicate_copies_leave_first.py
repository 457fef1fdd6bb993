# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A freed copy whose key stays resident leaves the prefix cache first.

Every repeat of a block-aligned prompt recomputes its last block into a new
physical copy of the same ``(block_hash, group)`` key. When a request frees a
copy and another copy of the key stays resident, the pool keeps one copy at
the recency of the key's latest use (a copy in use, else the copy freed last)
and puts the other free copies at the front of the free queue, so they are
evicted before unique prefixes. Eviction drops the exact ``block_id``; the key
stays resident, so only "physical" copy semantics announce the removal.
"""

import pytest

from vllm.distributed.kv_events import BlockRemoved
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

BLOCK_SIZE = 4
NUM_BLOCKS = 12
PROMPT = [1, 2, 3, 4]


@pytest.fixture(autouse=True)
def _init_none_hash():
    init_none_hash(sha256)


def make_pool(copy_semantics: str = "logical") -> BlockPool:
    return BlockPool(
        num_gpu_blocks=NUM_BLOCKS,
        enable_caching=True,
        hash_block_size=BLOCK_SIZE,
        enable_kv_cache_events=True,
        kv_events_copy_semantics=copy_semantics,
    )


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=token_ids,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def compute(pool: BlockPool, request_id: str, token_ids: list[int]) -> KVCacheBlock:
    """A request computes its one-block prompt into a new block and caches it
    (what the last block of a repeated block-aligned prompt gets)."""
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(make_request(request_id, token_ids), [block], 0, 1, 4, 0)
    return block


def free_order(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def block_hash_of(token_ids: list[int]):
    return make_request("key", token_ids).block_hashes[0]


def resident_copies(pool: BlockPool, token_ids: list[int]) -> set[int]:
    key = make_block_hash_with_group_id(block_hash_of(token_ids), 0)
    blocks = pool.cached_block_hash_to_block._cache.get(key)
    if blocks is None:
        return set()
    if isinstance(blocks, KVCacheBlock):
        return {blocks.block_id}
    return set(blocks)


@pytest.mark.parametrize("copy_semantics", ["logical", "last_copy", "physical"])
def test_freed_copy_leaves_first_while_another_copy_is_in_use(copy_semantics):
    pool = make_pool(copy_semantics)
    a = compute(pool, "a", PROMPT)
    b = compute(pool, "b", PROMPT)
    unique = compute(pool, "u", [5, 6, 7, 8])
    pool.free_blocks([unique])
    pool.free_blocks([a])
    # b (in use) keeps the key; the free copy a is evicted before anything,
    # even the unique prefix freed earlier.
    assert free_order(pool)[0] == a.block_id
    assert free_order(pool)[-1] == unique.block_id
    # A hit still takes the copy in use.
    assert pool.get_cached_block(block_hash_of(PROMPT), [0]) == [b]
    pool.take_events()

    assert pool.get_new_blocks(1) == [a]
    assert a.block_hash is None
    assert resident_copies(pool, PROMPT) == {b.block_id}
    assert resident_copies(pool, [5, 6, 7, 8]) == {unique.block_id}
    removed = [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    if copy_semantics == "physical":
        assert [e.block_hashes for e in removed] == [
            [maybe_convert_block_hash(block_hash_of(PROMPT))]
        ]
    else:
        assert removed == []


def test_latest_freed_copy_keeps_the_key_recency():
    pool = make_pool()
    a = compute(pool, "a", PROMPT)
    pool.free_blocks([a])
    # A repeat of the prompt recomputes its last block into a second copy.
    b = compute(pool, "b", PROMPT)
    unique = compute(pool, "u", [5, 6, 7, 8])
    pool.free_blocks([unique])
    pool.free_blocks([b])
    order = free_order(pool)
    # b keeps the key at the recency of its latest use; the older free copy
    # a leaves first instead of ageing out ahead of the unique prefix.
    assert order[0] == a.block_id
    assert order[-2:] == [unique.block_id, b.block_id]
    assert pool.get_new_blocks(1) == [a]
    assert resident_copies(pool, PROMPT) == {b.block_id}


def test_copies_freed_in_one_call():
    pool = make_pool()
    a = compute(pool, "a", PROMPT)
    b = compute(pool, "b", PROMPT)
    c = compute(pool, "c", PROMPT)
    unique = compute(pool, "u", [5, 6, 7, 8])
    pool.free_blocks([unique])
    num_free = pool.get_num_free_blocks()
    # Eviction order: a, then b, then c. c keeps the key's place; the two
    # others go to the front, in that order.
    pool.free_blocks([a, b, c])
    assert pool.get_num_free_blocks() == num_free + 3
    order = free_order(pool)
    assert order[:2] == [a.block_id, b.block_id]
    assert order[-2:] == [unique.block_id, c.block_id]
    assert pool.get_new_blocks(2) == [a, b]
    assert resident_copies(pool, PROMPT) == {c.block_id}


def test_copy_freed_after_a_hit_keeps_the_key_recency():
    pool = make_pool()
    a = compute(pool, "a", PROMPT)
    b = compute(pool, "b", PROMPT)
    pool.free_blocks([a])
    pool.free_blocks([b])
    assert free_order(pool)[0] == a.block_id
    # A hit with no copy in use takes the first copy (a) out of the queue;
    # freed again, a is the latest use and b goes to the front.
    (hit,) = pool.get_cached_block(block_hash_of(PROMPT), [0])
    assert hit is a
    pool.touch([a])
    unique = compute(pool, "u", [5, 6, 7, 8])
    pool.free_blocks([unique])
    pool.free_blocks([a])
    order = free_order(pool)
    assert order[0] == b.block_id
    assert order[-2:] == [unique.block_id, a.block_id]
