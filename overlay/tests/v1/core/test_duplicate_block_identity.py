# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every physical copy of a ``(block_hash, group)`` key keeps its identity.

Concurrent requests with the same prompt each materialise their own physical
block for the same key before either block is reusable. The prefix-cache index
must keep every such copy: each one owns its ``block_hash`` and its entry in
``BlockHashToBlockMap``, and removal, eviction and reset act on the exact
``block_id``. A lookup must only ever return a copy that is still cached, and a
block reused for another prefix must carry no stale hash.
"""

import random

import pytest
import torch

from tests.v1.core.block_pool_view import copies, new_block_map
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    KVCacheBlock,
    get_block_hash,
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.core.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

BLOCK_SIZE = 4


@pytest.fixture(autouse=True)
def _init_none_hash():
    init_none_hash(sha256)


def make_request(
    request_id: str, token_ids: list[int], hash_block_size: int = BLOCK_SIZE
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=token_ids,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(hash_block_size, sha256),
    )


def block_keys(pool: BlockPool, block: KVCacheBlock) -> set[BlockHashWithGroupId]:
    """Every key ``block`` claims: its primary hash and secondary entries."""
    keys = set(pool.cached_block_hashes_by_block.get(block.block_id, ()))
    if block.block_hash is not None:
        keys.add(block.block_hash)
    return keys


def assert_index_consistent(pool: BlockPool) -> None:
    """The forward index and every block's own hashes agree exactly."""
    index = pool.cached_block_hash_to_block.resident_keys
    indexed: dict[int, set[BlockHashWithGroupId]] = {}
    for key in index:
        entries = copies(pool, key)
        assert entries, f"{key!r} maps to no block"
        for block_id, block in entries.items():
            assert block.block_id == block_id
            assert block is pool.blocks[block_id]
            indexed.setdefault(block_id, set()).add(key)
    for block in pool.blocks:
        assert block_keys(pool, block) == indexed.get(block.block_id, set()), (
            f"block {block.block_id} claims {block_keys(pool, block)} but the "
            f"index holds it under {indexed.get(block.block_id, set())}"
        )
        if block.block_id not in indexed:
            assert block.block_hash_num_tokens is None


def full_attention_manager(pool: BlockPool) -> SingleTypeKVCacheManager:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    return FullAttentionManager(
        spec,
        block_pool=pool,
        enable_caching=True,
        kv_cache_group_id=0,
        scheduler_block_size=BLOCK_SIZE,
    )


def _windowed_manager(
    pool: BlockPool, spec_cls: type, manager_cls: type, **window: int
) -> SingleTypeKVCacheManager:
    """A sliding-window or chunked-local manager with a two-block window."""
    spec = spec_cls(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        **window,
    )
    return manager_cls(
        spec,
        block_pool=pool,
        enable_caching=True,
        kv_cache_group_id=0,
        scheduler_block_size=BLOCK_SIZE,
        max_admission_blocks_per_request=10**9,
    )


def sliding_window_manager(pool: BlockPool) -> SingleTypeKVCacheManager:
    return _windowed_manager(
        pool, SlidingWindowSpec, SlidingWindowManager, sliding_window=2 * BLOCK_SIZE
    )


def chunked_local_manager(pool: BlockPool) -> SingleTypeKVCacheManager:
    return _windowed_manager(
        pool,
        ChunkedLocalAttentionSpec,
        ChunkedLocalAttentionManager,
        attention_chunk_size=2 * BLOCK_SIZE,
    )


def mamba_manager(pool: BlockPool) -> SingleTypeKVCacheManager:
    spec = MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=((1, 1),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
        num_speculative_blocks=0,
    )
    return MambaManager(
        spec,
        block_pool=pool,
        enable_caching=True,
        kv_cache_group_id=0,
        scheduler_block_size=BLOCK_SIZE,
    )


MANAGERS = {
    "full_attention": full_attention_manager,
    "sliding_window": sliding_window_manager,
    "chunked_local": chunked_local_manager,
    "mamba_align": mamba_manager,
}


