from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vllm_overlay.venv import venv_dir


def test_venv_is_keyed_by_contents_not_paths(tmp_path: Path) -> None:
    """Checkouts sharing a cache (the tests' copies) share one venv."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("wheel\n")
    b.write_text("wheel\n")
    cache = tmp_path / "cache"
    assert venv_dir(cache, "env", ["torch==1"], a) == venv_dir(
        cache, "env", ["torch==1"], b
    )
    b.write_text("wheel\nninja\n")
    assert venv_dir(cache, "env", ["torch==1"], a) != venv_dir(
        cache, "env", ["torch==1"], b
    )
    assert venv_dir(cache, "env", ["torch==1"], a) != venv_dir(
        cache, "env", ["torch==2"], a
    )


# Two processes make one venv at once, as two worktrees sharing a cache do:
# the fill writes a marker, sleeps, and checks the marker is still there.
RACE = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from vllm_overlay.venv import stamped_venv

def fill(python: Path) -> None:
    marker = python.parent.parent / "filled"
    marker.write_text(sys.argv[3])
    time.sleep(1.5)
    assert marker.read_text() == sys.argv[3], "another process remade the venv"

stamped_venv(Path(sys.argv[2]), fill, Path(sys.argv[2] + ".log"))
print("ok")
"""


def test_a_venv_made_by_two_processes_at_once_is_made_once(tmp_path: Path) -> None:
    ci = str(Path(__file__).resolve().parents[1] / "ci")
    env = tmp_path / "cache" / "env-0"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, ci, str(env), name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("first", "second")
    ]
    outcomes = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outcomes
    assert (env / ".complete").is_file()
    # The second process found the first's stamp and did not fill again.
    assert sum("creating" in err for _, err in outcomes) == 1
