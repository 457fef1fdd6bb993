"""Every compiled extension of the built wheel loads against the official
wheel's CUDA torch (pin.toml), with a libcuda stub in place of the driver,
and registers what the official release's extensions register
(overlay_harness/extensions.py)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from conftest import REPO, built_wheel
from overlay_harness import extensions
from vllm_overlay import fetch
from vllm_overlay.pin import load_pin

pytestmark = pytest.mark.real_release
PIN = load_pin(REPO.pin)


@pytest.fixture(scope="module")
def official(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The official wheel's vllm package, unpacked as pip would lay it."""
    dest = tmp_path_factory.mktemp("official")
    with zipfile.ZipFile(fetch.fetch(PIN.wheel, REPO.downloads)) as archive:
        archive.extractall(
            dest, [n for n in archive.namelist() if n.startswith("vllm/")]
        )
    return dest


def test_every_compiled_module_loads_and_registers_its_ops(
    official: Path, tmp_path: Path
) -> None:
    wheel = built_wheel()
    modules = extensions.compiled_modules(fetch.fetch(PIN.wheel, REPO.downloads))
    ours = extensions.compiled_modules(wheel).keys()
    assert ours == modules.keys(), (
        f"{wheel.name} lacks {sorted(modules.keys() - ours)} and adds "
        f"{sorted(ours - modules.keys())}"
    )
    python = extensions.extension_env(REPO, PIN, wheel)
    stub = extensions.libcuda_stub(
        [official / member for member in modules.values()], tmp_path / "stub"
    )
    built = extensions.probe(python, list(modules), stub, None)
    reference = extensions.probe(python, list(modules), stub, official)
    # A CUDA build: 2.14.0+cu130, not 2.14.0+cpu.
    assert built["torch"].split("+")[0] == PIN.wheel_torch
    assert built["cuda"] is not None, "the extension venv's torch is not a CUDA build"
    assert Path(built["vllm"]).parent.name == "site-packages"
    assert Path(reference["vllm"]) == official / "vllm"
    assert extensions.problems(built, reference, list(modules)) == []
    # Each of vLLM's op namespaces registers ops: _C, _C_cache_ops, _moe_C, ...
    namespaces = {op.split("::")[0] for ops in built["ops"].values() for op in ops}
    assert {"_C", "_C_cache_ops", "_moe_C", "_vllm_fa2_C"} <= namespaces
