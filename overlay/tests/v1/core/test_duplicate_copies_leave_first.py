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

A copy is at the front only while another copy of its key is resident: when
the key loses its copy in use, or the free copy that held its place, without
that copy being freed, one of the copies left regains the key's place before
the next allocation. Copies that a reuse watcher still reads (HiSparse's
unpinned pages) keep their place.
"""

import inspect

import pytest
import torch

from tests.v1.core.block_pool_view import copies
from vllm.config.kv_events import KV_EVENTS_COPY_SEMANTICS
from vllm.distributed.kv_events import BlockRemoved
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_block_hash,
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
)
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.hisparse.block_pool import SharedEventQueueBlockPool
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

BLOCK_SIZE = 4
NUM_BLOCKS = 12
PROMPT = [1, 2, 3, 4]
# A group whose blocks hold four hash blocks, so a prompt that ends inside a
# block also caches its partial tail (``_cache_partial_tail_block``).
LARGE_BLOCK_SIZE = 16
SHARED_PROMPT = list(range(20))


@pytest.fixture(autouse=True)
def _init_none_hash():
    init_none_hash(sha256)


# The pools whose free_blocks orders copies: the device pool, and HiSparse's
# host pool, which publishes into the device pool's event queue. A subclass
# that overrides free_blocks must keep the order too.
POOL_KINDS = ("device", "host")


def make_pool(copy_semantics: str = "logical", kind: str = "device") -> BlockPool:
    options = dict(
        num_gpu_blocks=NUM_BLOCKS,
        enable_caching=True,
        hash_block_size=BLOCK_SIZE,
        enable_kv_cache_events=True,
        kv_events_copy_semantics=copy_semantics,
    )
    if kind == "host":
        return SharedEventQueueBlockPool(event_owner=BlockPool(**options), **options)
    return BlockPool(**options)


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
    return set(copies(pool, key))


@pytest.mark.parametrize("pool_kind", POOL_KINDS)
@pytest.mark.parametrize("copy_semantics", KV_EVENTS_COPY_SEMANTICS)
def test_freed_copy_leaves_first_while_another_copy_is_in_use(
    copy_semantics, pool_kind
):
    pool = make_pool(copy_semantics, pool_kind)
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


@pytest.mark.skipif(
    "evict_first" not in inspect.signature(BlockPool.free_blocks).parameters,
    reason="the release's free_blocks has no evict_first",
)
def test_copy_freed_to_be_evicted_first_is_no_longer_taken_as_in_use():
    """free_blocks(evict_first=True), for blocks another tier holds, puts a
    freed copy at the front of the queue and notes that it left use: a hit
    takes the copy still in use, and the freed one leaves first with its key
    still resident."""
    pool = make_pool()
    a = compute(pool, "a", PROMPT)
    b = compute(pool, "b", PROMPT)
    pool.free_blocks([b], evict_first=True)
    assert free_order(pool)[0] == b.block_id
    assert pool.get_cached_block(block_hash_of(PROMPT), [0]) == [a]
    pool.take_events()

    assert pool.get_new_blocks(1) == [b]
    assert resident_copies(pool, PROMPT) == {a.block_id}
    assert [e for e in pool.take_events() if isinstance(e, BlockRemoved)] == []


def test_reset_forgets_which_copies_were_in_use():
    """A reset drops the keys and what the pool knew of their copies: a key
    cached again afterwards, with its first copy in use, still sends a second
    copy that is freed to the front of the queue."""
    pool = make_pool()
    a = compute(pool, "a", PROMPT)
    b = compute(pool, "b", PROMPT)
    pool.free_blocks([a, b])
    assert pool.reset_prefix_cache()

    c = compute(pool, "c", PROMPT)
    d = compute(pool, "d", PROMPT)
    pool.free_blocks([d])
    assert free_order(pool)[0] == d.block_id
    assert pool.get_cached_block(block_hash_of(PROMPT), [0]) == [c]


def test_reset_forgets_which_copy_held_the_key_place():
    """The free copy that held a key's place before a reset holds nothing
    after it, even when the same block caches the key again and is in use:
    freeing a later copy leaves that block in use."""
    pool = make_pool()
    a = compute(pool, "a", PROMPT)
    b = compute(pool, "b", PROMPT)
    # a goes to the front; b, freed last, holds the key's place.
    pool.free_blocks([a, b])
    assert free_order(pool)[-1] == b.block_id
    assert pool.reset_prefix_cache()

    blocks = pool.get_new_blocks(pool.get_num_free_blocks())
    assert b in blocks
    others = [block for block in blocks if block is not b]
    second = others.pop()
    for block, request_id in ((b, "c"), (second, "d")):
        pool.cache_full_blocks(make_request(request_id, PROMPT), [block], 0, 1, 4, 0)
    pool.free_blocks(others)
    pool.free_blocks([second])
    assert free_order(pool)[0] == second.block_id
    assert b.block_id not in free_order(pool)
    assert b.ref_cnt == 1
    assert pool.get_cached_block(block_hash_of(PROMPT), [0]) == [b]


@pytest.mark.parametrize("pool_kind", POOL_KINDS)
def test_latest_freed_copy_keeps_the_key_recency(pool_kind):
    pool = make_pool(kind=pool_kind)
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


@pytest.mark.parametrize("pool_kind", POOL_KINDS)
def test_copies_freed_in_one_call(pool_kind):
    pool = make_pool(kind=pool_kind)
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


def cache_prompt_with_partial_tail(
    pool: BlockPool, request: Request
) -> tuple[KVCacheBlock, KVCacheBlock]:
    """Cache ``SHARED_PROMPT``'s full block and its partial tail as a
    full-attention group of ``LARGE_BLOCK_SIZE`` does."""
    full, tail = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, [full, tail], 0, 1, LARGE_BLOCK_SIZE, 0)
    pool.cache_partial_block(request, tail, len(SHARED_PROMPT), 0, LARGE_BLOCK_SIZE)
    return full, tail


@pytest.mark.parametrize(
    "loss", ["promotion", "eviction_of_the_copy_in_use", "eviction_of_the_last_freed"]
)
def test_copy_left_alone_regains_the_key_place(loss):
    """Two requests share a 20-token prompt: each holds a copy of its full
    block's key and of its partial tail's key. The first finishes, so its
    copies go to the front. Then the partial key loses the second request's
    copy without it being freed: the tail fills and is promoted to a full
    key, or a connector evicts the block, or the second request finishes
    and its tail, which held the key's place, is evicted. The first
    request's tail is now the key's only copy: it must leave after the
    surplus copy of the full block and after every never-used block."""
    pool = make_pool()
    first = make_request("first", SHARED_PROMPT)
    second = make_request("second", SHARED_PROMPT)
    full, tail = cache_prompt_with_partial_tail(pool, first)
    second_full, second_tail = cache_prompt_with_partial_tail(pool, second)
    partial_key = tail.block_hash
    assert partial_key is not None and second_tail.block_hash == partial_key
    # As KVCacheManager.free does: the tail first.
    pool.free_blocks([tail, full])
    assert free_order(pool)[:2] == [tail.block_id, full.block_id]

    if loss == "promotion":
        for token in range(LARGE_BLOCK_SIZE - len(SHARED_PROMPT) % LARGE_BLOCK_SIZE):
            second.append_output_token_ids(100 + token)
        pool.cache_full_blocks(
            second, [second_full, second_tail], 1, 2, LARGE_BLOCK_SIZE, 0
        )
    elif loss == "eviction_of_the_copy_in_use":
        pool.evict_blocks({second_tail.block_id})
    else:
        pool.free_blocks([second_tail, second_full])
        pool.evict_blocks({second_tail.block_id})
    assert second_tail.block_hash != partial_key
    assert pool.get_cached_block(get_block_hash(partial_key), [0]) == [tail]

    evicted = pool.get_new_blocks(pool.get_num_free_blocks() - 1)
    assert evicted[0] is full
    assert tail not in evicted
    assert free_order(pool) == [tail.block_id]
    assert pool.get_cached_block(get_block_hash(partial_key), [0]) == [tail]


def test_partial_tail_cached_again_keeps_the_surplus_copy_first():
    """Through FullAttentionManager the promoted tail block caches the partial
    tail key again in the same step, so that key keeps a copy in use and the
    first request's tail is still a surplus copy that leaves first."""
    pool = make_pool()
    spec = FullAttentionSpec(
        block_size=LARGE_BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    manager = FullAttentionManager(
        spec,
        block_pool=pool,
        enable_caching=True,
        kv_cache_group_id=0,
        scheduler_block_size=LARGE_BLOCK_SIZE,
    )
    # One token past the tail boundary: a resend matches at most all but one
    # prompt token, so the partial tail is cached at 20 tokens.
    prompt = [*SHARED_PROMPT, 0]
    requests = [make_request(rid, prompt) for rid in ("first", "second")]
    for request in requests:
        manager.allocate_new_blocks(request.request_id, len(prompt), len(prompt))
        manager.cache_blocks(request, len(prompt), replay_boundaries=[])
        request.num_computed_tokens = len(prompt)
    first_full, first_tail = manager.req_to_blocks["first"]
    partial_key = first_tail.block_hash
    manager.free("first")
    assert free_order(pool)[:2] == [first_tail.block_id, first_full.block_id]

    second = requests[1]
    for token in range(2 * LARGE_BLOCK_SIZE - len(prompt)):
        second.append_output_token_ids(100 + token)
    manager.cache_blocks(second, 2 * LARGE_BLOCK_SIZE, replay_boundaries=[])
    second_tail = manager.req_to_blocks["second"][1]
    assert second_tail.block_hash != partial_key
    assert pool.get_cached_block(get_block_hash(partial_key), [0]) == [second_tail]
    assert pool.get_new_blocks(2) == [first_tail, first_full]


@pytest.mark.parametrize("pool_kind", POOL_KINDS)
def test_unpinned_copy_keeps_its_place(pool_kind):
    """HiSparse unpins a page whose host copy is durable: the pool counts it
    as free, but a request reads it until the pool hands it out
    (``unpin_blocks``). A second copy of its key, freed later, must not send
    the page to the front of the free queue: never-used blocks go first, as
    they do upstream."""
    pool = make_pool(kind=pool_kind)
    page = compute(pool, "reader", PROMPT)
    handed_out: list[KVCacheBlock] = []
    pool.unpin_blocks([page], handed_out.append)
    repeat = compute(pool, "repeat", PROMPT)
    pool.free_blocks([repeat])
    never_used = pool.get_num_free_blocks() - 2
    assert page.block_id not in [b.block_id for b in pool.get_new_blocks(never_used)]
    assert handed_out == []
    assert page.block_id in resident_copies(pool, PROMPT)
