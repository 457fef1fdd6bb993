# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stateful property test: KV events replayed by consumers match the pool.

Random sequences of cache, free, allocate-with-eviction, ``evict_blocks``,
partial entries, partial->full promotion, ``move_block_hashes`` and
all-or-nothing reset run on a real ``BlockPool`` (GPU) and a HiSparse-style
``SharedEventQueueBlockPool`` (CPU) publishing into the GPU pool's queue, in
two KV cache groups. After every step the events are replayed into the
reference consumer's ``Mirror``, which keeps

- a set mirror (``BlockStored`` adds, ``BlockRemoved`` discards), and
- a reference-counting mirror (+1 per stored hash, -1 per removed hash, the
  key dropped at 0; a removal of a key it holds no count for is a failure,
  as it would underflow a real counting consumer),

and the set mirror must equal the set of ``(medium, group, hash)`` keys with
at least one resident copy, read from the pools' hash maps; the counting
mirror must hold exactly the count the policy implies for each of them: one
per key under "logical", one per resident copy under "physical".

With "logical" copy semantics both mirrors stay exact. The checker is shown to
fail: "physical" breaks the set mirror and "last_copy" the counting mirror
(while each keeps the other mirror exact).
"""

from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from vllm.distributed.kv_events_consumer import Mirror
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
    resolve_block_hashes,
)
from vllm.v1.hisparse.block_pool import SharedEventQueueBlockPool
from vllm.v1.request import Request

pytestmark = pytest.mark.cpu_test

HASH_BLOCK_SIZE = 2
BLOCK_SIZE = 4  # each group block covers two hash blocks: room for partials
NUM_GPU_BLOCKS = 10
NUM_HOST_BLOCKS = 8
GROUPS = (0, 1)

_request_ids = iter(range(10**9))


def make_request(token_ids: list[int]) -> Request:
    sampling_params = SamplingParams(max_tokens=4)
    sampling_params.update_from_generation_config({}, eos_token_id=100)
    return Request(
        request_id=f"req-{next(_request_ids)}",
        prompt_token_ids=token_ids,
        sampling_params=sampling_params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(HASH_BLOCK_SIZE, sha256),
    )


class Live:
    """A request holding blocks of one pool in one group."""

    def __init__(self, req, pool, group, blocks, num_full, tail_symbol):
        self.req: Request = req
        self.pool: BlockPool = pool
        self.group: int = group
        self.blocks: list[KVCacheBlock] = blocks
        self.num_full: int = num_full
        # Symbol of the half-filled last block, None when there is none.
        self.tail_symbol: int | None = tail_symbol


class CopySemanticsMachine(RuleBasedStateMachine):
    policy = "logical"
    check_set = True
    check_count = True

    def __init__(self) -> None:
        super().__init__()
        init_none_hash(sha256)
        self.gpu = BlockPool(
            num_gpu_blocks=NUM_GPU_BLOCKS,
            enable_caching=True,
            hash_block_size=HASH_BLOCK_SIZE,
            enable_kv_cache_events=True,
            kv_events_copy_semantics=self.policy,
        )
        self.host = SharedEventQueueBlockPool(
            num_gpu_blocks=NUM_HOST_BLOCKS,
            enable_caching=True,
            hash_block_size=HASH_BLOCK_SIZE,
            enable_kv_cache_events=True,
            medium=MEDIUM_CPU,
            kv_events_copy_semantics=self.policy,
            event_owner=self.gpu,
        )
        self.pools = (self.gpu, self.host)
        # The coordinator's reset over both pools, as with a bound host pool.
        self.coordinator = SimpleNamespace(
            single_type_managers=[
                SimpleNamespace(block_pool=self.gpu),
                SimpleNamespace(block_pool=self.host),
            ]
        )
        self.live: list[Live] = []
        self.mirror = Mirror(self.policy)

    # ----------------------------------------------------------- rules

    @rule(
        pool_idx=st.integers(0, 1),
        group=st.sampled_from(GROUPS),
        # A small alphabet, so that requests share prefixes and keys.
        symbols=st.lists(st.integers(0, 1), min_size=1, max_size=3),
        tail=st.none() | st.integers(0, 1),
        use_hits=st.booleans(),
    )
    def start_request(self, pool_idx, group, symbols, tail, use_hits):
        """Allocate (evicting as needed) and cache a request's blocks.

        Without hits the blocks are recomputed, so the same keys get more
        copies; a tail half-block gets a partial-prefix entry.
        """
        pool = self.pools[pool_idx]
        token_ids = [s for s in symbols for _ in range(BLOCK_SIZE)]
        if tail is not None:
            token_ids += [tail] * HASH_BLOCK_SIZE
        req = make_request(token_ids)
        hashes = resolve_block_hashes(req.block_hashes, HASH_BLOCK_SIZE, BLOCK_SIZE)
        num_full = len(symbols)
        hits: list[KVCacheBlock] = []
        if use_hits:
            for i in range(num_full):
                cached = pool.get_cached_block(hashes[i], [group])
                if cached is None:
                    break
                hits.append(cached[0])
        num_new = num_full - len(hits) + (tail is not None)
        num_free_hits = len({b.block_id for b in hits if b.ref_cnt == 0})
        if num_new + num_free_hits > pool.get_num_free_blocks():
            return
        pool.touch(hits)
        blocks = hits + pool.get_new_blocks(num_new)
        pool.cache_full_blocks(
            request=req,
            blocks=blocks,
            num_cached_blocks=len(hits),
            num_full_blocks=num_full,
            block_size=BLOCK_SIZE,
            kv_cache_group_id=group,
        )
        if tail is not None:
            pool.cache_partial_block(
                request=req,
                block=blocks[-1],
                num_tokens=len(token_ids),
                kv_cache_group_id=group,
                block_size=BLOCK_SIZE,
            )
        self.live.append(Live(req, pool, group, blocks, num_full, tail))

    @precondition(lambda self: self.live)
    @rule(idx=st.integers(0, 10**6))
    def free_request(self, idx):
        live = self.live.pop(idx % len(self.live))
        live.pool.free_blocks(reversed(live.blocks))

    @rule(pool_idx=st.integers(0, 1), block_ids=st.sets(st.integers(1, 9)))
    def evict_blocks(self, pool_idx, block_ids):
        pool = self.pools[pool_idx]
        pool.evict_blocks({i for i in block_ids if i < pool.num_gpu_blocks})

    @precondition(lambda self: any(lv.tail_symbol is not None for lv in self.live))
    @rule(idx=st.integers(0, 10**6))
    def promote_tail(self, idx):
        """Fill the half block and cache it full (partial->full promotion)."""
        with_tail = [lv for lv in self.live if lv.tail_symbol is not None]
        live = with_tail[idx % len(with_tail)]
        live.req.append_output_token_ids([live.tail_symbol] * HASH_BLOCK_SIZE)
        live.pool.cache_full_blocks(
            request=live.req,
            blocks=live.blocks,
            num_cached_blocks=live.num_full,
            num_full_blocks=live.num_full + 1,
            block_size=BLOCK_SIZE,
            kv_cache_group_id=live.group,
        )
        live.num_full += 1
        live.tail_symbol = None

    @precondition(lambda self: any(lv.tail_symbol is not None for lv in self.live))
    @rule(idx=st.integers(0, 10**6), replace=st.booleans())
    def recache_tail(self, idx, replace):
        """Re-register the tail's partial entry (the replace path)."""
        with_tail = [lv for lv in self.live if lv.tail_symbol is not None]
        live = with_tail[idx % len(with_tail)]
        live.pool.cache_partial_block(
            request=live.req,
            block=live.blocks[-1],
            num_tokens=live.num_full * BLOCK_SIZE + HASH_BLOCK_SIZE,
            kv_cache_group_id=live.group,
            block_size=BLOCK_SIZE,
            replace_existing_hashes=replace,
        )

    @precondition(lambda self: self.live)
    @rule(idx=st.integers(0, 10**6), block_idx=st.integers(0, 3))
    def partial_entry_on_full_block(self, idx, block_idx):
        """Make a full block reachable from its mid-block boundary too."""
        live = self.live[idx % len(self.live)]
        if block_idx >= live.num_full:
            return
        live.pool.cache_partial_block(
            request=live.req,
            block=live.blocks[block_idx],
            num_tokens=block_idx * BLOCK_SIZE + HASH_BLOCK_SIZE,
            kv_cache_group_id=live.group,
            block_size=BLOCK_SIZE,
        )

    @precondition(lambda self: self.live)
    @rule(idx=st.integers(0, 10**6), block_idx=st.integers(0, 3))
    def move_block_hashes(self, idx, block_idx):
        """Copy-on-write: the cache keeps a private copy under the hashes."""
        live = self.live[idx % len(self.live)]
        if block_idx >= len(live.blocks) or live.pool.get_num_free_blocks() == 0:
            return
        src = live.blocks[block_idx]
        dst = live.pool.get_new_blocks(1)[0]
        if src.block_hash is None and src.block_id not in (
            live.pool.cached_block_hashes_by_block
        ):
            live.pool.free_blocks([dst])
            return
        num_events = len(live.pool.kv_event_queue)
        before = self.resident()
        live.pool.move_block_hashes(src, dst)
        assert len(live.pool.kv_event_queue) == num_events, "move emitted events"
        assert self.resident() == before, "move changed the resident keys"
        live.pool.free_blocks([dst])

    @rule(free_all=st.booleans())
    def reset(self, free_all):
        """All-or-nothing reset over both pools, as the coordinator does."""
        if free_all:
            for live in self.live:
                live.pool.free_blocks(reversed(live.blocks))
            self.live.clear()
        before = self.resident()
        ok = KVCacheCoordinator.reset_prefix_cache(self.coordinator)  # type: ignore[arg-type]
        if ok:
            assert self.resident() == set()
        else:
            assert self.live and self.resident() == before

    @rule()
    def reset_host_pool(self):
        """The host pool alone: its removals must not touch the GPU tier."""
        before = self.resident()
        if self.host.reset_prefix_cache():
            assert self.resident() == {k for k in before if k[0] != MEDIUM_CPU}
        else:
            assert self.resident() == before

    # ------------------------------------------------------- invariant

    def resident(self) -> set[tuple]:
        return {
            (p.medium, get_group_id(k), maybe_convert_block_hash(get_block_hash(k)))
            for p in self.pools
            for k in p.cached_block_hash_to_block.resident_keys
        }

    @invariant()
    def mirrors_match_resident_keys(self):
        for event in self.gpu.take_events():
            assert isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared)
            self.mirror.apply(event)
        resident = self.resident()
        if self.check_set:
            assert self.mirror.set.keys == resident, "set mirror diverged"
            assert not self.mirror.set.unknown_removals, (
                "set mirror diverged: removal of keys it does not hold: "
                f"{self.mirror.set.unknown_removals}"
            )
        if self.check_count:
            assert not self.mirror.count.unknown_removals, (
                "counting mirror diverged: removal of keys it holds no count "
                f"for: {self.mirror.count.unknown_removals}"
            )
            assert self.mirror.count.counts == self.expected_counts(), (
                "counting mirror diverged"
            )

    def expected_counts(self) -> Counter[tuple]:
        """Per resident key, the stores a counting consumer holds: one per
        physical copy under "physical", one per key otherwise."""
        counts: Counter[tuple] = Counter()
        for p in self.pools:
            index = p.cached_block_hash_to_block
            for k in index.resident_keys:
                key = (
                    p.medium,
                    get_group_id(k),
                    maybe_convert_block_hash(get_block_hash(k)),
                )
                copies = index.num_copies(k)
                counts[key] += copies if self.policy == "physical" else 1
        return counts


