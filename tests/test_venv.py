from __future__ import annotations

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
