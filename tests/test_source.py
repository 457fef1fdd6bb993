"""Which upstream source a build uses, and the checks on a submodule."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import REPO, make_patch, set_commit_short, write_series
from vllm_overlay import build, source
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout
from vllm_overlay.pin import Pin, load_pin


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def _pin_at(layout: Layout, commit_short: str) -> Pin:
    set_commit_short(layout, commit_short)
    return load_pin(layout.pin)


@pytest.fixture
def submodule(checkout: Layout) -> Path:
    repo = checkout.root / "upstream"
    (repo / "vllm").mkdir(parents=True)
    (repo / "vllm" / "x.py").write_text("x = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "v0")
    return repo


def test_clean_checkout_at_pin_is_used(checkout: Layout, submodule: Path) -> None:
    pin = _pin_at(checkout, _git(submodule, "rev-parse", "HEAD")[:9])
    dest = checkout.build / "tree"
    used = source.lay_scratch_tree(checkout.root, pin, checkout.downloads, dest)
    assert used.kind == "submodule"
    assert (dest / "vllm" / "x.py").read_text() == "x = 1\n"
    assert not (dest / ".git").exists()


def test_wrong_commit_is_refused(checkout: Layout, submodule: Path) -> None:
    pin = _pin_at(checkout, "000000000")
    with pytest.raises(OverlayError, match="pin.toml wants 000000000") as e:
        source.lay_scratch_tree(
            checkout.root, pin, checkout.downloads, checkout.build / "tree"
        )
    assert f"checkout {pin.tag}" in e.value.next_step
    assert not (checkout.build / "tree").exists()


@pytest.mark.parametrize("change", ["modified", "untracked"])
def test_dirty_checkout_is_refused(
    checkout: Layout, submodule: Path, change: str
) -> None:
    pin = _pin_at(checkout, _git(submodule, "rev-parse", "HEAD")[:9])
    name = "x.py" if change == "modified" else "y.py"
    (submodule / "vllm" / name).write_text("patched in place\n")
    with pytest.raises(OverlayError, match="has local changes") as e:
        source.lay_scratch_tree(
            checkout.root, pin, checkout.downloads, checkout.build / "tree"
        )
    assert "patches live in patches/" in e.value.next_step


def test_full_commit_must_match_exactly(checkout: Layout, submodule: Path) -> None:
    head = _git(submodule, "rev-parse", "HEAD")
    text = checkout.pin.read_text().replace('commit = ""', f'commit = "{head}"')
    checkout.pin.write_text(text)
    assert load_pin(checkout.pin).commit_matches(head)
    other = head[:-1] + ("1" if head[-1] == "0" else "0")
    assert not load_pin(checkout.pin).commit_matches(other)


def test_stale_directory_is_removed(tmp_path: Path) -> None:
    stale = tmp_path / "tree"
    (stale / "deep").mkdir(parents=True)
    (stale / "deep" / "leftover").write_text("from an interrupted run")
    source.fresh_dir(stale)
    assert not stale.exists()


def test_from_source_without_cuda_toolkit(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    with pytest.raises(OverlayError, match="needs a CUDA toolkit") as e:
        build.build_wheel(
            tmp_path,
            load_pin(REPO.pin),
            "from-source",
            official_wheel=tmp_path / "w.whl",
            touched=set(),
            build_requirements=REPO.build_requirements,
            cache_dir=tmp_path / "cache",
            out_dir=tmp_path / "out",
            log_dir=tmp_path / "logs",
            source_date_epoch=0,
        )
    assert "CUDA_HOME" in e.value.next_step
    assert not (tmp_path / "cache").exists()


def test_apply_command_lays_the_patched_tree(checkout: Layout, submodule: Path) -> None:
    _pin_at(checkout, _git(submodule, "rev-parse", "HEAD")[:9])
    write_series(
        checkout, {"0001-x.patch": make_patch("x = 1\n", "x = 2\n", path="vllm/x.py")}
    )
    (checkout.overlay / "tests").mkdir()
    (checkout.overlay / "tests" / "test_new.py").write_text("pass\n")
    result = subprocess.run(
        [str(REPO.root / "ci" / "overlay"), "--root", str(checkout.root), "apply"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(checkout.tree)
    assert (checkout.tree / "vllm" / "x.py").read_text() == "x = 2\n"
    assert (checkout.tree / "tests" / "test_new.py").exists()
    assert not checkout.partial_tree.exists()
    assert "applied 0001-x.patch" in result.stderr
