# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV events of the OffloadingConnector tier follow ``copy_semantics``.

Two requests that share their first block but not their second offload two
chunks of two blocks each: the shared block's hash is then held by both
chunks, two copies of one hash on the CPU tier. Per
``KVEventsConfig.copy_semantics`` the tier announces it once ("logical") or
per chunk ("last_copy", "physical", as upstream), and removes it when the
last chunk holding it leaves ("logical", "last_copy") or per chunk
("physical"). A connector reset removes what the tier announced.

Upstream's own tests of the tracker build its config directly, whose
default keeps upstream's stream ("physical"), so they run unchanged; the
engine passes the configured value, which these tests check through
``OffloadingConnector`` built as the engine builds it (local model config,
scheduler role, real ``CPUOffloadingManager``). Stores are driven the way the
connector's scheduler drives them: ``prepare_store``, ``record_store``,
``complete_store``.
"""

import json
import tracemalloc
from collections import Counter

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
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
from vllm.distributed.kv_events_consumer import COPY_SEMANTICS, Mirror
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.utils.math_utils import round_up
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingKVEventsConfig,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.request import Request

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

POLICIES = KV_EVENTS_COPY_SEMANTICS
BLOCKS_PER_CHUNK = 2
CPU_CHUNKS = 3


@pytest.fixture(autouse=True)
def _init_none_hash():
    init_none_hash(sha256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_opt")
    (path / "config.json").write_text(json.dumps(TINY_OPT_CONFIG))
    return str(path)


@pytest.fixture
def connectors():
    built: list[OffloadingConnector] = []
    yield built
    for connector in built:
        connector.shutdown()


def make_connector(
    built: list[OffloadingConnector],
    model_dir: str,
    policy: str | None,
    secondary_tiers: list[dict] | None = None,
) -> OffloadingConnector:
    """The scheduler side of the OffloadingConnector as the engine builds it,
    with room for ``CPU_CHUNKS`` chunks of ``BLOCKS_PER_CHUNK`` blocks;
    ``policy`` None: the events config's default. With ``secondary_tiers``
    the CPU tier is the primary tier of a ``TieringOffloadingSpec``."""
    chunk_bytes = round_up(
        _BYTES_PER_BLOCK * BLOCKS_PER_CHUNK, CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    )
    tiering = (
        {"spec_name": "TieringOffloadingSpec", "secondary_tiers": secondary_tiers}
        if secondary_tiers is not None
        else {}
    )
    kv_events_config = (
        KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        if policy is None
        else KVEventsConfig(
            enable_kv_cache_events=True, publisher="null", copy_semantics=policy
        )
    )
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=256,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        model_config=tiny_model_config(model_dir),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use": chunk_bytes * CPU_CHUNKS,
                "blocks_per_chunk": BLOCKS_PER_CHUNK,
                "self_describing_kv_events": True,
                **tiering,
            },
        ),
        kv_events_config=kv_events_config,
        device_config=DeviceConfig("cpu"),
    )
    connector = OffloadingConnector(
        vllm_config, KVConnectorRole.SCHEDULER, _make_kv_cache_config(16)
    )
    built.append(connector)
    return connector


def make_request(request_id: str, first: int, second: int) -> Request:
    """Two full blocks (tokens ``first`` then ``second``) and one token."""
    return Request(
        request_id=request_id,
        prompt_token_ids=[first] * BLOCK_SIZE + [second] * BLOCK_SIZE + [1],
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def wire(request: Request) -> list:
    return [maybe_convert_block_hash(h) for h in request.block_hashes]


class Tier:
    """Drives the connector's CPU tier and checks its stream after each step:
    the reference consumer's set-style and counting mirrors, each where the
    policy keeps it exact, against the hashes the resident chunks hold."""

    def __init__(self, connector: OffloadingConnector, policy: str) -> None:
        self.connector = connector
        self.scheduler = connector.scheduler
        self.group = self.scheduler.config.kv_group_configs[0]
        self.policy = policy
        # Resident chunks: offload key -> the request whose chunk it is.
        self.chunks: dict = {}
        self.mirror = Mirror(policy)
        self.events: list = []

    def store(self, request: Request) -> None:
        """Offload the request's first chunk, as ``_build_store_jobs`` does."""
        key = make_offload_key(request.block_hashes[BLOCKS_PER_CHUNK - 1], 0)
        ctx = ReqContext(req_id=request.request_id)
        manager = self.scheduler.manager
        manager.on_new_request(ctx)
        output = manager.prepare_store([key], ctx)
        assert output is not None and output.keys_to_store == [key]
        for evicted in output.evicted_keys:
            del self.chunks[evicted]
        self.scheduler._events_tracker.record_store(request, self.group, 0, key)
        manager.complete_store([key], ctx)
        self.chunks[key] = request

    def holds(self, request: Request) -> bool:
        return any(req is request for req in self.chunks.values())

    def take(self) -> list:
        self.events = list(self.connector.take_events())
        for event in self.events:
            assert event.medium == MEDIUM_CPU
            self.mirror.apply(event)
        held = Counter(
            (MEDIUM_CPU, 0, h) for req in self.chunks.values() for h in wire(req)
        )
        exact = COPY_SEMANTICS[self.policy]
        # Under "physical" a set-style consumer has dropped the hash at its
        # first copy's removal already.
        if "set" in exact:
            assert not self.mirror.set.unknown_removals
            assert self.mirror.set.key_set() == set(held)
        assert not self.mirror.count.unknown_removals
        if "count" in exact:
            assert self.mirror.count.counts == (
                Counter(set(held)) if self.policy == "logical" else held
            )
        return self.events