def compute_prompt(manager: SingleTypeKVCacheManager, request: Request) -> None:
    """Allocate and cache ``request``'s whole prompt in one step, as the
    scheduler does for a prefill with no prefix-cache hit."""
    num_tokens = request.num_tokens
    manager.allocate_new_blocks(request.request_id, num_tokens, num_tokens)
    manager.cache_blocks(request, num_tokens, replay_boundaries=[])
    request.num_computed_tokens = num_tokens


def hashed_blocks(
    manager: SingleTypeKVCacheManager, request_id: str
) -> dict[int, KVCacheBlock]:
    """Position -> block, for the request's blocks that carry a hash."""
    return {
        i: block
        for i, block in enumerate(manager.req_to_blocks[request_id])
        if not block.is_null and block.block_hash is not None
    }


def materialise_duplicates(manager_name: str, num_copies: int = 2):
    """``num_copies`` requests with one prompt computed in the same step, so
    none of them could hit another's blocks."""
    pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=4)
    manager = MANAGERS[manager_name](pool)
    prompt = list(range(4 * BLOCK_SIZE))
    requests = [make_request(f"r{i}", prompt) for i in range(num_copies)]
    for request in requests:
        compute_prompt(manager, request)
    if isinstance(manager, MambaManager):
        manager.new_step_starts()
    return pool, manager, requests


# --------------------------------------------------------------------------
# Invariant 1: a second physical block for an existing key keeps its own
# block_hash and its own reverse-index entry.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("manager_name", list(MANAGERS))
@pytest.mark.parametrize("num_copies", [2, 3])
def test_each_copy_keeps_its_hash_and_index_entry(manager_name, num_copies):
    pool, manager, requests = materialise_duplicates(manager_name, num_copies)
    per_request = [hashed_blocks(manager, r.request_id) for r in requests]
    assert per_request[0], "the prompt cached no block"
    # Every request cached the same positions, each with its own blocks.
    assert all(blocks.keys() == per_request[0].keys() for blocks in per_request)
    for pos in per_request[0]:
        blocks = [blocks[pos] for blocks in per_request]
        assert len({b.block_id for b in blocks}) == num_copies
        key = blocks[0].block_hash
        assert all(b.block_hash == key for b in blocks)
        assert copies(pool, key) == {b.block_id: b for b in blocks}
        for block in blocks:
            assert pool.cached_block_hash_to_block.contain(key, block.block_id)
    assert_index_consistent(pool)


def test_block_hash_to_block_map_keeps_every_copy():
    pool_blocks = [KVCacheBlock(block_id=i) for i in range(4)]
    index = new_block_map(pool_blocks)
    key = make_block_hash_with_group_id(BlockHash(b"k"), 0)
    blocks = pool_blocks[1:]
    for block in blocks:
        index.insert(key, block)
    for block in blocks:
        assert index.contain(key, block.block_id)
    # Re-inserting a resident copy is idempotent, not a new copy.
    index.insert(key, blocks[0])
    assert index.num_copies(key) == 3
    # Another group is another key.
    other = make_block_hash_with_group_id(BlockHash(b"k"), 1)
    assert index.get_one_block(other) is None
    assert not index.contain(other, blocks[0].block_id)


def test_promotion_of_one_copy_keeps_the_sibling():
    """Partial->full promotion re-keys only the promoted physical block."""
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=2)
    prompt = list(range(BLOCK_SIZE))
    # hash_block_size 2 < block_size 4: each block also has a partial entry.
    r0, r1 = make_request("r0", prompt, 2), make_request("r1", prompt, 2)
    [b0] = pool.get_new_blocks(1)
    [b1] = pool.get_new_blocks(1)
    partial = pool.cache_partial_block(r0, b0, 2, 0, BLOCK_SIZE)
    assert pool.cache_partial_block(r1, b1, 2, 0, BLOCK_SIZE) == partial
    assert copies(pool, partial).keys() == {b0.block_id, b1.block_id}
    pool.cache_full_blocks(r0, [b0], 0, 1, BLOCK_SIZE, 0)
    full_key = b0.block_hash
    assert full_key != partial
    assert copies(pool, partial) == {b1.block_id: b1}
    assert copies(pool, full_key) == {b0.block_id: b0}
    assert b1.block_hash == partial
    assert_index_consistent(pool)


