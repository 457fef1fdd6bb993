# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV cache events when one ``(block_hash, group)`` key has several copies.

A key can be held by several physical blocks of one pool, e.g. when the last
block of an identical prompt is recomputed. ``KVEventsConfig.copy_semantics``
decides how events account for the copies:

- "logical": ``BlockStored`` on a key's first resident copy, ``BlockRemoved``
  on its last (right for set-style and for reference-counting consumers);
- "last_copy": a ``BlockStored`` per copy, ``BlockRemoved`` on the last copy
  (upstream PR 55092);
- "physical": one of each per copy (vLLM 0.33.0).
"""

import inspect
from collections.abc import Iterable
from types import SimpleNamespace
from typing import get_args

import msgspec
import pytest
import torch

from tests.v1.core.block_pool_view import new_block_map
from vllm.config.kv_events import (
    KV_EVENTS_COPY_SEMANTICS,
    KVEventsConfig,
    KVEventsCopySemantics,
)
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisherFactory,
    KVCacheEvent,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.distributed.kv_events_consumer import COPY_SEMANTICS, Mirror
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    BlockHashListWithBlockSize,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
)
from vllm.v1.core.single_type_kv_cache_manager import HiSparseSourceManager
from vllm.v1.hisparse.block_pool import SharedEventQueueBlockPool
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

pytestmark = pytest.mark.cpu_test

POLICIES = KV_EVENTS_COPY_SEMANTICS
BLOCK_SIZE = 4


@pytest.fixture(autouse=True)
def _auto_init_hash_fn():
    init_none_hash(sha256)


def make_request(
    request_id: str, prompt_token_ids: list[int], block_size: int = BLOCK_SIZE
) -> Request:
    sampling_params = SamplingParams(max_tokens=17)
    sampling_params.update_from_generation_config({}, eos_token_id=100)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=sampling_params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def make_pool(
    policy: str, num_blocks: int = 16, hash_block_size: int = BLOCK_SIZE
) -> BlockPool:
    return BlockPool(
        num_gpu_blocks=num_blocks,
        enable_caching=True,
        hash_block_size=hash_block_size,
        enable_kv_cache_events=True,
        kv_events_copy_semantics=policy,
    )


def tokens(num_blocks: int, base: int = 0) -> list[int]:
    return [base + i for i in range(num_blocks * BLOCK_SIZE)]


def ext(block_hash) -> object:
    return maybe_convert_block_hash(block_hash)


def cache(
    pool: BlockPool,
    req: Request,
    blocks: list[KVCacheBlock],
    num_cached_blocks: int = 0,
    group: int = 0,
) -> None:
    pool.cache_full_blocks(
        request=req,
        blocks=blocks,
        num_cached_blocks=num_cached_blocks,
        num_full_blocks=len(blocks),
        block_size=BLOCK_SIZE,
        kv_cache_group_id=group,
    )


def stored_hashes(events: Iterable[KVCacheEvent]) -> list:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def removed_hashes(events: Iterable[KVCacheEvent]) -> list:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def apply(mirror: Mirror, events: Iterable[KVCacheEvent]) -> None:
    """Feed ``events`` to the reference consumer's mirrors: a set-style and a
    reference-counting consumer, keyed (medium, group, hash)."""
    for event in events:
        mirror.apply(event)


def resident_keys(pool: BlockPool) -> set[tuple]:
    return {
        (pool.medium, get_group_id(k), ext(get_block_hash(k)))
        for k in pool.cached_block_hash_to_block.resident_keys
    }


# ---------------------------------------------------------------- config


def test_copy_semantics_config_default_and_values():
    assert KVEventsConfig().copy_semantics == "logical"
    for policy in POLICIES:
        assert KVEventsConfig(copy_semantics=policy).copy_semantics == policy
    assert make_pool("logical").kv_events_copy_semantics == "logical"
    assert (
        BlockPool(num_gpu_blocks=2, enable_caching=True, hash_block_size=4)
    ).kv_events_copy_semantics == "logical"


def test_consumer_knows_exactly_the_engines_copy_semantics():
    """The reference consumer runs without the engine, so it names the
    policies itself; they must be the engine's, in its order."""
    assert tuple(COPY_SEMANTICS) == get_args(KVEventsCopySemantics)
    with pytest.raises(ValueError, match="last_copy"):
        Mirror("per_copy")


