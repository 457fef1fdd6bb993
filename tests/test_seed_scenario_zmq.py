"""The seed's end-to-end KV-event scenario, on a CPU, against the installed vLLM.

vLLM's real v1 ``Scheduler`` (with its real ``KVCacheManager``/``BlockPool``)
and its real ZMQ event publisher (``EventPublisherFactory`` ->
``ZmqEventPublisher``), driven with model outputs made up here (no model
runs): block size 16, 8 GPU blocks, prefix caching on, KV events on.

1. three identical 32-token requests, one after the other, each finishing
   after one generated token.  The first caches both prompt blocks; the
   next two hit the first block only (the last prompt token is always
   recomputed), so each recomputes the second block into a new physical
   block: three physical copies of one key, the *target* (the hash of the
   repeated prompt's final, 2nd, block);
2. twelve unique 32-token requests, one after the other: they need more
   blocks than are free, so every cached copy of the target is evicted.

A real ZMQ SUB socket on 127.0.0.1 decodes every message with the stock
msgspec schema (``vllm.distributed.kv_events.KVEventBatch``) and counts the
events that name the target.  Expected per ``KVEventsConfig.copy_semantics``:

    policy     stored before  removed before  removed after  decode errors
    logical          1              0               1              0
    last_copy        3              0               1              0
    physical         3              0               3              0

On a vLLM without the ``copy_semantics`` field the policy tests fail (they
do not skip): that build is not the patched engine.  Run this file as a
script to print the report of any build, e.g. the unpatched wheel's::

    python tests/test_seed_scenario_zmq.py --no-policy     # 0.33.0: 3/0/3/0

About the endpoint: in vLLM 0.33.0 a publisher endpoint with a concrete host
(``tcp://127.0.0.1:PORT``) *connects* (only ``*``/``::``/ipc/inproc bind),
so the subscriber binds 127.0.0.1 on a free port chosen by the OS and the
publisher connects to it; nothing listens beyond the loopback interface.

The phases are delimited in the stream itself: the test publishes empty
``KVEventBatch`` marker batches (negative ``ts``) through the same publisher,
first to wait until the subscriber is connected (ZMQ drops what a PUB sends
before the subscription arrives), then after each phase.  ZMQ keeps order on
one connection, so everything before a marker has arrived when the marker
has.  Sequence numbers are checked for gaps.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# pytest puts ci/ on sys.path (pyproject.toml); run as a script, this does.
_CI_DIR = str(Path(__file__).resolve().parents[1] / "ci")
if _CI_DIR not in sys.path:
    sys.path.insert(0, _CI_DIR)
from overlay_harness import seed_scenario  # noqa: E402
from overlay_harness.cpu_scheduler import make_cpu_scheduler, step  # noqa: E402
from overlay_harness.seed_scenario import Report, Subscriber  # noqa: E402

# No model hub, ever: the model config ships with the test.  Set before vLLM
# (and huggingface_hub, which reads it at import) is imported below.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

MODEL_DIR = Path(__file__).parent / "data" / "tiny-model"
BLOCK_SIZE = seed_scenario.BLOCK_SIZE
NUM_GPU_BLOCKS = seed_scenario.NUM_GPU_BLOCKS
SAMPLED_TOKEN = 7  # what the made-up model "generates"
MAX_STEPS_PER_REQUEST = 8
HANDSHAKE_TIMEOUT_S = 10.0
RECEIVE_TIMEOUT_S = 10.0

# Marker batches (empty event lists) carry these ts values; real batches
# carry time.time() > 0.
TS_PROBE = -1.0
TS_END_PHASE_1 = -2.0
TS_END_PHASE_2 = -3.0

POLICY_FIELD = seed_scenario.POLICY_FIELD
EXPECTED = seed_scenario.EXPECTED
DEFAULT_POLICY = seed_scenario.DEFAULT_POLICY


def has_policy_field() -> bool:
    from vllm.config import KVEventsConfig

    return POLICY_FIELD in {f.name for f in dataclasses.fields(KVEventsConfig)}


def make_kv_events_config(endpoint: str, policy: str | None) -> Any:
    """``policy=None``: leave ``copy_semantics`` out (the build's default)."""
    import vllm
    from vllm.config import KVEventsConfig

    if policy is not None and not has_policy_field():
        pytest.fail(
            f"KVEventsConfig has no field {POLICY_FIELD!r}: the installed vLLM "
            f"{vllm.__version__} ({vllm.__file__}) is not the patched engine",
            pytrace=False,
        )
    return KVEventsConfig(**seed_scenario.kv_events_fields(endpoint, policy))


def make_scheduler(kv_events_config: Any) -> tuple[Scheduler, Any]:
    """The real Scheduler as EngineCore builds it, minus the model, and the
    block hasher EngineCore gives its requests."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    scheduler = make_cpu_scheduler(
        str(MODEL_DIR),
        NUM_GPU_BLOCKS,
        max_num_seqs=16,
        max_model_len=256,
        max_num_batched_tokens=2048,
        seed=0,
        block_size=BLOCK_SIZE,
        kv_events_config=kv_events_config,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
    )
    cache_config = scheduler.vllm_config.cache_config
    hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(
        BLOCK_SIZE, hash_fn, scheduler.vllm_config.num_hash_lookahead_tokens
    )
    return scheduler, hasher


def make_request(req_id: str, prompt: list[int], hasher: Any) -> Request:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    params.update_from_generation_config({}, None)
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        block_hasher=hasher,
    )


def run_request(scheduler: Scheduler, request: Request) -> None:
    """Add one request and step the scheduler until it has finished."""
    scheduler.add_request(request)
    for _ in range(MAX_STEPS_PER_REQUEST):
        step(scheduler, lambda _request: SAMPLED_TOKEN)
        if not scheduler.has_unfinished_requests():
            return
    raise AssertionError(
        f"request {request.request_id} not finished after "
        f"{MAX_STEPS_PER_REQUEST} scheduler steps"
    )


def wait_connected(publisher: Any, sub: Subscriber) -> None:
    """Publish probe batches until the subscriber receives one."""
    from vllm.distributed.kv_events import KVEventBatch

    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    while time.monotonic() < deadline:
        publisher.publish(KVEventBatch(ts=TS_PROBE, events=[]))
        if sub.recv(0.05) is not None:
            return
    raise AssertionError(
        f"subscriber on {sub.endpoint} got nothing from the publisher within "
        f"{HANDSHAKE_TIMEOUT_S} s"
    )


def run_scenario(policy: str | None) -> Report:
    from vllm.distributed.kv_events import (
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    sub = Subscriber()
    scheduler = None
    try:
        scheduler, hasher = make_scheduler(make_kv_events_config(sub.endpoint, policy))
        publisher = scheduler.kv_event_publisher
        assert isinstance(publisher, ZmqEventPublisher), type(publisher)
        wait_connected(publisher, sub)

        repeated = [
            make_request(f"repeat-{i}", seed_scenario.REPEATED_PROMPT, hasher)
            for i in range(seed_scenario.NUM_REPEATS)
        ]
        target = maybe_convert_block_hash(repeated[0].block_hashes[1])
        for req in repeated:
            run_request(scheduler, req)
        publisher.publish(KVEventBatch(ts=TS_END_PHASE_1, events=[]))
        for i in range(seed_scenario.NUM_UNIQUE):
            run_request(
                scheduler,
                make_request(f"unique-{i}", seed_scenario.unique_prompt(i), hasher),
            )
        publisher.publish(KVEventBatch(ts=TS_END_PHASE_2, events=[]))

        before = sub.recv_until_marker(TS_END_PHASE_1, RECEIVE_TIMEOUT_S)
        after = sub.recv_until_marker(TS_END_PHASE_2, RECEIVE_TIMEOUT_S)
    finally:
        if scheduler is not None:
            scheduler.shutdown()  # shuts the publisher down
        sub.close()

    # The target must be what the stream calls the 2nd block of the prompt.
    stored = [
        ev
        for b in before
        for ev in b.events
        if isinstance(ev, BlockStored) and target in ev.block_hashes
    ]
    assert stored, "no BlockStored for the repeated prompt's 2nd block"
    ev = stored[0]
    i = ev.block_hashes.index(target)
    assert seed_scenario.block_tokens(ev, i) == seed_scenario.TARGET_TOKENS

    return Report.from_stream(
        policy if policy is not None else "(not set)", before, after, target, sub
    )


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Also offline if huggingface_hub was imported before this module."""
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True, raising=False)
    yield


