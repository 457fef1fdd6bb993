"""The notice of changed files, rendered from a synthetic series and overlay:
every file named once with the patches that change or add it, read back by
the wheel check's parser; and its entry in a tree's license-files."""

from __future__ import annotations

import tomllib
import zipfile
from pathlib import Path

import pytest

from conftest import PATCH_HEADER, make_patch, write_series
from vllm_overlay import manifest, notice, overlay, series
from vllm_overlay.assemble import assemble_wheel
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout
from vllm_overlay.pin import load_pin

NEW_FILE = (
    PATCH_HEADER
    + """\
--- /dev/null
+++ b/vllm/new.py
@@ -0,0 +1 @@
+x = 1
"""
)


def _render(checkout: Layout) -> str:
    return notice.render(
        load_pin(checkout.pin),
        series.load_series(checkout.patches),
        overlay.overlay_files(checkout.overlay),
    )


def test_notice_names_each_file_with_its_patches(checkout: Layout) -> None:
    write_series(
        checkout,
        {
            "0001-a.patch": make_patch("a\n", "b\n", "vllm/mod.py"),
            "0002-new.patch": NEW_FILE,
            "0003-c.patch": make_patch("b\n", "c\n", "vllm/mod.py"),
        },
    )
    (checkout.overlay / "tests").mkdir()
    (checkout.overlay / "tests" / "test_new.py").write_text("pass\n")
    text = _render(checkout)
    entries = [ln for ln in text.splitlines() if ln.startswith("  ")]
    assert entries == [
        "  vllm/mod.py: changed by 0001-a.patch, 0003-c.patch",
        "  vllm/new.py: added by 0002-new.patch",
        "  tests/test_new.py: added",
        f"  {manifest.MODULE}: the provenance manifest "
        "(python -m vllm._overlay_manifest)",
    ]
    assert notice.listed_files(text) == [
        "vllm/mod.py",
        "vllm/new.py",
        "tests/test_new.py",
        manifest.MODULE,
    ]
    assert sorted(notice.listed_files(text)) == sorted(overlay.touched_files(checkout))
    pin = load_pin(checkout.pin)
    assert f"vLLM {pin.tag} ({pin.repository})" in text
    assert pin.wheel.filename in text


def test_notice_renders_the_same_twice(checkout: Layout) -> None:
    write_series(checkout, {"0001-a.patch": make_patch("a\n", "b\n", "vllm/mod.py")})
    assert _render(checkout) == _render(checkout)


def test_license_files_gains_the_notice_once(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\nlicense-files = ["LICENSE"]\n'
    )
    for _ in range(2):
        notice.declare_in_pyproject(tmp_path)
        project = tomllib.loads((tmp_path / "pyproject.toml").read_text())["project"]
        assert project["license-files"] == ["LICENSE", notice.NAME]
    assert not (tmp_path / "pyproject.toml.partial").exists()


def test_pyproject_without_license_files_is_named(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    with pytest.raises(OverlayError, match="pyproject.toml has no one-line") as e:
        notice.declare_in_pyproject(tmp_path)
    assert "default route" in e.value.next_step
    assert (tmp_path / "pyproject.toml").read_text() == '[project]\nname = "x"\n'


def test_assembling_an_unstamped_tree_names_the_missing_file(
    checkout: Layout, tmp_path: Path
) -> None:
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    manifest.write_manifest(tree, {})
    with pytest.raises(OverlayError, match=f"{tree / notice.NAME} is missing") as e:
        assemble_wheel(
            tmp_path / "official.whl",
            tree,
            set(),
            load_pin(checkout.pin),
            tmp_path / "out",
            0,
        )
    assert "./build.sh" in e.value.next_step
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("quoted", [True, False])
def test_a_record_row_for_every_copied_member_or_a_clear_error(
    checkout: Layout, tmp_path: Path, quoted: bool
) -> None:
    """A member whose name holds a comma is found through CSV quoting; a
    RECORD that does not list it (unquoted, so split at the comma) is
    named, and nothing is written."""
    pin = load_pin(checkout.pin)
    info = f"{pin.distribution}-{pin.version}.dist-info/"
    name = "vllm/a,b.py"
    row = f'"{name}"' if quoted else name
    official = tmp_path / "official.whl"
    with zipfile.ZipFile(official, "w") as wheel:
        wheel.writestr(name, "x = 1\n")
        wheel.writestr(info + "METADATA", "Version: 0\nLicense-File: LICENSE\n")
        wheel.writestr(info + "RECORD", f"{row},sha256=abc,6\n")
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    manifest.write_manifest(tree, {})
    (tree / notice.NAME).write_text("notice\n")
    out = tmp_path / "out"
    if quoted:
        wheel_path, _ = assemble_wheel(official, tree, set(), pin, out, 0)
        with zipfile.ZipFile(wheel_path) as built:
            assert name in built.namelist()
        return
    with pytest.raises(OverlayError, match="has no row for 'vllm/a,b.py'") as e:
        assemble_wheel(official, tree, set(), pin, out, 0)
    assert "download the official wheel again" in e.value.next_step
    assert list(out.iterdir()) == []
