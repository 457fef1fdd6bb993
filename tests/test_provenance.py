"""The manifest the installed wheel carries, and the container image built
from it. ci/test.sh runs pytest in the venv the built wheel is installed in.
No container engine runs on these machines: the image itself is not built
here (README, 'What was verified')."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO
from overlay_harness import testenv
from vllm_overlay import manifest, overlay, series
from vllm_overlay.fetch import sha256_of

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


def test_image_args_carry_the_manifest(installed: dict) -> None:
    out = subprocess.run(
        [str(REPO.root / "ci" / "overlay"), "image-args"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    args = shlex.split(out)
    assert args[:2] == ["--build-arg", f"BASE_IMAGE=vllm/vllm-openai:{PIN.tag}"]
    wheel = f"vllm-{PIN.overlay_version}-{PIN.wheel_tag}.whl"
    assert args[2:4] == ["--build-arg", f"WHEEL={wheel}"]
    labels = dict(a.split("=", 1) for a in args[5::2])
    assert labels == manifest.labels(installed)
    assert labels["io.vllm-overlay.upstream.wheel.sha256"] == PIN.wheel.sha256


def test_containerfile_installs_as_the_tests_do() -> None:
    text = (REPO.root / "Containerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE\nFROM \$\{BASE_IMAGE\}$", text, re.M)
    install = " ".join(testenv.WHEEL_INSTALL)
    assert f"python3 -m pip install {install} /tmp/${{WHEEL}}" in text
    assert 'python3 -c "import vllm, vllm._C"' in text
    assert "python3 -m vllm._overlay_manifest" in text
