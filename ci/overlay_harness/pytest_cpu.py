"""Pytest plugin that lets upstream vLLM's test suite run on a machine without
an accelerator.

Load it with ``-p overlay_harness.pytest_cpu``.

Upstream ``tests/conftest.py`` has autouse fixtures whose teardown ends in
``vllm.distributed.parallel_state.cleanup_dist_env_and_memory()``.  On any
platform other than vLLM's CPU platform that calls
``torch.accelerator.empty_cache()`` (and ``empty_host_cache()``), which raise
``RuntimeError: Cannot access accelerator device when none is available``
when torch sees no accelerator, so every test would end in a teardown error.
Overriding the fixture from a ``-p`` plugin does not work (the rootdir
conftest's fixture of the same name wins), so this plugin patches the torch
calls themselves: when no accelerator is present they become no-ops.  With an
accelerator present the plugin changes nothing.

The plugin also records each test's exact node id as a junit-xml property
(``nodeid``) so that ``overlay_harness.upstream_tests`` can map junit entries back
to node ids without guessing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from overlay_harness.cpu_triton import relax_triton_cpu_check

# torch.accelerator functions that upstream's cleanup path calls and that
# raise without an accelerator.  Only names that exist are patched.
_NOOP_WHEN_NO_ACCELERATOR: tuple[str, ...] = (
    "empty_cache",
    "empty_host_cache",
    "synchronize",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
)

NODEID_PROPERTY = "nodeid"

_saved: dict[str, Callable[..., Any]] = {}


def _noop(*args: object, **kwargs: object) -> None:
    return None


def patch_torch_accelerator() -> list[str]:
    """Make the accelerator cleanup calls no-ops if torch has no accelerator.

    Returns the names that were patched (empty when an accelerator exists or
    when torch.accelerator is absent).
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is always there for vLLM
        return []
    accel = getattr(torch, "accelerator", None)
    if accel is None or accel.is_available():
        return []
    patched: list[str] = []
    for name in _NOOP_WHEN_NO_ACCELERATOR:
        original = getattr(accel, name, None)
        if original is None or name in _saved:
            continue
        _saved[name] = original
        setattr(accel, name, _noop)
        patched.append(name)
    return patched


def unpatch_torch_accelerator() -> None:
    if not _saved:
        return
    import torch

    for name, original in _saved.items():
        setattr(torch.accelerator, name, original)
    _saved.clear()


_patched_names: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    _patched_names[:] = patch_torch_accelerator()
    if relax_triton_cpu_check():
        _patched_names.append("(and CpuPlatform's triton-cpu check, cpu_triton.py)")


def pytest_unconfigure(config: pytest.Config) -> None:
    unpatch_torch_accelerator()
    _patched_names.clear()


def pytest_report_header(config: pytest.Config) -> str:
    if _patched_names:
        names = ", torch.accelerator.".join(_patched_names)
        return (
            "overlay_harness.pytest_cpu: no accelerator; "
            f"no-op torch.accelerator.{names}"
        )
    return "overlay_harness.pytest_cpu: accelerator present (nothing patched)"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    for item in items:
        item.user_properties.append((NODEID_PROPERTY, item.nodeid))