# --------------------------------------------------------------------------
# Invariant 2: removal, eviction and reset act on the exact block_id.
# --------------------------------------------------------------------------


def _free_all(manager: SingleTypeKVCacheManager, requests: list[Request]) -> None:
    for request in requests:
        manager.free(request.request_id)


def _evict_by_reuse(pool: BlockPool, victims: list[KVCacheBlock]) -> None:
    """Evict ``victims`` the way allocation pressure does: take blocks from the
    free queue until the pool has handed every victim out for new contents.
    Only unhashed blocks may come out before them."""
    pending = {block.block_id for block in victims}
    taken = []
    while pending:
        [block] = pool.get_new_blocks(1)
        assert block.block_id in pending or not block_keys(pool, block)
        pending.discard(block.block_id)
        taken.append(block)
    pool.free_blocks(taken)


def _evict_each(evict):
    def run(pool: BlockPool, victims: list[KVCacheBlock]) -> None:
        for block in victims:
            evict(pool, block)

    return run


EVICTIONS = {
    "allocation": _evict_by_reuse,
    "evict_blocks": _evict_each(lambda pool, b: pool.evict_blocks({b.block_id})),
    "maybe_evict": _evict_each(lambda pool, b: pool._maybe_evict_cached_block(b)),
}


@pytest.mark.parametrize("manager_name", list(MANAGERS))
@pytest.mark.parametrize("eviction", list(EVICTIONS))
@pytest.mark.parametrize("victim", [0, 1])
def test_evicting_one_copy_leaves_the_sibling(manager_name, eviction, victim):
    pool, manager, requests = materialise_duplicates(manager_name)
    evicted_blocks = hashed_blocks(manager, requests[victim].request_id)
    kept_blocks = hashed_blocks(manager, requests[1 - victim].request_id)
    keys = {pos: block.block_hash for pos, block in evicted_blocks.items()}
    # The copy freed first is the one allocation pressure reaches first.
    _free_all(manager, [requests[victim], requests[1 - victim]])
    EVICTIONS[eviction](pool, list(evicted_blocks.values()))
    for pos, block in evicted_blocks.items():
        key = keys[pos]
        assert block.block_hash is None
        assert not pool.cached_block_hash_to_block.contain(key, block.block_id)
        sibling = kept_blocks[pos]
        assert sibling.block_hash == key
        assert copies(pool, key) == {sibling.block_id: sibling}
        assert pool.get_cached_block(get_block_hash(key), [0]) == [sibling]
        assert_index_consistent(pool)


@pytest.mark.parametrize("manager_name", list(MANAGERS))
def test_evicting_a_copy_in_use_leaves_the_sibling(manager_name):
    """A connector may evict a block a request still holds (ref_cnt > 0)."""
    pool, manager, requests = materialise_duplicates(manager_name)
    victims = hashed_blocks(manager, requests[0].request_id)
    siblings = hashed_blocks(manager, requests[1].request_id)
    pool.evict_blocks({b.block_id for b in victims.values()})
    for pos, sibling in siblings.items():
        assert victims[pos].block_hash is None
        assert victims[pos].ref_cnt == 1
        assert pool.get_cached_block(get_block_hash(sibling.block_hash), [0]) == [
            sibling
        ]
    assert_index_consistent(pool)