def test_consumer_matches_only_for_views_it_indexes():
    """A Mirror indexes the keys of its held view and of its match_views
    only; asking for another view, or naming an unknown one, is an error
    that says how to construct it."""
    with pytest.raises(ValueError, match="'sets'.*set, count"):
        Mirror(match_views=("sets",))
    assert Mirror("physical").match([1, 2, 3], "count") == {}
    with pytest.raises(ValueError, match=r"match_views=\('set',\)"):
        Mirror("physical").match([1, 2, 3], "set")
    assert Mirror("physical", match_views=("set",)).match([1, 2, 3], "set") == {}


def test_copy_semantics_config_rejects_unknown_value():
    with pytest.raises(ValueError) as exc_info:
        KVEventsConfig(enable_kv_cache_events=True, copy_semantics="per_copy")
    message = str(exc_info.value)
    for policy in POLICIES:
        assert policy in message
    with pytest.raises(AssertionError, match="last_copy"):
        make_pool("per_copy")


@pytest.mark.parametrize("policy", POLICIES)
def test_publisher_factory_reports_copy_semantics(policy):
    """The ZMQ publisher reports the configured value back to clients."""
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="inproc://kv-event-copy-semantics",
        copy_semantics=policy,
    )
    publisher = EventPublisherFactory.create(config)
    try:
        assert isinstance(publisher, ZmqEventPublisher)
        assert publisher.get_publisher_config().copy_semantics == policy
    finally:
        publisher.shutdown()


def test_copy_semantics_reaches_manager_coordinator_and_pool():
    config = make_kv_cache_config(num_blocks=8)
    for policy in POLICIES:
        manager = KVCacheManager(
            config,
            max_model_len=64,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            enable_kv_cache_events=True,
            kv_events_copy_semantics=policy,
        )
        assert manager.block_pool.kv_events_copy_semantics == policy
        for single_type_manager in manager.coordinator.single_type_managers:
            assert single_type_manager.block_pool.kv_events_copy_semantics == policy


def test_hisparse_host_pool_inherits_copy_semantics():
    for policy in POLICIES:
        device_pool = make_pool(policy)
        fake_manager = SimpleNamespace(
            block_pool=device_pool,
            enable_caching=True,
            kv_cache_spec=SimpleNamespace(prefix_cacheable=True),
        )
        HiSparseSourceManager.bind_host_pool(fake_manager, 8)  # type: ignore[arg-type]
        host_pool = fake_manager.block_pool
        assert isinstance(host_pool, SharedEventQueueBlockPool)
        assert host_pool.medium == MEDIUM_CPU
        assert host_pool.kv_events_copy_semantics == policy


# ---------------------------------------------------------- map helper


def test_block_hash_map_reports_first_and_last_copy():
    blocks = [KVCacheBlock(i) for i in range(4)]
    cache_map = new_block_map(blocks)
    key = make_block_hash_with_group_id(b"h" * 32, 0)
    b1, b2, b3 = blocks[1:]
    resident = cache_map.resident_keys
    assert cache_map.insert(key, b1) is True
    assert cache_map.insert(key, b2) is False
    assert cache_map.insert(key, b3) is False
    assert cache_map.num_copies(key) == 3
    # The view is live: the pool tests it right after each pop to tell
    # whether the key's last copy just left.
    assert cache_map.pop(key, 7) is None
    assert cache_map.pop(key, 2) is b2
    assert key in resident
    assert cache_map.pop(key, 1) is b1
    assert key in resident and cache_map.num_copies(key) == 1
    assert cache_map.pop(key, 3) is b3
    assert key not in resident and cache_map.num_copies(key) == 0
    assert cache_map.pop(key, 3) is None
    # A single copy that is not the one asked for stays.
    cache_map.insert(key, b1)
    assert cache_map.pop(key, 2) is None
    assert list(resident) == [key]
    assert cache_map.pop(key, 1) is b1
    assert not resident


# ------------------------------------------------------ the seed example


