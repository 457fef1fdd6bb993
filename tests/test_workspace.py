"""The maintainer round trip: series -> git workspace -> series."""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import LINES, make_patch, write_series
from vllm_overlay import apply, series, source, workspace
from vllm_overlay.paths import Layout
from vllm_overlay.pin import load_pin

FIRST = make_patch(LINES, LINES.replace("line 5\n", "line five\n"))
SECOND = make_patch(
    LINES.replace("line 5\n", "line five\n"),
    LINES.replace("line 5\n", "line five\n").replace(
        "line 25\n", "line 25\nline 25.5\n"
    ),
)


def _workspace(layout: Layout) -> Path:
    pin = load_pin(layout.pin)
    source.fresh_dir(layout.workspace)
    source.lay_scratch_tree(layout.root, pin, layout.downloads, layout.workspace)
    workspace.make_workspace(
        layout.workspace, series.load_series(layout.patches), upto=None
    )
    return layout.workspace


def _upstream(layout: Layout, text: str) -> None:
    """A synthetic upstream/ checkout holding pkg/mod.py, pinned."""
    repo = layout.root / "upstream"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "mod.py").write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "v0"], check=True)
    head = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    layout.pin.write_text(
        layout.pin.read_text().replace(
            'commit_short = "4ba787ec9"', f'commit_short = "{head[:9]}"'
        )
    )


def _export_is_identity(layout: Layout) -> None:
    before = {p.name: p.read_bytes() for p in layout.patches.iterdir()}
    workspace.export(_workspace(layout), layout.patches)
    after = {p.name: p.read_bytes() for p in layout.patches.iterdir()}
    assert after == before


def test_round_trip_is_byte_identical(checkout: Layout) -> None:
    _upstream(checkout, LINES)
    write_series(checkout, {"0001-first.patch": FIRST, "0002-second.patch": SECOND})
    workspace.export(_workspace(checkout), checkout.patches)  # normalise once
    _export_is_identity(checkout)
    for patch in series.load_series(checkout.patches):
        assert series.header_problems(patch) == []


def test_export_refreshes_an_offset_patch(checkout: Layout) -> None:
    _upstream(checkout, "a new first line\n" + LINES)
    write_series(checkout, {"0001-first.patch": FIRST})
    (patch,) = series.load_series(checkout.patches)
    tree = checkout.build / "probe"
    source.lay_scratch_tree(
        checkout.root, load_pin(checkout.pin), checkout.downloads, tree
    )
    assert apply.classify(tree, patch).fit is apply.Fit.OFFSET
    workspace.export(_workspace(checkout), checkout.patches)
    (patch,) = series.load_series(checkout.patches)
    assert apply.classify(tree, patch).fit is apply.Fit.CLEAN
    assert patch.header["Description"] == "test patch"


def test_new_patch_joins_the_series(checkout: Layout) -> None:
    _upstream(checkout, LINES)
    write_series(checkout, {"0001-first.patch": FIRST})
    ws = _workspace(checkout)
    (ws / "pkg" / "mod.py").write_text((ws / "pkg" / "mod.py").read_text() + "end\n")
    workspace.new_patch(ws, "0002-append.patch")
    workspace.export(ws, checkout.patches)
    names = [p.name for p in series.load_series(checkout.patches)]
    assert names == ["0001-first.patch", "0002-append.patch"]
    (_, new) = series.load_series(checkout.patches)
    assert "template text" in " ".join(series.header_problems(new))
    assert (checkout.patches / "series").read_text().startswith("# test series\n")
