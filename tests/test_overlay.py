from __future__ import annotations

from pathlib import Path

import pytest

from vllm_overlay import overlay
from vllm_overlay.errors import OverlayError


def test_overlay_adds_new_files(tmp_path: Path, tree: Path) -> None:
    (tmp_path / "ov" / "tests" / "x").mkdir(parents=True)
    (tmp_path / "ov" / "tests" / "x" / "test_new.py").write_text("pass\n")
    assert overlay.copy_overlay(tmp_path / "ov", tree) == ["tests/x/test_new.py"]
    assert (tree / "tests" / "x" / "test_new.py").read_text() == "pass\n"


def test_overlay_must_not_replace_upstream(tmp_path: Path, tree: Path) -> None:
    (tmp_path / "ov" / "pkg").mkdir(parents=True)
    (tmp_path / "ov" / "pkg" / "mod.py").write_text("replaced\n")
    (tmp_path / "ov" / "pkg" / "other.py").write_text("new\n")
    with pytest.raises(OverlayError, match="overlay/pkg/mod.py would replace") as e:
        overlay.copy_overlay(tmp_path / "ov", tree)
    assert "as a patch" in e.value.next_step
    assert (tree / "pkg" / "mod.py").read_text() != "replaced\n"
    assert not (tree / "pkg" / "other.py").exists()  # nothing half-copied