def seed_example(policy: str):
    """A: H1->H2->H3; B: H1..H7 with H3 recomputed on its own block."""
    pool = make_pool(policy)
    req_a = make_request("A", tokens(3))
    blocks_a = pool.get_new_blocks(3)
    cache(pool, req_a, blocks_a)
    pool.free_blocks(blocks_a)

    req_b = make_request("B", tokens(7))
    # B hits H1, H2 and recomputes H3 on a new block (P3-B).
    pool.touch(blocks_a[:2])
    new_blocks = pool.get_new_blocks(5)
    blocks_b = blocks_a[:2] + new_blocks
    cache(pool, req_b, blocks_b, num_cached_blocks=2)
    return pool, req_a, req_b, blocks_a, blocks_b


@pytest.mark.parametrize("policy", POLICIES)
def test_seed_example_evicting_one_copy_of_h3(policy):
    pool, req_a, req_b, blocks_a, blocks_b = seed_example(policy)
    h = [ext(x) for x in req_b.block_hashes]
    events = pool.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    first, second = events
    assert first.block_hashes == h[:3] and first.parent_block_hash is None
    if policy == "logical":
        # H3 was already resident: B's event starts at H4, parented by H3.
        assert second.block_hashes == h[3:]
        assert second.parent_block_hash == h[2]
        assert second.token_ids == req_b.all_token_ids[3 * BLOCK_SIZE :]
    else:
        assert second.block_hashes == h[2:]
        assert second.parent_block_hash == h[1]
        assert second.token_ids == req_b.all_token_ids[2 * BLOCK_SIZE :]
    assert second.block_size == BLOCK_SIZE

    # Evict P3-A (A's copy of H3) through a KV connector: P3-B still holds H3.
    pool.evict_blocks({blocks_a[2].block_id})
    events = pool.take_events()
    if policy == "physical":
        assert removed_hashes(events) == [h[2]]
    else:
        assert events == []
    assert pool.get_cached_block(req_b.block_hashes[2], [0]) == [blocks_b[2]]

    # Evicting the last copy removes the key under every policy.
    pool.evict_blocks({blocks_b[2].block_id})
    assert removed_hashes(pool.take_events()) == [h[2]]


@pytest.mark.parametrize("policy", POLICIES)
def test_three_copies_evicted_one_by_one(policy):
    pool = make_pool(policy)
    mirror = Mirror(policy)
    copies = []
    # All three in use before any is freed: a copy freed while another stays
    # resident goes to the front of the free queue and would be reused.
    for i in range(3):
        req = make_request(f"r{i}", tokens(1))
        block = pool.get_new_blocks(1)
        cache(pool, req, block)
        copies.append(block[0])
    for block in copies:
        pool.free_blocks([block])
    target = ext(req.block_hashes[0])
    events = pool.take_events()
    apply(mirror, events)
    assert stored_hashes(events) == [target] * (1 if policy == "logical" else 3)

    removed_per_step = []
    set_ok, count_ok = [], []
    for block in copies:
        pool.evict_blocks({block.block_id})
        events = pool.take_events()
        apply(mirror, events)
        removed_per_step.append(removed_hashes(events).count(target))
        set_ok.append(mirror.set.key_set() == resident_keys(pool))
        count_ok.append(mirror.count.key_set() == resident_keys(pool))
    if policy == "physical":
        assert removed_per_step == [1, 1, 1]
    else:
        assert removed_per_step == [0, 0, 1]
    assert resident_keys(pool) == set()
    # Each consumer stays right only where the stream matches its model
    # (the consumer's COPY_SEMANTICS): "physical" drops the key from a set
    # while two copies remain, and "last_copy" leaves a reference count of 2
    # behind.
    assert all(set_ok) == ("set" in COPY_SEMANTICS[policy])
    assert all(count_ok) == ("count" in COPY_SEMANTICS[policy])
    # The set consumer reports the two removals of the key it dropped.
    assert len(mirror.set.unknown_removals) == (2 if policy == "physical" else 0)
    assert not mirror.count.unknown_removals
    assert mirror.held_keys() == set()


