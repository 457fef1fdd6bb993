"""Every compiled extension of the wheel loads against the pinned CUDA torch.

No GPU driver here: ``libcuda.so.1`` is a stub built with gcc from the
extensions' own undefined driver symbols, each returning 34
(CUDA_ERROR_STUB_LIBRARY) as NVIDIA's stub does. That is enough to import
them (nothing calls the driver at import), so the dynamic linking against
torch and the CUDA libraries, and what each registers in torch's dispatcher,
are checked for real; the kernels themselves are not run.

The reference is the pinned official wheel, probed the same way: the built
wheel must carry the same compiled modules registering the same ops with the
same schemas, and its Python may not call an op of those namespaces that no
compiled module registers, beyond what the official Python already does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import zipfile
from pathlib import Path
from typing import Any

from overlay_harness.testenv import WHEEL_INSTALL
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout
from vllm_overlay.pin import Pin
from vllm_overlay.proc import run_logged
from vllm_overlay.venv import ensure_venv

PROBE = Path(__file__).with_name("extension_probe.py")
# The CUDA driver API: cuInit, cuMemMap, ...; not cublas*, cudnn*, cuda*.
DRIVER_SYMBOL = re.compile(r"^cu[A-Z]\w*$")


def compiled_modules(wheel: Path) -> dict[str, str]:
    """``{module under vllm.: member}`` for each compiled member of a wheel."""
    with zipfile.ZipFile(wheel) as archive:
        members = [
            n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".so")
        ]
    return {
        m.removeprefix("vllm/").split(".")[0].replace("/", "."): m
        for m in sorted(members)
    }


def extension_env(layout: Layout, pin: Pin, wheel: Path) -> Path:
    """The python of a venv with the pinned CUDA torch and ``wheel``."""
    python = ensure_venv(
        layout.cache,
        "extension-env",
        [f"torch=={pin.wheel_torch}"],
        layout.root / "ci/requirements-extensions.txt",
        layout.logs / "extension-env.log",
    )
    run_logged(
        [str(python), "-m", "pip", "install", "--quiet", "--no-compile"]
        + [*WHEEL_INSTALL, str(wheel)],
        layout.logs / "extension-env-wheel.log",
    )
    return python


def libcuda_stub(libraries: list[Path], dest: Path) -> Path:
    """Build ``dest/libcuda.so.1`` defining every driver symbol that
    ``libraries`` leave undefined; return ``dest``."""
    undefined = subprocess.run(
        ["nm", "-D", "--undefined-only", *map(str, libraries)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    symbols = sorted(
        {
            line.split()[-1]
            for line in undefined.splitlines()
            if line.strip() and DRIVER_SYMBOL.match(line.split()[-1])
        }
    )
    if not symbols:
        raise OverlayError(
            f"no CUDA driver symbol is undefined in {libraries[0].parent}",
            "check that the wheel is a CUDA build",
        )
    dest.mkdir(parents=True, exist_ok=True)
    source = dest / "libcuda_stub.c"
    source.write_text(
        "/* CUDA_ERROR_STUB_LIBRARY, as NVIDIA's stub answers. */\n"
        + "".join(f"int {s}(void) {{ return 34; }}\n" for s in symbols)
    )
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1"]
        + ["-o", str(dest / "libcuda.so.1"), str(source)],
        check=True,
    )
    return dest


def probe(
    python: Path, modules: list[str], stub: Path, path: Path | None
) -> dict[str, Any]:
    """Run extension_probe.py; ``path`` puts a vllm package ahead of the
    installed one."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(stub)}
    if path is not None:
        env["PYTHONPATH"] = str(path)
    result = subprocess.run(
        [str(python), str(PROBE), *modules],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        check=False,
    )
    if result.returncode != 0:
        raise OverlayError(
            f"{PROBE.name} failed (exit {result.returncode}):\n{result.stderr[-3000:]}",
            f"rerun it: LD_LIBRARY_PATH={stub} {python} {PROBE} {' '.join(modules)}",
        )
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def _unresolved(report: dict[str, Any]) -> set[str]:
    """Ops the Python calls in namespaces the compiled modules register, that
    none of them registers."""
    registered = {op for ops in report["ops"].values() for op in ops}
    namespaces = {op.split("::")[0] for op in registered}
    return {
        f"{ns}::{name}"
        for ns, names in report["references"].items()
        if ns in namespaces
        for name in names
        if f"{ns}::{name}" not in registered
    }


def problems(
    built: dict[str, Any], official: dict[str, Any], modules: list[str]
) -> list[str]:
    """What makes the built wheel's compiled side differ from the official."""
    found = [f"vllm.{m} does not import: {e}" for m, e in built["errors"].items()]
    found += [
        f"official vllm.{m} does not import here: {e}"
        for m, e in official["errors"].items()
    ]
    for module in modules:
        ours = built["ops"].get(module, {})
        theirs = official["ops"].get(module, {})
        found += [
            f"vllm.{module}: {op} is {ours.get(op)!r}, officially {theirs.get(op)!r}"
            for op in sorted(set(ours) | set(theirs))
            if ours.get(op) != theirs.get(op)
        ]
    registered = {op.split("::")[0] for ops in built["ops"].values() for op in ops}
    official_namespaces = {
        op.split("::")[0] for ops in official["ops"].values() for op in ops
    }
    found += [
        f"namespace {ns} registers no op"
        for ns in sorted(official_namespaces - registered)
    ]
    found += [
        f"the Python calls torch.ops.{op.replace('::', '.')}, which no compiled "
        "module registers"
        for op in sorted(_unresolved(built) - _unresolved(official))
    ]
    return found
