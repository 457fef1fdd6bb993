"""The manifest the installed wheel carries, and the arguments and
Containerfile the image is built with. ci/test.sh runs pytest in the venv the
built wheel is installed in; tests/test_image.py builds and runs the image."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, built_wheel
from overlay_harness import extensions, testenv
from vllm_overlay import fetch, manifest, overlay, series
from vllm_overlay.fetch import sha256_of
from vllm_overlay.paths import copy_checkout

pytestmark = pytest.mark.real_release
PIN = overlay.labelled_pin(REPO)  # the version the build gives the wheel


@pytest.fixture(scope="module")
def installed() -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "vllm._overlay_manifest"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    return json.loads(out.stdout)


def test_installed_manifest_describes_this_checkout(installed: dict) -> None:
    assert installed["version"] == PIN.overlay_version
    assert installed["upstream"]["tag"] == PIN.tag
    assert installed["upstream"]["sdist"]["sha256"] == PIN.sdist.sha256
    assert installed["upstream"]["official_wheel"]["sha256"] == PIN.wheel.sha256
    assert installed["patches"] == [
        {"name": p.name, "sha256": sha256_of(p.path)}
        for p in series.load_series(REPO.patches)
    ]
    assert installed["overlay_files"] == overlay.overlay_files(REPO.overlay)
    assert installed["build_mode"] == "assemble"  # build.sh's default


def test_installed_vllm_is_the_overlay_version() -> None:
    import vllm

    assert vllm.__version__ == PIN.overlay_version


def _image_args(root: Path) -> list[str]:
    out = subprocess.run(
        [str(REPO.root / "ci" / "overlay"), "--root", str(root), "image-args"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return shlex.split(out)


def test_image_args_carry_the_manifest(installed: dict, tmp_path: Path) -> None:
    """The labels describe the wheel in dist/, even when build/tree was
    stamped by a build that never got to publish (killed at "build the
    wheel" after a change to the series)."""
    wheel = built_wheel()
    copy = copy_checkout(REPO, tmp_path / "checkout", REPO.cache)
    copy.dist.mkdir()
    shutil.copy2(wheel, copy.dist / wheel.name)
    first = copy.patches / series.read_series(copy.patches)[0]
    first.write_text(first.read_text().replace("Description: ", "Description: Now ", 1))
    build = subprocess.Popen(
        [str(copy.root / "build.sh")],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert build.stderr is not None
    for line in build.stderr:
        if line.startswith("==> build the wheel"):
            break
    os.killpg(build.pid, signal.SIGKILL)
    build.wait(timeout=120)
    stamped = manifest.read_manifest(copy.tree)
    assert stamped["patches"] != installed["patches"]  # build/tree moved on

    args = _image_args(copy.root)
    assert args[:2] == ["--build-arg", f"BASE_IMAGE=vllm/vllm-openai:{PIN.tag}"]
    assert args[2:4] == ["--build-arg", f"WHEEL={wheel.name}"]
    labels = dict(a.split("=", 1) for a in args[5::2])
    assert labels == manifest.labels(installed)
    assert labels["io.vllm-overlay.upstream.wheel.sha256"] == PIN.wheel.sha256


def test_image_args_refuse_a_wheel_without_manifest(tmp_path: Path) -> None:
    copy = copy_checkout(REPO, tmp_path / "checkout", None)
    copy.dist.mkdir()
    (copy.dist / f"vllm-{PIN.overlay_version}-{PIN.wheel_tag}.whl").write_bytes(b"")
    result = subprocess.run(
        [str(REPO.root / "ci" / "overlay"), "--root", str(copy.root), "image-args"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert "_overlay_manifest.py" in result.stderr
    assert "next: run ./build.sh again" in result.stderr
    assert result.stdout == ""


def test_containerfile_installs_as_the_tests_do() -> None:
    text = (REPO.root / "Containerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE\nFROM \$\{BASE_IMAGE\}$", text, re.M)
    install = " ".join(testenv.WHEEL_INSTALL)
    assert (
        f'python3 -m pip install {install} --no-cache-dir "/mnt/dist/${{WHEEL}}"'
        in text
    )
    assert "RUN --mount=type=bind,source=dist,target=/mnt/dist" in text
    assert "--mount=type=bind,source=LICENSE,target=/mnt/LICENSE" in text
    assert "COPY" not in text and "ADD" not in text
    assert "python3 -m vllm._overlay_manifest" in text


def test_containerfile_checks_every_compiled_extension() -> None:
    """The build-time list of compiled files is the official wheel's, and no
    import of a compiled module runs at build time (no driver there)."""
    text = (REPO.root / "Containerfile").read_text()
    listed = re.search(r"for so in \\\n(.*?); \\", text, re.S)
    assert listed is not None
    official = extensions.compiled_modules(fetch.fetch(PIN.wheel, REPO.downloads))
    assert sorted(listed.group(1).replace("\\", "").split()) == sorted(
        m.removeprefix("vllm/") for m in official.values()
    )
    assert "vllm._C" not in text.replace("vllm._overlay_manifest", "")


def test_build_context_is_the_wheel_and_the_licence() -> None:
    ignore = (REPO.root / ".containerignore").read_text().splitlines()
    assert [r for r in ignore if r and not r.startswith("#")] == [
        "*",
        "!dist/*.whl",
        "!LICENSE",
    ]