@pytest.mark.parametrize("policy", POLICIES)
def test_removal_of_a_key_never_seen_stored_is_reported(policy):
    """A consumer that missed a key's store (it joined late, or lost the
    batch) gets its removal as that of a key it does not hold. Both mirrors
    report it; a count clamped at zero would hide it."""
    pool = make_pool(policy)
    req = make_request("r", tokens(2))
    blocks = pool.get_new_blocks(2)
    cache(pool, req, blocks)
    pool.free_blocks(blocks)
    assert len(stored_hashes(pool.take_events())) == 2  # before it joined
    mirror = Mirror(policy)
    pool.evict_blocks({b.block_id for b in blocks})
    events = pool.take_events()
    apply(mirror, events)
    removed = [(pool.medium, 0, h) for h in removed_hashes(events)]
    assert len(removed) == 2
    assert [key for key, _ in mirror.set.unknown_removals] == removed
    assert [key for key, _ in mirror.count.unknown_removals] == removed
    assert [key for key, _ in mirror.unknown_removals] == removed
    assert mirror.held_keys() == set() and not mirror.count.counts


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_on_allocation_waits_for_last_copy(policy):
    pool = make_pool(policy, num_blocks=3)
    req = make_request("r", tokens(1))
    copies = []
    for _ in range(2):
        block = pool.get_new_blocks(1)
        cache(pool, req, block)
        pool.free_blocks(block)
        copies.extend(block)
    pool.take_events()
    # The free queue is LRU: the first allocation evicts the first copy.
    first = pool.get_new_blocks(1)
    assert first == [copies[0]]
    assert removed_hashes(pool.take_events()) == (
        [ext(req.block_hashes[0])] if policy == "physical" else []
    )
    second = pool.get_new_blocks(1)
    assert second == [copies[1]]
    assert removed_hashes(pool.take_events()) == [ext(req.block_hashes[0])]


@pytest.mark.parametrize("policy", POLICIES)
def test_evict_blocks_of_referenced_block(policy):
    pool = make_pool(policy)
    req = make_request("r", tokens(2))
    held = pool.get_new_blocks(2)
    cache(pool, req, held)
    other = pool.get_new_blocks(2)
    cache(pool, req, other)
    pool.take_events()
    # ``held`` is still referenced; evict_blocks drops it from the index.
    pool.evict_blocks({b.block_id for b in held})
    events = pool.take_events()
    assert all(b.ref_cnt == 1 for b in held)
    if policy == "physical":
        assert sorted(removed_hashes(events)) == sorted(
            ext(x) for x in req.block_hashes
        )
    else:
        assert events == []
    pool.evict_blocks({b.block_id for b in other})
    assert sorted(removed_hashes(pool.take_events())) == sorted(
        ext(x) for x in req.block_hashes
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_fully_resident_batch_emits_no_store(policy):
    pool = make_pool(policy)
    req = make_request("r", tokens(3))
    cache(pool, req, pool.get_new_blocks(3))
    pool.take_events()
    cache(pool, req, pool.get_new_blocks(3))
    events = pool.take_events()
    if policy == "logical":
        assert events == []
    else:
        assert stored_hashes(events) == [ext(x) for x in req.block_hashes]


@pytest.mark.parametrize("policy", POLICIES)
def test_masked_out_blocks_are_neither_cached_nor_stored(policy):
    """A block the group's mask leaves out (a sliding-window block that can
    never serve a hit) stays out of the index and out of BlockStored, alone
    and when a resident key splits the batch into runs."""
    pool = make_pool(policy)
    req = make_request("r", tokens(4))
    h = [ext(x) for x in req.block_hashes]
    # A copy of H4 is resident, so under "logical" the batch is split.
    cache(pool, req, [pool.null_block] * 3 + pool.get_new_blocks(1), 3)
    pool.take_events()

    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(
        request=req,
        blocks=blocks,
        num_cached_blocks=0,
        num_full_blocks=4,
        block_size=BLOCK_SIZE,
        kv_cache_group_id=0,
        block_mask=[True, False, True, True],
    )
    assert blocks[1].block_hash is None
    assert stored_hashes(pool.take_events()) == (
        [h[0], h[2]] if policy == "logical" else [h[0], h[2], h[3]]
    )


def test_logical_store_splits_into_runs_with_aligned_fields():
    """Resident keys in the middle of a batch split it into contiguous runs."""
    pool = make_pool("logical", num_blocks=20)
    req = make_request("r", tokens(6))
    h = [ext(x) for x in req.block_hashes]
    # Copies of H2 and H4 (indices 1 and 3) are already resident.
    for idx in (1, 3):
        blocks = [pool.null_block] * idx + pool.get_new_blocks(1)
        cache(pool, req, blocks, num_cached_blocks=idx)
    pool.take_events()

    cache(pool, req, pool.get_new_blocks(6))
    events = pool.take_events()
    assert [type(e) for e in events] == [BlockStored] * 3
    assert [e.block_hashes for e in events] == [[h[0]], [h[2]], h[4:]]
    assert [e.parent_block_hash for e in events] == [None, h[1], h[3]]
    assert [e.token_ids for e in events] == [
        req.all_token_ids[0:4],
        req.all_token_ids[8:12],
        req.all_token_ids[16:24],
    ]
    assert [len(e.extra_keys or [None] * len(e.block_hashes)) for e in events] == [
        len(e.block_hashes) for e in events
    ]


# Hash lookahead tokens (each block's hash also covers the tokens after it,
# and BlockStored carries them) came with 0.33.0; 0.32.0 has neither side.
HAS_LOOKAHEAD = "num_hash_lookahead_tokens" in inspect.signature(BlockPool).parameters


def test_logical_store_runs_keep_lookahead_tokens_aligned():
    # the pool and the event grew the lookahead together: a release with one
    # side only would make this test check less than it says
    assert ("lookahead_token_ids" in BlockStored.__struct_fields__) == HAS_LOOKAHEAD
    lookahead = {"num_hash_lookahead_tokens": 2} if HAS_LOOKAHEAD else {}
    pool = BlockPool(
        num_gpu_blocks=10,
        enable_caching=True,
        hash_block_size=BLOCK_SIZE,
        enable_kv_cache_events=True,
        kv_events_copy_semantics="logical",
        **lookahead,
    )
    req = Request(
        request_id="r",
        prompt_token_ids=tokens(4),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256, *lookahead.values()),
    )
    h = [ext(x) for x in req.block_hashes]
    cache(pool, req, [pool.null_block] + pool.get_new_blocks(1), num_cached_blocks=1)
    pool.take_events()
    cache(pool, req, pool.get_new_blocks(len(h)))
    events = pool.take_events()
    # the logical stream stores each run of new keys once, around the key
    # that was already resident
    assert [e.block_hashes for e in events] == [[h[0]], h[2:]]
    if not HAS_LOOKAHEAD:
        return
    for event in events:
        assert event.lookahead_token_ids is not None
        assert len(event.lookahead_token_ids) == len(event.block_hashes)
    assert events[1].lookahead_token_ids[0] == req.all_token_ids[12:14]


