# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The reference consumer is exact on every store shape the engine sends.

* Partial tails: with ``hash_block_size < block_size`` the full-attention
  manager also caches the prompt's last hash boundary inside a block
  (``cache_partial_block``), announced as a ``BlockStored`` of the hash size
  in the same group as the full blocks. The consumer's prefix match must
  still walk the group's full blocks, live and after a snapshot, and agree
  with the engine's own prefix hit (the real ``Scheduler``).
* Zero-size stores: the OffloadingConnector's default payload
  (``self_describing_kv_events`` off) announces each offloaded chunk with
  ``block_size=0`` and no token ids. The consumer holds the key, leaves it
  out of the prefix match, and its CLI with ``--match`` prints the state
  instead of a traceback (the real connector and ``ZmqEventPublisher``).
"""

import json

import pytest
import torch

from tests.v1.core.block_pool_view import model_runner_output
from tests.v1.core.test_duplicate_block_identity_scheduler import (
    EOS_TOKEN_ID,
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
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed import kv_events_consumer
from vllm.distributed.kv_events import (
    RECORD_SCHEMA,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.distributed.kv_events_consumer import Follower, Mirror
from vllm.distributed.kv_events_record import KVEventRecord
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.utils.math_utils import round_up
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

# Full attention and sliding window, both 64-token blocks, hashed every 16.
GROUP_BLOCK = 64
HASH_BLOCK = 16
PROMPT_LEN = 168  # two full blocks and a tail that ends inside the third


@pytest.fixture(autouse=True)
def _init_none_hash():
    init_none_hash(sha256)


@pytest.fixture(autouse=True)
def _loopback(monkeypatch):
    # tcp://*:0 binds VLLM_HOST_IP on a free port.
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_opt")
    (path / "config.json").write_text(json.dumps(TINY_OPT_CONFIG))
    return str(path)


class Tap:
    """Stands in for the scheduler's publisher: keeps every event."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, batch) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        return


def fa_swa_scheduler(model_dir: str) -> Scheduler:
    spec = dict(num_kv_heads=1, head_size=1, dtype=torch.float32)
    specs = [
        FullAttentionSpec(block_size=GROUP_BLOCK, **spec),
        SlidingWindowSpec(block_size=GROUP_BLOCK, sliding_window=GROUP_BLOCK, **spec),
    ]
    num_blocks = 32
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=256,
            max_model_len=1024,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            watermark=0.0,
        ),
        model_config=tiny_model_config(model_dir),
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=GROUP_BLOCK, enable_prefix_caching=True),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    register_all_kvcache_specs(vllm_config)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)
            ],
        ),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=GROUP_BLOCK,
        hash_block_size=HASH_BLOCK,
        log_stats=True,
    )


def request(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(ignore_eos=True, max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(HASH_BLOCK, sha256),
    )


def run_to_completion(scheduler: Scheduler) -> None:
    """Engine steps with a made-up model until no request is left."""
    while scheduler.requests:
        out = scheduler.schedule()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            req = scheduler.requests[req_id]
            sampled.append([5] if req.num_computed_tokens >= req.num_tokens else [])
        scheduler.update_from_output(
            out,
            model_runner_output(req_ids, sampled),
        )


def test_partial_tail_stores_keep_the_groups_block_size(model_dir):
    scheduler = fa_swa_scheduler(model_dir)
    tap = Tap()
    scheduler.kv_event_publisher = tap
    prompt = [3 + (i * 7) % 900 for i in range(PROMPT_LEN)]
    # Decoding past the third block's end makes the manager cache the
    # prompt's last hash boundary (160) inside that block.
    scheduler.add_request(request("a", prompt, max_tokens=40))
    run_to_completion(scheduler)
    stores = [e for e in tap.events if isinstance(e, BlockStored)]
    tails = [e for e in stores if e.group_idx == 0 and e.block_size == HASH_BLOCK]
    assert tails, "no partial-tail store: the scenario no longer reaches it"
    # The partial tail is not the group's last store of the full size only by
    # chance: it must come after a full block of its group.
    assert stores.index(tails[-1]) > 0

    live = Mirror("logical")
    record = KVEventRecord("logical", RECORD_SCHEMA)
    for event in tap.events:
        live.apply(event)
    record.apply(tap.events)
    recovered = Mirror("logical")
    for batch in record.snapshot(keys_per_batch=2):
        for event in batch:
            recovered.apply(event)
    assert recovered.held_keys() == live.held_keys()

    # What the engine serves from its cache for the same prompt now.
    blocks, hit_tokens = scheduler.kv_cache_manager.get_computed_blocks(
        request("b", prompt, max_tokens=1)
    )[:2]
    assert hit_tokens == 2 * GROUP_BLOCK
    full_attention = ("GPU", 0)
    want = len(blocks.blocks[0])
    assert live.match(prompt)[full_attention] == want == 2
    assert recovered.match(prompt) == live.match(prompt)
    assert live.block_size[full_attention] == GROUP_BLOCK


def offloading_connector(model_dir: str) -> OffloadingConnector:
    """The OffloadingConnector's scheduler side as the engine builds it, with
    its default event payload (``self_describing_kv_events`` not set)."""
    chunk_bytes = round_up(_BYTES_PER_BLOCK * 2, CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)
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
                "cpu_bytes_to_use": chunk_bytes * 3,
                "blocks_per_chunk": 2,
            },
        ),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        device_config=DeviceConfig("cpu"),
    )
    return OffloadingConnector(
        vllm_config, KVConnectorRole.SCHEDULER, _make_kv_cache_config(16)
    )


def test_zero_size_stores_are_held_and_never_matched(model_dir, capsys):
    connector = offloading_connector(model_dir)
    pub = ZmqEventPublisher(0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    try:
        scheduler = connector.scheduler
        group = scheduler.config.kv_group_configs[0]
        prompt = [7] * BLOCK_SIZE + [8] * BLOCK_SIZE + [1]
        req = Request(
            request_id="a",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        )
        # Offload the request's first chunk, as _build_store_jobs does.
        key = make_offload_key(req.block_hashes[1], 0)
        ctx = ReqContext(req_id=req.request_id)
        scheduler.manager.on_new_request(ctx)
        assert scheduler.manager.prepare_store([key], ctx) is not None
        scheduler._events_tracker.record_store(req, group, 0, key)
        scheduler.manager.complete_store([key], ctx)
        events = list(connector.take_events())
        assert [e.block_size for e in events if isinstance(e, BlockStored)] == [0]

        mirror = Mirror("logical")
        for event in events:
            mirror.apply(event)
        assert len(mirror.held_keys()) == 1
        assert mirror.match(prompt) == {}

        # The CLI, following the real publisher, prints its match.
        pub.publish(KVEventBatch(ts=0.0, events=events))
        config = pub.get_publisher_config()
        follower = Follower(config.endpoint, config.replay_endpoint)
        try:
            follower.sync(min_next_seq=1)
        finally:
            follower.close()
        tokens = ",".join(map(str, prompt))
        rc = kv_events_consumer.main(
            ["--endpoint", config.endpoint, "--replay-endpoint"]
            + [config.replay_endpoint, "--once", "--match", tokens]
        )
        out = capsys.readouterr()
        assert "Traceback" not in out.err
        state = json.loads(out.out.splitlines()[-1])
        assert rc == 0, out
        assert state["tiers"] == {
            "CPU/0": {"set_keys": 1, "count_keys": 1, "count_copies": 1}
        }
        assert state["match"] == {}
    finally:
        pub.shutdown()
        connector.shutdown()