@pytest.mark.parametrize("policy", POLICIES)
def test_chunks_sharing_a_hash_follow_copy_semantics(model_dir, connectors, policy):
    tier = Tier(make_connector(connectors, model_dir, policy), policy)
    a, b = make_request("a", 1, 2), make_request("b", 1, 3)
    assert a.block_hashes[0] == b.block_hashes[0]

    tier.store(a)
    [stored] = tier.take()
    assert stored.block_hashes == wire(a) and stored.parent_block_hash is None

    tier.store(b)
    [stored] = tier.take()
    if policy == "logical":
        # Only the new hash, with its own parent and tokens.
        assert stored.block_hashes == wire(b)[1:]
        assert stored.parent_block_hash == wire(b)[0]
        assert stored.token_ids == b.all_token_ids[BLOCK_SIZE : 2 * BLOCK_SIZE]
    else:
        assert stored.block_hashes == wire(b)
        assert stored.token_ids == b.all_token_ids[: 2 * BLOCK_SIZE]

    # Two more chunks fill the tier; the next evicts a's chunk (LRU).
    tier.store(make_request("c", 4, 5))
    tier.take()
    tier.store(make_request("d", 6, 7))
    [removed] = [e for e in tier.take() if isinstance(e, BlockRemoved)]
    assert not tier.holds(a)
    if policy == "physical":
        assert removed.block_hashes == wire(a)
    else:
        # b's chunk still holds the shared hash.
        assert removed.block_hashes == wire(a)[1:]

    # The reset empties the CPU tier: consumers drop what it announced.
    tier.connector.reset_cache()
    tier.chunks.clear()
    removals = tier.take()
    assert removals and all(isinstance(e, BlockRemoved) for e in removals)
    assert not tier.mirror.held_keys()


@pytest.mark.skipif(
    "lookahead_token_ids" not in BlockStored.__struct_fields__,
    reason="the release's BlockStored carries no lookahead token ids",
)
def test_a_run_of_new_hashes_carries_its_own_lookahead_tokens(model_dir, connectors):
    """Under "logical" a chunk whose first hash is announced already is
    published from its second block on, with one list of lookahead token ids
    per hash it names: the second block's."""
    tier = Tier(make_connector(connectors, model_dir, "logical"), "logical")
    # As upstream's tests of the tracker set it; the engine sets it for EAGLE.
    tier.scheduler._events_tracker.num_hash_lookahead_tokens = 1
    a, b = make_request("a", 1, 2), make_request("b", 1, 3)

    tier.store(a)
    [stored] = tier.take()
    # The token after each block: a's second block's first, then the last.
    assert stored.lookahead_token_ids == [[2], [1]]

    tier.store(b)
    [stored] = tier.take()
    assert stored.block_hashes == wire(b)[1:]
    assert stored.lookahead_token_ids == [[1]]