@pytest.mark.parametrize("policy", POLICIES)
def test_groups_are_independent(policy):
    pool = make_pool(policy)
    req = make_request("r", tokens(1))
    g0 = pool.get_new_blocks(1)
    g1 = pool.get_new_blocks(1)
    cache(pool, req, g0, group=0)
    cache(pool, req, g1, group=1)
    events = pool.take_events()
    # The same hash in another group is another key: both are stored.
    assert [(e.block_hashes, e.group_idx) for e in events] == [
        ([ext(req.block_hashes[0])], 0),
        ([ext(req.block_hashes[0])], 1),
    ]
    pool.evict_blocks({g0[0].block_id})
    events = pool.take_events()
    assert [(e.block_hashes, e.group_idx) for e in events] == [
        ([ext(req.block_hashes[0])], 0)
    ]


@pytest.mark.parametrize("policy", POLICIES)
def test_move_block_hashes_emits_nothing_and_keeps_copies(policy):
    pool = make_pool(policy)
    mirror = Mirror(policy)
    req = make_request("r", tokens(1))
    src = pool.get_new_blocks(1)[0]
    cache(pool, req, [src])
    other = pool.get_new_blocks(1)[0]
    cache(pool, req, [other])
    apply(mirror, pool.take_events())
    key = make_block_hash_with_group_id(req.block_hashes[0], 0)
    dst = pool.get_new_blocks(1)[0]
    pool.move_block_hashes(src, dst)
    assert pool.take_events() == []
    assert pool.cached_block_hash_to_block.num_copies(key) == 2
    # Moving the only copy changes nothing either.
    pool.evict_blocks({other.block_id})
    apply(mirror, pool.take_events())
    dst2 = pool.get_new_blocks(1)[0]
    pool.move_block_hashes(dst, dst2)
    assert pool.take_events() == []
    assert pool.cached_block_hash_to_block.num_copies(key) == 1
    pool.evict_blocks({dst2.block_id})
    apply(mirror, pool.take_events())
    assert mirror.held_keys() == set() and not mirror.unknown_removals
    if policy == "logical":
        assert mirror.set.key_set() == mirror.count.key_set() == set()