def make_machine(policy: str, check_set: bool, check_count: bool) -> type:
    return type(
        f"Machine_{policy}_{int(check_set)}{int(check_count)}",
        (CopySemanticsMachine,),
        {"policy": policy, "check_set": check_set, "check_count": check_count},
    )


def run(machine: type, max_examples: int, shrink: bool = True) -> None:
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=30,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            phases=([Phase.generate, Phase.shrink] if shrink else [Phase.generate]),
        ),
    )


def test_logical_keeps_set_and_counting_mirrors_exact():
    run(make_machine("logical", check_set=True, check_count=True), max_examples=1500)


@pytest.mark.parametrize(
    ("policy", "check_set", "check_count"),
    [("physical", False, True), ("last_copy", True, False)],
)
def test_other_policies_keep_the_mirror_they_are_made_for(
    policy, check_set, check_count
):
    run(make_machine(policy, check_set, check_count), max_examples=300)


@pytest.mark.parametrize(
    ("policy", "check_set", "check_count", "message"),
    [
        ("physical", True, False, "set mirror diverged"),
        ("last_copy", False, True, "counting mirror diverged"),
    ],
)
def test_checker_detects_divergence(policy, check_set, check_count, message):
    with pytest.raises(AssertionError, match=message):
        run(make_machine(policy, check_set, check_count), 1000, shrink=False)
