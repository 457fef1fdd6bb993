from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from conftest import LINES, REPO, make_patch, write_series
from vllm_overlay import series
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout, copy_checkout
from vllm_overlay.pin import load_pin

GOOD = make_patch(LINES, LINES.replace("line 5\n", "line five\n"))


def test_series_lists_patches_in_order(checkout: Layout) -> None:
    write_series(checkout, {"0002-b.patch": GOOD, "0001-a.patch": GOOD})
    names = [p.name for p in series.load_series(checkout.patches)]
    assert names == ["0002-b.patch", "0001-a.patch"]
    assert series.load_series(checkout.patches)[0].targets == ("pkg/mod.py",)


def test_entry_without_file(checkout: Layout) -> None:
    (checkout.patches / "series").write_text("0001-missing.patch\n")
    with pytest.raises(OverlayError, match="lists 0001-missing.patch, which is not"):
        series.load_series(checkout.patches)


def test_file_without_entry(checkout: Layout) -> None:
    write_series(checkout, {"0001-a.patch": GOOD})
    (checkout.patches / "0002-stray.patch").write_text(GOOD)
    with pytest.raises(OverlayError, match="series does not list: 0002-stray.patch"):
        series.load_series(checkout.patches)


def test_duplicate_entry(checkout: Layout) -> None:
    write_series(checkout, {"0001-a.patch": GOOD})
    (checkout.patches / "series").write_text("0001-a.patch\n0001-a.patch\n")
    with pytest.raises(OverlayError, match="series:2: 0001-a.patch is listed twice"):
        series.load_series(checkout.patches)


def test_path_outside_the_tree(checkout: Layout) -> None:
    write_series(
        checkout, {"0001-a.patch": GOOD.replace("b/pkg/mod.py", "b/../etc/passwd")}
    )
    with pytest.raises(OverlayError, match="leaves the tree"):
        series.load_series(checkout.patches)


def test_options_other_than_p1(checkout: Layout) -> None:
    write_series(checkout, {"0001-a.patch": GOOD})
    (checkout.patches / "series").write_text("0001-a.patch -p0\n")
    with pytest.raises(OverlayError, match="unsupported options '-p0'"):
        series.load_series(checkout.patches)


def test_dep3_header_fields() -> None:
    header = series.parse_header(
        "Description: first line\n second line\nAuthor: A <a@b>\n"
        "Forwarded: not-needed\nLast-Update: 2026-12-01\n---\n--- a/x\n"
    )
    assert header == {
        "Description": "first line\nsecond line",
        "Author": "A <a@b>",
        "Forwarded": "not-needed",
        "Last-Update": "2026-12-01",
    }


def test_good_header_has_no_problems(checkout: Layout) -> None:
    write_series(checkout, {"0001-a.patch": GOOD})
    (patch,) = series.load_series(checkout.patches)
    assert series.header_problems(patch) == []


def test_lint_accepts_a_good_diff(checkout: Layout) -> None:
    write_series(checkout, {"0001-a.patch": GOOD})
    (patch,) = series.load_series(checkout.patches)
    assert series.diff_problems(patch) == []


def test_lint_finds_added_trailing_whitespace(checkout: Layout) -> None:
    text = make_patch(LINES, LINES.replace("line 5\n", "line five  \n"))
    write_series(checkout, {"0001-a.patch": text})
    (patch,) = series.load_series(checkout.patches)
    assert series.diff_problems(patch) == ["line 13: added line ends in whitespace"]


def test_lint_finds_a_leftover_orig_file(checkout: Layout) -> None:
    leftover = (
        "diff --git a/f.py.orig b/f.py.orig\nnew file mode 100644\n"
        "--- /dev/null\n+++ b/f.py.orig\n@@ -0,0 +1 @@\n+x\n"
    )
    write_series(checkout, {"0001-a.patch": GOOD + leftover})
    (patch,) = series.load_series(checkout.patches)
    (problem,) = series.diff_problems(patch)
    assert "leftover file f.py.orig" in problem


def test_lint_finds_a_hunk_that_does_not_parse(checkout: Layout) -> None:
    write_series(
        checkout, {"0001-a.patch": GOOD.replace("@@ -2,7 +2,7 @@", "@@ -2,9 +2,7 @@")}
    )
    (patch,) = series.load_series(checkout.patches)
    assert series.diff_problems(patch)


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (
            lambda co: (co.patches / "series").write_text(
                (co.patches / "series").read_text()
                + series.read_series(co.patches)[0]
                + "\n"
            ),
            "is listed twice",
        ),
        (
            lambda co: (co.patches / "series").write_text(
                (co.patches / "series").read_text() + "0009-missing.patch\n"
            ),
            "lists 0009-missing.patch, which is not",
        ),
        (
            lambda co: (
                (co.overlay / "vllm" / "v1" / "core").mkdir(parents=True),
                (co.overlay / "vllm" / "v1" / "core" / "block_pool.py").write_text(""),
            ),
            "overlay/vllm/v1/core/block_pool.py would replace",
        ),
    ],
    ids=["doubled", "missing", "overlay-replaces-patched"],
)
def test_build_checks_the_checkout_before_any_download(
    tmp_path: Path, break_it, message: str
) -> None:
    """Mistakes in the checkout's own files stop ./build.sh in its first
    step, before the official wheel is fetched or a tree laid."""
    checkout = copy_checkout(REPO, tmp_path / "checkout", None)
    break_it(checkout)
    result = subprocess.run(
        [str(checkout.root / "build.sh")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert message in result.stderr
    assert "==> fetch" not in result.stderr
    assert not checkout.cache.exists() and not checkout.build.exists()


def test_different_series_never_share_a_wheel_version(checkout: Layout) -> None:
    """The local version carries the series digest: any change to a patch,
    the order, or overlay/ gives another wheel name and version."""
    from vllm_overlay.overlay import labelled_pin

    write_series(checkout, {"0001-a.patch": GOOD, "0002-b.patch": GOOD})
    versions = [labelled_pin(checkout).overlay_version]
    pin = load_pin(checkout.pin)
    assert re.fullmatch(
        rf"{re.escape(pin.version)}\+overlay\.1\.s[0-9a-f]{{10}}", versions[0]
    )
    write_series(checkout, {"0002-b.patch": GOOD, "0001-a.patch": GOOD})
    versions.append(labelled_pin(checkout).overlay_version)
    (checkout.patches / "0001-a.patch").write_text(GOOD.replace("five", "5"))
    versions.append(labelled_pin(checkout).overlay_version)
    (checkout.overlay / "tests").mkdir()
    (checkout.overlay / "tests" / "test_new.py").write_text("pass\n")
    versions.append(labelled_pin(checkout).overlay_version)
    assert len(set(versions)) == 4, versions
    assert labelled_pin(checkout).overlay_version == versions[-1]  # stable