@pytest.mark.parametrize("policy", POLICIES)
def test_stores_before_a_reset_are_removed_by_it(model_dir, connectors, policy):
    """Stores not yet taken when the connector resets are published before
    the reset's removals, which cover them."""
    tier = Tier(make_connector(connectors, model_dir, policy), policy)
    a = make_request("a", 1, 2)
    tier.store(a)
    tier.connector.reset_cache()
    tier.chunks.clear()
    stored, removed = tier.take()
    assert isinstance(stored, BlockStored) and stored.block_hashes == wire(a)
    assert isinstance(removed, BlockRemoved)
    assert sorted(removed.block_hashes) == sorted(wire(a))


@pytest.mark.parametrize("policy", POLICIES)
def test_promotion_finished_by_a_reset_is_removed_by_it(model_dir, connectors, policy):
    """With a secondary tier, the reset first finishes the tiers' jobs: a
    promotion completing then stores its chunk on the CPU tier, which the
    reset then empties. That store must not be published after the reset's
    removals, or consumers keep a chunk the tier no longer holds."""
    connector = make_connector(
        connectors, model_dir, policy, secondary_tiers=[{"type": "example"}]
    )
    tier = Tier(connector, policy)
    manager = tier.scheduler.manager
    step_end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    a = make_request("a", 1, 2)
    # a's chunk reaches the secondary tier, then leaves the CPU tier.
    tier.store(a)
    manager.on_schedule_end(step_end)
    for request in (make_request("b", 3, 4), make_request("c", 5, 6)):
        tier.store(request)
        manager.on_schedule_end(step_end)
    tier.store(make_request("d", 7, 8))
    manager.on_schedule_end(step_end)
    tier.take()
    assert not tier.holds(a)

    # A lookup promotes a's chunk back; its job finishes, but is not yet
    # polled when the connector resets.
    key = make_offload_key(a.block_hashes[BLOCKS_PER_CHUNK - 1], 0)
    ctx = ReqContext(req_id="a-again")
    manager.on_new_request(ctx)
    assert manager.lookup(key, ctx) is LookupResult.HIT_PENDING
    manager.on_schedule_end(step_end)

    tier.connector.reset_cache()
    tier.chunks.clear()
    assert manager.primary_tier.lookup(key, ctx) is LookupResult.MISS
    tier.take()
    assert not tier.mirror.set.keys and not tier.mirror.count.counts


def test_engine_passes_copy_semantics_default_logical(model_dir, connectors):
    for policy in (*POLICIES, None):
        connector = make_connector(connectors, model_dir, policy)
        config = connector.scheduler._events_tracker.config
        assert config.copy_semantics == (policy or "logical")
    # Built directly (upstream's unit tests, third-party code): upstream's
    # stream.
    assert OffloadingKVEventsConfig(True, True).copy_semantics == "physical"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("ownership", [None, "secondary"])
def test_counts_are_kept_only_where_they_are_read(policy, ownership):
    """The tracker counts a tier's copies per hash only where something reads
    the counts: every tier under "logical" and "last_copy" (their gates),
    only the primary tier under "physical" (its reset removes every copy
    there), so a secondary tier's hashes cost nothing under "physical"."""
    tracker = OffloadingEventsTracker(
        OffloadingKVEventsConfig(True, False, copy_semantics=policy)
    )
    hashes = 5_000
    keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(hashes)]
    event = OffloadingEvent(
        keys=keys, medium=Medium.CPU, removed=False, ownership=ownership
    )
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        stored = list(tracker.take_events([event]))
        del stored
        per_hash = (tracemalloc.get_traced_memory()[0] - before) / hashes
    finally:
        tracemalloc.stop()
    if policy == "physical" and ownership is not None:
        assert per_hash < 8
    else:
        # A counted hash: its (tier, hash) key and the dict entry.
        assert per_hash > 100