def _show(capsys: pytest.CaptureFixture[str], report: Report) -> None:
    with capsys.disabled():
        print(f"\nseed scenario: {report.line()}")


def test_expected_names_every_copy_semantics_of_the_engine() -> None:
    """The harness's table (which the CPU server tests and the live-router
    bench take their policies from) has one row per value of the engine's
    ``KVEventsCopySemantics``, in its order."""
    from vllm.config.kv_events import KV_EVENTS_COPY_SEMANTICS

    assert tuple(EXPECTED) == KV_EVENTS_COPY_SEMANTICS


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", list(EXPECTED))
def test_seed_scenario(policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_scenario(policy)
    _show(capsys, report)
    assert report.seq_gaps == 0
    assert report.figures() == EXPECTED[policy], report.line()


@pytest.mark.timeout(120)
def test_seed_scenario_default_policy_is_logical(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if not has_policy_field():
        import vllm

        pytest.fail(
            f"KVEventsConfig has no field {POLICY_FIELD!r}: the installed vLLM "
            f"{vllm.__version__} is not the patched engine",
            pytrace=False,
        )
    report = run_scenario(None)
    _show(capsys, report)
    assert report.figures() == EXPECTED[DEFAULT_POLICY], report.line()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--policy", choices=list(EXPECTED), action="append")
    g.add_argument(
        "--no-policy",
        action="store_true",
        help="leave copy_semantics out (works on a build without the field)",
    )
    args = ap.parse_args(argv)
    policies: list[str | None] = (
        [None] if args.no_policy else list(args.policy or EXPECTED)
    )
    for p in policies:
        if p is not None and not has_policy_field():
            print(f"KVEventsConfig has no field {POLICY_FIELD!r}; try --no-policy")
            return 2
        print(run_scenario(p).line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