def test_pop_removes_only_the_given_block_id():
    pool_blocks = [KVCacheBlock(block_id=i) for i in range(4)]
    index = new_block_map(pool_blocks)
    key = make_block_hash_with_group_id(BlockHash(b"k"), 0)
    blocks = pool_blocks[1:]
    for block in blocks:
        index.insert(key, block)
    # A block id the key does not hold changes nothing.
    assert index.pop(key, 99) is None
    assert all(index.contain(key, b.block_id) for b in blocks)
    assert index.pop(key, 2) is blocks[1]
    assert not index.contain(key, 2)
    assert index.contain(key, 1) and index.contain(key, 3)
    assert index.pop(key, 1) is blocks[0]
    assert index.get_one_block(key) is blocks[2]
    assert index.pop(key, 3) is blocks[2]
    assert index.get_one_block(key) is None
    assert len(index) == 0


def test_move_block_hashes_moves_only_the_source_copy():
    pool, manager, requests = materialise_duplicates("full_attention")
    source = hashed_blocks(manager, requests[0].request_id)[0]
    sibling = hashed_blocks(manager, requests[1].request_id)[0]
    key = source.block_hash
    [target] = pool.get_new_blocks(1)
    pool.move_block_hashes(source, target)
    assert source.block_hash is None
    assert target.block_hash == key and sibling.block_hash == key
    assert copies(pool, key) == {sibling.block_id: sibling, target.block_id: target}
    assert_index_consistent(pool)


@pytest.mark.parametrize("manager_name", list(MANAGERS))
def test_reset_clears_every_copy(manager_name):
    pool, manager, requests = materialise_duplicates(manager_name)
    all_blocks = [
        block
        for request in requests
        for block in hashed_blocks(manager, request.request_id).values()
    ]
    _free_all(manager, requests)
    assert pool.reset_prefix_cache()
    assert all(block.block_hash is None for block in all_blocks)
    assert len(pool.cached_block_hash_to_block) == 0
    assert not pool.cached_block_hashes_by_block
    assert_index_consistent(pool)


# --------------------------------------------------------------------------
# Invariant 3: a look-up returns a copy that is still cached.
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "manager_name", ["full_attention", "sliding_window", "chunked_local"]
)
def test_cache_hit_after_eviction_returns_the_live_copy(manager_name):
    pool, manager, requests = materialise_duplicates(manager_name)
    first = hashed_blocks(manager, requests[0].request_id)
    second = hashed_blocks(manager, requests[1].request_id)
    _free_all(manager, requests)
    # Evict the copy inserted first: the one a look-up used to return.
    _evict_by_reuse(pool, list(first.values()))
    request = requests[0]
    hit_blocks, hit_length = manager.find_longest_cache_hit(
        block_hashes=request.block_hashes,
        # Stop inside the last chunk so chunked local attention needs a block.
        max_length=request.num_tokens - 1,
        kv_cache_group_ids=[0],
        block_pool=pool,
        kv_cache_spec=manager.kv_cache_spec,
        drop_eagle_block=False,
        alignment_tokens=BLOCK_SIZE,
    )
    assert hit_length > 0
    hit = [b for b in hit_blocks[0] if not b.is_null]
    assert hit
    for block in hit:
        assert block.block_hash is not None
        assert block in second.values()


@pytest.mark.parametrize("seed", range(6))
def test_lookups_only_return_cached_copies(seed):
    """Random caching, freeing, eviction and reuse of duplicated keys."""
    rng = random.Random(seed)
    pool = BlockPool(num_gpu_blocks=12, enable_caching=True, hash_block_size=4)
    manager = full_attention_manager(pool)
    prompts = [list(range(p * 100, p * 100 + 2 * BLOCK_SIZE)) for p in range(3)]
    keys = set()
    running: list[Request] = []
    for step in range(300):
        op = rng.random()
        if op < 0.45 and pool.get_num_free_blocks() >= 2:
            request = make_request(f"s{step}", rng.choice(prompts))
            compute_prompt(manager, request)
            keys.update(
                b.block_hash
                for b in hashed_blocks(manager, request.request_id).values()
            )
            running.append(request)
        elif op < 0.8 and running:
            manager.free(running.pop(rng.randrange(len(running))).request_id)
        elif op < 0.9:
            pool.evict_blocks({rng.randrange(1, pool.num_gpu_blocks)})
        elif pool.get_num_free_blocks():
            pool.free_blocks(pool.get_new_blocks(1))
        for key in keys:
            block = pool.cached_block_hash_to_block.get_one_block(key)
            if block is not None:
                assert key in block_keys(pool, block)
            hit = pool.get_cached_block(get_block_hash(key), [0])
            assert hit is None or hit == [block]
        assert_index_consistent(pool)