@pytest.mark.parametrize("policy", POLICIES)
def test_emit_cached_block_events_follows_copy_semantics(policy):
    """The per-request report of reused keys re-announces resident keys, so
    "logical" (a store on a key's first copy only) sends nothing."""
    pool = make_pool(policy)
    req = make_request("r", tokens(2))
    cache(pool, req, pool.get_new_blocks(2))
    pool.take_events()
    pool.emit_cached_block_events(req, 2, BLOCK_SIZE, 0)
    events = pool.take_events()
    if policy == "logical":
        assert events == []
        return
    assert len(events) == 1
    assert events[0].block_hashes == [ext(x) for x in req.block_hashes]
    assert events[0].parent_block_hash is None


@pytest.mark.parametrize("policy", POLICIES)
def test_upstream_emit_cached_block_events_case_per_policy(policy):
    """Upstream's ``test_emit_cached_block_events`` (test_prefix_caching.py),
    whose pool takes the default "logical" and so now sees no event: the
    same case under each policy, upstream's expectation under "last_copy"
    and "physical"."""
    block_size, num_cached_blocks, group = 4, 3, 1
    pool = BlockPool(
        num_gpu_blocks=8,
        enable_caching=True,
        hash_block_size=block_size,
        enable_kv_cache_events=True,
        kv_events_copy_semantics=policy,
    )
    req = Request(
        request_id="req_emit_cached",
        prompt_token_ids=list(range(block_size * 4)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
        session_id="agent-session-reuse",
    )
    free_before = pool.get_num_free_blocks()
    pool.emit_cached_block_events(req, num_cached_blocks, block_size, group)
    assert pool.get_num_free_blocks() == free_before
    assert len(pool.cached_block_hash_to_block) == 0
    events = pool.take_events()
    if policy == "logical":
        assert events == []
        return
    [event] = events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [ext(h) for h in req.block_hashes[:3]]
    assert event.parent_block_hash is None
    assert event.token_ids == req.all_token_ids[: num_cached_blocks * block_size]
    assert (event.group_idx, event.block_size, event.medium) == (
        group,
        block_size,
        MEDIUM_GPU,
    )
    assert (event.lora_id, event.lora_name) == (None, None)
    assert event.session_id == "agent-session-reuse"


# -------------------------------------------------- partial-prefix keys

HASH_BLOCK = 2
GROUP_BLOCK = 6


def make_partial_setup(policy: str):
    pool = make_pool(policy, num_blocks=8, hash_block_size=HASH_BLOCK)
    req = make_request("p", [0, 0, 1, 1, 2, 2, 3, 3], block_size=HASH_BLOCK)
    return pool, req


@pytest.mark.parametrize("policy", POLICIES)
def test_partial_key_store_and_remove_follow_copies(policy):
    pool, req = make_partial_setup(policy)
    blocks = [pool.get_new_blocks(1)[0] for _ in range(2)]
    for block in blocks:
        assert pool.cache_partial_block(
            request=req,
            block=block,
            num_tokens=4,
            kv_cache_group_id=0,
            block_size=GROUP_BLOCK,
        )
    target = ext(req.block_hashes[1])
    events = pool.take_events()
    assert stored_hashes(events) == [target] * (1 if policy == "logical" else 2)
    pool.evict_blocks({blocks[0].block_id})
    assert removed_hashes(pool.take_events()) == (
        [target] if policy == "physical" else []
    )
    pool.evict_blocks({blocks[1].block_id})
    assert removed_hashes(pool.take_events()) == [target]


@pytest.mark.parametrize("policy", POLICIES)
def test_partial_replace_path_waits_for_last_copy(policy):
    pool, req = make_partial_setup(policy)
    blocks = [pool.get_new_blocks(1)[0] for _ in range(2)]
    for block in blocks:
        pool.cache_partial_block(
            request=req,
            block=block,
            num_tokens=4,
            kv_cache_group_id=0,
            block_size=GROUP_BLOCK,
        )
    pool.take_events()
    # Re-key blocks[0] to the 8-token boundary, dropping its 4-token entry.
    pool.cache_partial_block(
        request=req,
        block=blocks[0],
        num_tokens=8,
        kv_cache_group_id=0,
        block_size=GROUP_BLOCK,
        replace_existing_hashes=True,
    )
    events = pool.take_events()
    key4, key8 = ext(req.block_hashes[1]), ext(req.block_hashes[3])
    assert removed_hashes(events) == ([key4] if policy == "physical" else [])
    assert stored_hashes(events) == [key8]
    # The longer-prefix (non-replace) path re-keys blocks[1] too.
    pool.cache_partial_block(
        request=req,
        block=blocks[1],
        num_tokens=8,
        kv_cache_group_id=0,
        block_size=GROUP_BLOCK,
    )
    events = pool.take_events()
    assert removed_hashes(events) == [key4]
    assert stored_hashes(events) == ([] if policy == "logical" else [key8])


@pytest.mark.parametrize("policy", POLICIES)
def test_partial_to_full_promotion_waits_for_last_copy(policy):
    pool, req = make_partial_setup(policy)
    req.append_output_token_ids([4, 4, 5, 5])  # 12 tokens: two full blocks
    full = BlockHashListWithBlockSize(req.block_hashes, HASH_BLOCK, GROUP_BLOCK)
    first = pool.get_new_blocks(1)[0]
    pool.cache_full_blocks(
        request=req,
        blocks=[first],
        num_cached_blocks=0,
        num_full_blocks=1,
        block_size=GROUP_BLOCK,
        kv_cache_group_id=0,
    )
    tails = [pool.get_new_blocks(1)[0] for _ in range(2)]
    for tail in tails:
        pool.cache_partial_block(
            request=req,
            block=tail,
            num_tokens=8,
            kv_cache_group_id=0,
            block_size=GROUP_BLOCK,
        )
    pool.take_events()
    partial = ext(req.block_hashes[3])
    # Promote tails[0] to the full second block: one copy of the partial
    # key remains on tails[1].
    pool.cache_full_blocks(
        request=req,
        blocks=[first, tails[0]],
        num_cached_blocks=1,
        num_full_blocks=2,
        block_size=GROUP_BLOCK,
        kv_cache_group_id=0,
    )
    events = pool.take_events()
    assert removed_hashes(events) == ([partial] if policy == "physical" else [])
    assert stored_hashes(events) == [ext(full[1])]
    pool.cache_full_blocks(
        request=req,
        blocks=[first, tails[1]],
        num_cached_blocks=1,
        num_full_blocks=2,
        block_size=GROUP_BLOCK,
        kv_cache_group_id=0,
    )
    events = pool.take_events()
    assert removed_hashes(events) == [partial]
    assert stored_hashes(events) == ([] if policy == "logical" else [ext(full[1])])


@pytest.mark.parametrize("policy", POLICIES)
def test_direct_eviction_of_a_transient_copy(policy):
    """The Mamba checkpoint path evicts a transient block directly."""
    pool = make_pool(policy)
    req = make_request("r", tokens(1))
    kept = pool.get_new_blocks(1)
    cache(pool, req, kept)
    transient = pool.get_new_blocks(1)
    cache(pool, req, transient)
    pool.take_events()
    assert pool._maybe_evict_cached_block(transient[0])
    assert removed_hashes(pool.take_events()) == (
        [ext(req.block_hashes[0])] if policy == "physical" else []
    )
    assert pool._maybe_evict_cached_block(kept[0])
    assert removed_hashes(pool.take_events()) == [ext(req.block_hashes[0])]


# ------------------------------------------------------------- wire format


@pytest.mark.parametrize("policy", POLICIES)
def test_events_decode_with_stock_schema(policy):
    pool, *_ = seed_example(policy)
    events = pool.take_events()
    batch = KVEventBatch(ts=0.0, events=events)
    payload = msgspec.msgpack.Encoder().encode(batch)
    decoded = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    assert decoded.events == events
    assert {f for e in events for f in e.__struct_fields__} <= set(
        BlockStored.__struct_fields__
    )


# ------------------------------------------------------------------ reset


def make_kv_cache_config(num_blocks: int) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK_SIZE,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            )
        ],
    )


