"""Virtual environments under the cache, keyed by what goes into them.

A venv is reused only when its ``.complete`` stamp exists, which is written
last: an interrupted bootstrap is removed and made again.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

from vllm_overlay.proc import run_logged


def ensure_venv(
    cache_dir: Path, name: str, pip_args: list[str], inputs: str, log: Path
) -> Path:
    """Return the python of a venv made with ``pip install *pip_args``.

    ``inputs`` is everything that decides the venv's contents (requirement
    file texts included); a change makes a new venv.
    """
    spec = "\n".join([*pip_args, inputs, sys.version])
    key = hashlib.sha256(spec.encode()).hexdigest()[:16]
    env = cache_dir / f"{name}-{key}"
    python = env / "bin" / "python"
    stamp = env / ".complete"
    if stamp.exists():
        return python
    if env.exists():
        shutil.rmtree(env)
    print(f"  creating {env.name}", file=sys.stderr)
    run_logged([sys.executable, "-m", "venv", str(env)], log)
    run_logged([str(python), "-m", "pip", "install", "--quiet", *pip_args], log)
    stamp.write_text(spec)
    return python