@pytest.mark.parametrize("manager_name", list(MANAGERS))
def test_hit_prefers_a_copy_in_use(manager_name):
    """A hit on a key with a free and a referenced copy takes the referenced
    one, so the free duplicate stays in the free queue to age out."""
    pool, manager, requests = materialise_duplicates(manager_name)
    first = hashed_blocks(manager, requests[0].request_id)
    second = hashed_blocks(manager, requests[1].request_id)
    # The copies inserted first go back to the free queue.
    manager.free(requests[0].request_id)
    num_free = pool.get_num_free_blocks()
    for pos, block in second.items():
        hit = pool.get_cached_block(get_block_hash(block.block_hash), [0])
        assert hit == [block]
        pool.touch(hit)
        assert first[pos].ref_cnt == 0
    assert pool.get_num_free_blocks() == num_free
    # With no copy in use, the first inserted one is returned.
    manager.free(requests[1].request_id)
    pool.free_blocks(second.values())
    for block in first.values():
        assert pool.get_cached_block(get_block_hash(block.block_hash), [0]) == [block]
    assert_index_consistent(pool)


# --------------------------------------------------------------------------
# Invariant 4: a block reused for a different prefix carries no stale hash.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("manager_name", list(MANAGERS))
def test_reused_block_carries_only_its_new_hash(manager_name):
    pool, manager, requests = materialise_duplicates(manager_name)
    old = hashed_blocks(manager, requests[0].request_id)
    sibling = hashed_blocks(manager, requests[1].request_id)
    old_keys = {pos: block.block_hash for pos, block in old.items()}
    _free_all(manager, requests)
    # Allocation pressure takes every block up to requests[0]'s copies; hand
    # back only those, so the next prefix reuses exactly them while
    # requests[1]'s copies stay cached.
    old_ids = {block.block_id for block in old.values()}
    held = []
    while any(block.block_hash is not None for block in old.values()):
        held.extend(pool.get_new_blocks(1))
    pool.free_blocks([block for block in held if block.block_id in old_ids])
    other = make_request("other", list(range(1000, 1000 + 4 * BLOCK_SIZE)))
    compute_prompt(manager, other)
    other_blocks = hashed_blocks(manager, "other")
    assert old_ids & {block.block_id for block in other_blocks.values()}
    for pos, block in old.items():
        assert old_keys[pos] not in block_keys(pool, block)
        assert not pool.cached_block_hash_to_block.contain(
            old_keys[pos], block.block_id
        )
        assert copies(pool, old_keys[pos]) == {sibling[pos].block_id: sibling[pos]}
    for block in other_blocks.values():
        assert block_keys(pool, block) == {block.block_hash}
        assert copies(pool, block.block_hash) == {block.block_id: block}
    assert_index_consistent(pool)


def test_reused_block_drops_secondary_partial_entries():
    """A block with a partial entry besides its full hash loses both."""
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=2)
    r0 = make_request("r0", list(range(BLOCK_SIZE)), 2)
    blocks = pool.get_new_blocks(3)
    block = blocks[0]
    pool.cache_full_blocks(r0, [block], 0, 1, BLOCK_SIZE, 0)
    full_key = block.block_hash
    partial_key = pool.cache_partial_block(r0, block, 2, 0, BLOCK_SIZE)
    assert {full_key, partial_key} <= block_keys(pool, block)
    pool.free_blocks(blocks)
    reused = pool.get_new_blocks(3)
    assert block in reused
    assert block_keys(pool, block) == set()
    assert pool.get_cached_block(get_block_hash(full_key), [0]) is None
    assert pool.get_cached_block(get_block_hash(partial_key), [0]) is None
    assert_index_consistent(pool)