def make_coordinator_with_host_pool(policy: str):
    """A two-group coordinator whose second group publishes, like HiSparse's
    host tier, into the first pool's event queue with medium CPU."""
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    swa = SlidingWindowSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        sliding_window=4 * BLOCK_SIZE,
    )
    config = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["full"], spec),
            KVCacheGroupSpec(["swa"], swa),
        ],
    )
    coordinator = get_kv_cache_coordinator(
        kv_cache_config=config,
        max_model_len=64,
        max_in_flight_tokens=64,
        use_eagle=False,
        enable_caching=True,
        enable_kv_cache_events=True,
        dcp_world_size=1,
        pcp_world_size=1,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        kv_events_copy_semantics=policy,
    )
    device_pool = coordinator.block_pool
    host_pool = SharedEventQueueBlockPool(
        num_gpu_blocks=8,
        enable_caching=True,
        hash_block_size=BLOCK_SIZE,
        enable_kv_cache_events=True,
        medium=MEDIUM_CPU,
        kv_events_copy_semantics=policy,
        event_owner=device_pool,
    )
    coordinator.single_type_managers[1].block_pool = host_pool
    return coordinator, device_pool, host_pool


def test_reset_refused_by_one_pool_resets_no_pool():
    """A refusal by any pool must leave every pool (and the stream) intact."""
    coordinator, device_pool, host_pool = make_coordinator_with_host_pool("logical")
    req = make_request("r", tokens(2))
    device_blocks = device_pool.get_new_blocks(2)
    cache(device_pool, req, device_blocks)
    device_pool.free_blocks(device_blocks)
    host_blocks = host_pool.get_new_blocks(2)
    cache(host_pool, req, host_blocks, group=1)  # still referenced
    device_pool.take_events()

    assert coordinator.reset_prefix_cache() is False
    assert device_pool.take_events() == []
    assert len(device_pool.cached_block_hash_to_block) == 2
    assert device_pool.get_cached_block(req.block_hashes[0], [0]) is not None
    assert len(host_pool.cached_block_hash_to_block) == 2

    host_pool.free_blocks(host_blocks)
    assert coordinator.reset_prefix_cache() is True
    assert len(device_pool.cached_block_hash_to_block) == 0
    assert len(host_pool.cached_block_hash_to_block) == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_shared_queue_pool_reset_removes_its_keys_per_medium(policy):
    coordinator, device_pool, host_pool = make_coordinator_with_host_pool(policy)
    mirror = Mirror(policy)
    req = make_request("r", tokens(2))
    device_blocks = device_pool.get_new_blocks(2)
    cache(device_pool, req, device_blocks)
    device_pool.free_blocks(device_blocks)
    for _ in range(2):  # two host copies of each key
        host_blocks = host_pool.get_new_blocks(2)
        cache(host_pool, req, host_blocks, group=1)
        host_pool.free_blocks(host_blocks)
    apply(mirror, device_pool.take_events())

    assert host_pool.reset_prefix_cache() is True
    events = device_pool.take_events()
    assert not any(isinstance(e, AllBlocksCleared) for e in events)
    assert {e.medium for e in events} == {MEDIUM_CPU}
    assert all(isinstance(e, BlockRemoved) and e.group_idx == 1 for e in events)
    expected = [ext(x) for x in req.block_hashes]
    copies = 2 if policy == "physical" else 1
    assert sorted(removed_hashes(events)) == sorted(expected * copies)
    apply(mirror, events)
    assert not mirror.unknown_removals
    # The GPU tier is untouched by the host pool's reset.
    gpu_keys = resident_keys(device_pool)
    assert gpu_keys and {k for k in mirror.held_keys() if k[0] == MEDIUM_GPU} == (
        gpu_keys
    )


def test_coordinator_reset_emits_per_medium_then_all_blocks_cleared():
    coordinator, device_pool, host_pool = make_coordinator_with_host_pool("logical")
    mirror = Mirror("logical")
    req = make_request("r", tokens(2))
    device_blocks = device_pool.get_new_blocks(2)
    cache(device_pool, req, device_blocks)
    device_pool.free_blocks(device_blocks)
    host_blocks = host_pool.get_new_blocks(2)
    cache(host_pool, req, host_blocks, group=1)
    host_pool.free_blocks(host_blocks)
    apply(mirror, device_pool.take_events())
    assert coordinator.reset_prefix_cache() is True
    events = device_pool.take_events()
    assert sum(isinstance(e, AllBlocksCleared) for e in events) == 1
    assert all(e.medium == MEDIUM_CPU for e in events if isinstance(e, BlockRemoved))
    apply(mirror, events)
    assert mirror.set.key_set() == mirror.count.key_set() == set()
    assert not mirror.set.unknown_removals and not mirror.count.unknown_removals
