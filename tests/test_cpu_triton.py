"""The CPU test harness relaxes vLLM's triton-cpu check, and only it.

``overlay_harness.cpu_triton`` lets ``CpuPlatform.check_and_update_config``
configure an engine without triton-cpu, which the package index these
machines reach does not carry (docs/testing.md, "triton-cpu"). These tests
run it against the installed vLLM of the test venv, the built wheel, in a
fresh interpreter each, and check that nothing of it ships: the wheel and the
image's Containerfile name neither the module nor its marker.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from overlay_harness import cpu_triton

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ROOT / "tests" / "data" / "tiny-model-hd32"

# Configures an engine on vLLM's CPU platform, as every Scheduler-level test
# does: argv[1] "relaxed" relaxes the check first. Prints "configured", or
# the error.
CONFIGURE = textwrap.dedent(
    """
    import sys

    from overlay_harness.cpu_triton import relax_triton_cpu_check
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    relaxed = sys.argv[1] == "relaxed" and relax_triton_cpu_check()
    model = ModelConfig(model=sys.argv[2], skip_tokenizer_init=True,
                        dtype="float32", max_model_len=128)
    try:
        VllmConfig(model_config=model, device_config=DeviceConfig("cpu"))
    except RuntimeError as error:
        print("error:", error)
    else:
        print("configured", "relaxed" if relaxed else "as is")
    """
)


def configure(mode: str) -> str:
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT / "ci"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
    }
    done = subprocess.run(
        [sys.executable, "-c", CONFIGURE, mode, str(TINY_MODEL)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def test_the_check_stops_the_cpu_platform_until_relaxed() -> None:
    outcome = configure("as is")
    if "configured" in outcome:
        pytest.skip(f"the installed vLLM has no triton-cpu check to relax: {outcome}")
    assert cpu_triton.TRITON_CPU_CHECK in outcome
    assert configure("relaxed") == "configured relaxed"


def wheels() -> list[Path]:
    found = sorted((ROOT / "dist").glob("vllm*.whl"))
    assert found, "no wheel in dist/: run ./build.sh first"
    return found


@pytest.mark.parametrize("wheel", wheels(), ids=lambda path: path.name)
def test_no_relaxation_ships_in_the_wheel(wheel: Path) -> None:
    # vLLM's own files name "cpu_triton" (cpu_triton_utils); the harness's
    # package and the marker it sets are ours alone. vllm/platforms/cpu.py
    # itself equals the official wheel's (the wheel check, test_real_release).
    needles = [b"overlay_harness", cpu_triton.RELAXED_MARKER.encode()]
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            data = archive.read(name)
            for needle in needles:
                assert needle not in data, f"{wheel.name}: {name} holds {needle!r}"


def test_no_relaxation_ships_in_the_image() -> None:
    containerfile = (ROOT / "Containerfile").read_text()
    for needle in ("overlay_harness", cpu_triton.RELAXED_MARKER, "triton"):
        assert needle not in containerfile, f"Containerfile names {needle!r}"
