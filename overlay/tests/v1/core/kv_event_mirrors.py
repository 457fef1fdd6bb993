# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Router mirrors of a KV-event stream, per medium, for the overlay's tests.

The mirrors are the reference consumer's (``vllm.distributed.kv_events_consumer``,
shipped in the wheel); two consumers as deployed routers build them from
``KVEventBatch`` events:

* ``SetMirror``: a set-style router (store adds, removal discards,
  ``AllBlocksCleared`` clears);
* ``CountMirror``: a reference-counting filter (Dynamo, llm-d): +1 per stored
  hash, -1 per removed hash, the key leaves at 0.

Keys are ``(medium, group_idx, block_hash)``: the stream mixes the device
pool's keys with host tiers' (``medium`` tells them apart), and groups are
counted apart. A removal of a key the mirror does not hold (for the counting
mirror: a count that would go below zero) is recorded in ``unknown_removals``
with the event; it is always a defect of the stream.

``resident_copies`` gives the truth to compare with: the keys every pool
holds, as the events name them, with their number of physical copies.
"""

from collections import Counter

from vllm.distributed.kv_events_consumer import CountMirror, MirrorKey, SetMirror
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    maybe_convert_block_hash,
)

__all__ = ["CountMirror", "SetMirror", "resident_copies"]


def resident_copies(pools: dict[str, list[BlockPool]]) -> Counter[MirrorKey]:
    """``{(medium, group, external hash): physical copies}`` over ``pools``
    (medium -> the pools publishing under it)."""
    truth: Counter[MirrorKey] = Counter()
    for medium, medium_pools in pools.items():
        for pool in medium_pools:
            index = pool.cached_block_hash_to_block
            for key in index.resident_keys:
                external = maybe_convert_block_hash(get_block_hash(key))
                truth[(medium, get_group_id(key), external)] += index.num_copies(key)
    return truth
