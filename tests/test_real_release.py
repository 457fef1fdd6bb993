"""The tooling on the real pinned release: the series on the real tree, the
real quilt, the real built wheel against the real official one, and real
builds interrupted and rerun. ci/test.sh builds dist/ before these run."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import signal
import subprocess
import zipfile
from pathlib import Path

import pytest

from conftest import REPO
from vllm_overlay import apply, fetch, overlay, series, source, wheelcheck, workspace
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout, copy_checkout
from vllm_overlay.pin import load_pin

pytestmark = pytest.mark.real_release
PIN = load_pin(REPO.pin)


def _built_wheel() -> Path:
    wheels = sorted(REPO.dist.glob("*.whl"))
    assert len(wheels) == 1, "run ./build.sh first: dist/ must hold one wheel"
    return wheels[0]


def _official() -> Path:
    return fetch.fetch(PIN.wheel, REPO.downloads)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("pristine") / "tree"
    source.lay_scratch_tree(REPO.root, PIN, REPO.downloads, dest)
    return dest


def test_series_is_not_empty() -> None:
    assert series.load_series(REPO.patches), "the series must carry the fix"


def test_quilt_accepts_the_series_unchanged(pristine: Path, tmp_path: Path) -> None:
    ours = tmp_path / "ours"
    theirs = tmp_path / "quilt"
    shutil.copytree(pristine, ours, symlinks=True)
    shutil.copytree(pristine, theirs, symlinks=True)
    patches = series.load_series(REPO.patches)
    apply.apply_series(ours, patches)
    result = subprocess.run(
        ["quilt", "push", "-a", "--fuzz=0"],
        cwd=theirs,
        capture_output=True,
        text=True,
        env={**os.environ, "QUILT_PATCHES": str(REPO.patches)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "offset" not in result.stdout and "fuzz" not in result.stdout
    for target in sorted({t for p in patches for t in p.targets}):
        assert filecmp.cmp(ours / target, theirs / target, shallow=False), target


def test_workspace_round_trip_of_the_real_series(tmp_path: Path) -> None:
    ws = tmp_path / "workspace"
    source.lay_scratch_tree(REPO.root, PIN, REPO.downloads, ws)
    workspace.make_workspace(ws, series.load_series(REPO.patches), upto=None)
    exported = tmp_path / "patches"
    shutil.copytree(REPO.patches, exported)
    workspace.export(ws, exported)
    for name in sorted(p.name for p in REPO.patches.iterdir()):
        assert (exported / name).read_bytes() == (REPO.patches / name).read_bytes(), (
            f"patches/{name} is not in export format: run `ci/overlay workspace` "
            "and `ci/overlay export`"
        )


def test_pinned_torch_is_the_official_wheels() -> None:
    wheelcheck.check_official_torch(_official(), PIN.wheel_torch, REPO.pin)
    with pytest.raises(OverlayError, match="requires torch==2.14.0") as e:
        wheelcheck.check_official_torch(_official(), "2.99.0", REPO.pin)
    assert "upstream.wheel.torch" in e.value.next_step


def test_built_wheel_passes_the_check() -> None:
    result = wheelcheck.compare(
        _built_wheel(),
        _official(),
        REPO.tree,
        overlay.touched_files(REPO),
        PIN.overlay_version,
    )
    assert result.problems(PIN.wheel_tag) == []
    assert _built_wheel().name == f"vllm-{PIN.overlay_version}-{PIN.wheel_tag}.whl"


def test_built_wheel_carries_every_patched_module() -> None:
    with zipfile.ZipFile(_built_wheel()) as ours, zipfile.ZipFile(_official()) as off:
        for target in sorted(
            t for t in overlay.touched_files(REPO) if t.startswith("vllm/")
        ):
            assert ours.read(target) == (REPO.tree / target).read_bytes()
            if target in off.namelist():
                assert ours.read(target) != off.read(target), target


def _rewrite(src: Path, dest: Path, edit) -> Path:
    """Copy a wheel, letting ``edit(name, data)`` change or drop members."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w") as zout:
        for info in zin.infolist():
            data = edit(info.filename, zin.read(info))
            if data is not None:
                zout.writestr(info, data)
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
    ],
    ids=["changed", "missing", "requirement", "tag", "patched-not-from-tree"],
)
def test_wheel_check_catches(tmp_path: Path, edit, problem: str) -> None:
    bad = _rewrite(_built_wheel(), tmp_path / _built_wheel().name, edit)
    problems = wheelcheck.compare(
        bad, _official(), REPO.tree, overlay.touched_files(REPO), PIN.overlay_version
    ).problems(PIN.wheel_tag)
    assert any(problem in p for p in problems), problems


@pytest.fixture
def checkout_copy(tmp_path: Path) -> Layout:
    """A copy of this checkout's tracked files sharing its download and
    build-env cache, with a dist/ of its own."""
    layout = copy_checkout(REPO, tmp_path / "checkout", REPO.cache)
    layout.dist.mkdir()
    (layout.dist / "previous.whl").write_bytes(b"the previous release")
    return layout


def _dist_state(layout: Layout) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in layout.dist.iterdir()}


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
    (wheel,) = layout.dist.glob("*.whl")
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
    assert wheel.name == _built_wheel().name
    assert wheelcheck.content_differences(wheel, _built_wheel()) == []
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
