"""Turn the patched tree into a wheel.

Three modes:
- assemble (default): the official wheel with the touched files swapped in,
  no torch and no setup.py (assemble.py); proven by a test to give the same
  member contents as python-only.
- python-only: vLLM's own setup.py, ``pip wheel`` of the tree without build
  isolation, with ``VLLM_USE_PRECOMPILED=1``, which takes the compiled
  members from the verified official wheel, so the result is the official
  CUDA wheel with the patched Python.
- from-source: the same ``pip wheel``, compiling csrc/ with cmake, ninja and
  nvcc; the only route once a patch touches csrc/.
The last two need a build venv under the cache (a CUDA torch), rebuilt when
its requirements change.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from vllm_overlay import notice
from vllm_overlay.assemble import assemble_wheel
from vllm_overlay.errors import OverlayError
from vllm_overlay.pin import Pin
from vllm_overlay.proc import run_logged
from vllm_overlay.venv import ensure_venv

MODES = ("assemble", "python-only", "from-source")


@contextlib.contextmanager
def one_at_a_time(build_dir: Path, what: str = "build") -> Iterator[None]:
    """Hold the target's build lock (``.lock`` in its build folder): two
    builds of one target lay, patch and remove the same ``tree.partial``.
    A second build says whom it waits for, then waits. The folder of
    another target (``build/targets/NAME``) has a lock of its own. ``what``
    names the work in that line (the rebase's gate locks its venvs too)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode().strip() or "unknown"
            print(
                f"  another {what} is running (pid {holder}) in {build_dir}; "
                "waiting for it to finish",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def check_writable(cache: Path) -> None:
    """The cache takes the downloads and the unpacked release, and a lay
    retakes its record: a read-only one is refused before the build."""
    for folder in (cache, cache / "downloads", cache / "pristine"):
        if folder.exists() and not os.access(folder, os.W_OK):
            raise OverlayError(
                f"{folder} is not writable: the build keeps its downloads and the "
                "unpacked release there",
                f"make it writable (`chmod -R u+w {folder.resolve()}`), or move it "
                f"away (`mv {cache} {cache}.ro`) and the build makes a new one",
            )


def build_env(pin: Pin, requirements: Path, cache_dir: Path, log_dir: Path) -> Path:
    """Return the python of a ready build venv for ``pin``."""
    return ensure_venv(
        cache_dir,
        "build-env",
        [f"torch=={pin.build_torch}"],
        requirements,
        log_dir / "build-env.log",
    )


def build_wheel(
    tree: Path,
    pin: Pin,
    mode: str,
    *,
    official_wheel: Path,
    touched: set[str],
    build_requirements: Path,
    cache_dir: Path,
    out_dir: Path,
    log_dir: Path,
    source_date_epoch: int,
) -> tuple[Path, str | None]:
    """Build one wheel of ``tree`` into ``out_dir`` (emptied first); return
    it and, when the route hashed it while writing it, its sha256.

    ``touched``: the upstream-relative files that differ from upstream's.
    ``source_date_epoch`` fixes every timestamp in the wheel, so two builds
    from the same inputs give the same bytes.
    """
    if mode not in MODES:
        raise OverlayError(f"unknown build mode {mode!r}", f"use one of {MODES}")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    if mode == "assemble":
        return assemble_wheel(
            official_wheel, tree, touched, pin, out_dir, source_date_epoch
        )
    if pin.wheel_project != "vllm":
        # setup.py builds the "vllm" distribution for the torch it finds; the
        # build venv's is CUDA, so its wheel is not this target's.
        raise OverlayError(
            f"--{mode} builds vLLM's CUDA wheel, not {pin.wheel_project} ({pin.path})",
            "build this target with the default route: ./build.sh --target NAME",
        )
    if mode == "from-source":
        _check_cuda_toolkit()
    python = build_env(pin, build_requirements, cache_dir, log_dir)
    notice.declare_in_pyproject(tree)
    env = dict(
        os.environ,
        VLLM_VERSION_OVERRIDE=pin.overlay_version,
        SOURCE_DATE_EPOCH=str(source_date_epoch),
    )
    if mode == "python-only":
        env.update(
            VLLM_USE_PRECOMPILED="1",
            VLLM_PRECOMPILED_WHEEL_LOCATION=str(official_wheel),
        )
    else:
        env.pop("VLLM_USE_PRECOMPILED", None)
        env.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    run_logged(
        [
            str(python),
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            "--wheel-dir",
            str(out_dir),
            str(tree),
        ],
        log_dir / f"wheel-{mode}.log",
        env=env,
    )
    wheels = sorted(out_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise OverlayError(
            f"expected one wheel in {out_dir}, found {[w.name for w in wheels]}",
            f"read {log_dir / f'wheel-{mode}.log'}",
        )
    return _retag(wheels[0], python, pin, log_dir, source_date_epoch), None


def _check_cuda_toolkit() -> None:
    cuda_home = os.environ.get("CUDA_HOME")
    if not cuda_home or not (Path(cuda_home) / "bin" / "nvcc").is_file():
        raise OverlayError(
            f"--from-source needs a CUDA toolkit: CUDA_HOME={cuda_home!r} "
            "has no bin/nvcc",
            "set CUDA_HOME to the toolkit (e.g. /usr/local/cuda), or build "
            "without --from-source",
        )


def _retag(
    wheel: Path, python: Path, pin: Pin, log_dir: Path, source_date_epoch: int
) -> Path:
    """Give the wheel the official wheel's tag.

    setup.py tags a python-only build for the building interpreter, but its
    compiled members are the official abi3 ones, so the official tag is true.
    """
    python_tag, abi_tag, platform_tag = pin.wheel_tag.split("-")
    env = dict(os.environ, SOURCE_DATE_EPOCH=str(source_date_epoch))
    run_logged(
        [
            str(python),
            "-m",
            "wheel",
            "tags",
            "--remove",
            "--python-tag",
            python_tag,
            "--abi-tag",
            abi_tag,
            "--platform-tag",
            platform_tag,
            str(wheel),
        ],
        log_dir / "retag.log",
        env=env,
    )
    expected = wheel.parent / pin.overlay_wheel_name
    if not expected.exists():
        raise OverlayError(
            f"retagging {wheel.name} did not produce {expected.name}",
            f"read {log_dir / 'retag.log'}",
        )
    return expected
