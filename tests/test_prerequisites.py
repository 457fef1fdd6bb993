"""build.sh and ci/test.sh check their prerequisites before any step."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO
from vllm_overlay.paths import copy_checkout


def _path_without(tmp_path: Path, tool: str) -> str:
    """A PATH holding every tool of this one except ``tool``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in reversed(os.environ["PATH"].split(os.pathsep)):
        if not Path(directory).is_dir():
            continue
        for entry in Path(directory).iterdir():
            if entry.name != tool and os.access(entry, os.X_OK):
                link = bin_dir / entry.name
                if link.is_symlink():
                    link.unlink()
                link.symlink_to(entry)
    return str(bin_dir)


@pytest.mark.parametrize(
    ("script", "tool"),
    [
        ("ci/test.sh", "quilt"),
        ("ci/test.sh", "patch"),
        ("ci/test.sh", "shellcheck"),
        ("build.sh", "patch"),
    ],
)
def test_missing_tool_fails_first_naming_the_install(
    tmp_path: Path, script: str, tool: str
) -> None:
    assert shutil.which(tool), f"{tool} must be installed for this test"
    checkout = copy_checkout(REPO, tmp_path / "checkout", None)
    start = time.monotonic()
    result = subprocess.run(
        [str(checkout.root / script)],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": _path_without(tmp_path, tool)},
        timeout=60,
    )
    assert result.returncode == 1
    assert f"error: missing {tool} " in result.stderr
    sudo = "" if os.getuid() == 0 else "sudo "
    assert f"next: {sudo}apt-get install -y {tool}" in result.stderr
    assert "==>" not in result.stderr  # no step started
    assert not (checkout.root / "build").exists()
    assert time.monotonic() - start < 60
