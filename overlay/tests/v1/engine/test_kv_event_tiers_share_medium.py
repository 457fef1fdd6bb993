# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Two tiers that publish KV events with medium "CPU" do not start together.

The HiSparse host pool, the simple CPU offload pool and the
OffloadingConnector's primary tier all publish medium "CPU", and each counts
only its own copies. Consumers tell tiers apart by medium, so with two of
them in one stream under "logical" or "last_copy" one tier's removal drops a
key the other still holds. Building the engine's ``VllmConfig`` must refuse
that combination and name both tiers; "physical" (one event per copy, which
counting consumers add up across tiers), a disk-backed simple offload tier
(medium "STORAGE") and a stream with events off still build.

Through the real ``VllmConfig`` construction the engine runs. HiSparse
needs CUDA before this check is reached, so its combinations are checked on
the tier list the check reads.
"""

import pytest

from tests.v1.core.test_duplicate_block_identity_scheduler import (
    tiny_model_config,
)
from tests.v1.core.test_kv_event_stream_edges import model_dir  # noqa: F401
from vllm.config import (
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    VllmConfig,
)
from vllm.config.kv_events import KV_EVENTS_COPY_SEMANTICS
from vllm.config.kv_transfer import kv_event_cpu_tiers
from vllm.distributed.kv_events_consumer import COPY_SEMANTICS

# The policies that remove a key on its last copy only, those a set mirror
# follows ("logical", "last_copy"): there one tier's removal drops a key
# that another tier of the medium still holds.
SET_POLICIES = tuple(p for p in KV_EVENTS_COPY_SEMANTICS if "set" in COPY_SEMANTICS[p])

OFFLOADING = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
SIMPLE_CPU = {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both"}
SIMPLE_DISK = {
    "kv_connector": "SimpleCPUOffloadConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "kv_offload_backend": "disk",
        "disk_path": "/nonexistent-never-opened",
    },
}
HISPARSE = {
    "kv_connector": "HiSparseConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"host_pool_gib": 1},
}


def multi(*children: dict) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": list(children)},
    )


def build(
    model_dir: str,  # noqa: F811
    kv_transfer_config: KVTransferConfig,
    policy: str,
    events: bool = True,
) -> VllmConfig:
    return VllmConfig(
        model_config=tiny_model_config(model_dir),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv_transfer_config,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=events,
            publisher="null",
            copy_semantics=policy,
        ),
    )


@pytest.mark.parametrize("policy", SET_POLICIES)
def test_two_cpu_tiers_fail_at_start_up_naming_both(model_dir, policy):  # noqa: F811
    with pytest.raises(ValueError) as excinfo:
        build(model_dir, multi(OFFLOADING, SIMPLE_CPU), policy)
    message = str(excinfo.value)
    assert "OffloadingConnector's primary tier (MultiConnector connectors[0])" in (
        message
    )
    assert "SimpleCPUOffloadConnector's CPU pool (MultiConnector connectors[1])" in (
        message
    )
    assert repr(policy) in message


@pytest.mark.parametrize(
    ("children", "policy", "events"),
    [
        pytest.param((OFFLOADING, SIMPLE_CPU), "physical", True, id="physical"),
        pytest.param((OFFLOADING, SIMPLE_CPU), "logical", False, id="events-off"),
        pytest.param((OFFLOADING, SIMPLE_DISK), "logical", True, id="disk-tier"),
    ],
)
def test_combinations_without_a_shared_medium_build(
    model_dir,  # noqa: F811
    children,
    policy,
    events,
):
    config = build(model_dir, multi(*children), policy, events)
    connectors = config.kv_transfer_config.kv_connector_extra_config["connectors"]
    assert connectors == list(children)


def test_one_cpu_tier_builds(model_dir):  # noqa: F811
    config = build(model_dir, KVTransferConfig(**OFFLOADING), "logical")
    assert config.kv_transfer_config.kv_connector == "OffloadingConnector"


def test_hisparse_host_pool_is_a_cpu_tier():
    assert kv_event_cpu_tiers(multi(HISPARSE, OFFLOADING)) == [
        "the HiSparse host pool (MultiConnector connectors[0])",
        "the OffloadingConnector's primary tier (MultiConnector connectors[1])",
    ]
    assert kv_event_cpu_tiers(KVTransferConfig(**HISPARSE)) == [
        "the HiSparse host pool"
    ]
    assert kv_event_cpu_tiers(multi(HISPARSE, SIMPLE_DISK)) == [
        "the HiSparse host pool (MultiConnector connectors[0])"
    ]
