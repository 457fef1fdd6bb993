"""The container image, built for real with podman over a stand-in base.

No container registry is reachable here, so the official base image cannot
be pulled. The stand-in is a Debian minbase made by debootstrap from the
mirror apt is configured with, with a venv on PATH (as the official image's
Python is not Debian's, whose pip refuses installs) holding the CPU torch of
the test venv, and the official image's entrypoint. It is kept in podman's
storage under a tag keyed by its recipe, so later runs on the machine reuse
it; for a build it is tagged as the Containerfile's base and untagged after.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from overlay_harness.testenv import TEST_TORCH
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout
from vllm_overlay.proc import run_logged

SUITE = "bookworm"
SUITE_PYTHON = "3.11"  # the suite's python3, which the stand-in's wheels fit
DEBOOTSTRAP = (
    "--variant=minbase",
    "--include=python3,python3-venv,python3-pip,ca-certificates",
)
# What `import vllm` and `python -m vllm._overlay_manifest` need.
VENV_REQUIREMENTS = (TEST_TORCH, "packaging")
STANDIN_CONTAINERFILE = f"""\
ARG ROOTFS
FROM ${{ROOTFS}}
RUN --mount=type=bind,source=.,target=/mnt/wheels \\
    python3 -m venv /opt/venv \\
    && /opt/venv/bin/pip install --no-index --find-links /mnt/wheels \\
        {" ".join(VENV_REQUIREMENTS)}
ENV PATH=/opt/venv/bin:$PATH VIRTUAL_ENV=/opt/venv
ENTRYPOINT ["vllm", "serve"]
"""
INSTALL_HINT = (
    "apt-get install podman buildah runc debootstrap fuse-overlayfs slirp4netns "
    "uidmap containernetworking-plugins (as .ci/run does)"
)


def podman_env(layout: Layout) -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(layout.root / "ci/containers.conf")}


def podman(layout: Layout, *args: str) -> str:
    """Run podman and return its stdout; raise with its stderr on failure."""
    if shutil.which("podman") is None:
        raise OverlayError("podman is not installed", INSTALL_HINT)
    result = subprocess.run(
        ["podman", *args],
        capture_output=True,
        text=True,
        env=podman_env(layout),
        check=False,
    )
    if result.returncode != 0:
        raise OverlayError(
            f"`podman {' '.join(args[:3])} ...` failed (exit {result.returncode}):"
            f"\n{result.stderr[-2000:]}",
            "fix the cause and run again",
        )
    return result.stdout


def image_exists(layout: Layout, ref: str) -> bool:
    podman(layout, "--version")
    return (
        subprocess.run(
            ["podman", "image", "exists", ref], env=podman_env(layout), check=False
        ).returncode
        == 0
    )


def recipe_key() -> str:
    recipe = json.dumps([SUITE, DEBOOTSTRAP, STANDIN_CONTAINERFILE])
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def standin_ref() -> str:
    return f"localhost/vllm-overlay-standin:{recipe_key()}"


def apt_mirror(suite: str) -> str:
    """The mirror apt is configured with for ``suite``."""
    out = subprocess.run(
        ["apt-get", "indextargets", "--format", "$(REPO_URI) $(RELEASE) $(TARGET_OF)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for line in out.splitlines():
        uri, release, target = line.split()
        if release == suite and target == "deb":
            return uri
    raise OverlayError(
        f"apt has no source for {suite}", "add one to /etc/apt/sources.list.d"
    )


def ensure_standin(layout: Layout) -> str:
    """The stand-in base image, made once per recipe."""
    ref = standin_ref()
    if image_exists(layout, ref):
        return ref
    logs = layout.logs
    layout.build.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="standin-", dir=layout.build) as tmp:
        work = Path(tmp)
        run_logged(
            [
                "debootstrap",
                *DEBOOTSTRAP,
                SUITE,
                str(work / "rootfs"),
                apt_mirror(SUITE),
            ],
            logs / "standin-debootstrap.log",
        )
        with (work / "rootfs.tar").open("wb") as tar:
            subprocess.run(
                ["tar", "-C", str(work / "rootfs"), "-c", "."], stdout=tar, check=True
            )
        shutil.rmtree(work / "rootfs")
        imported = podman(layout, "import", str(work / "rootfs.tar")).split()[-1]
        rootfs = imported.removeprefix("sha256:")
        wheels = work / "wheels"
        run_logged(
            [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:"]
            + ["--python-version", SUITE_PYTHON, "-d", str(wheels)]
            + list(VENV_REQUIREMENTS),
            logs / "standin-wheels.log",
        )
        (work / "Containerfile").write_text(STANDIN_CONTAINERFILE)
        podman(
            layout,
            "build",
            "--pull=never",
            "--layers=false",
            "--build-arg",
            f"ROOTFS={rootfs}",
            "-f",
            str(work / "Containerfile"),
            "-t",
            ref,
            str(wheels),
        )
        podman(layout, "rmi", rootfs)  # its layer lives on in the stand-in
    return ref


@contextmanager
def standin_as(layout: Layout, base: str) -> Iterator[str]:
    """Tag the stand-in as ``base`` for one build; refuse to shadow a real
    image of that name."""
    ref = ensure_standin(layout)
    standin_id = podman(layout, "image", "inspect", "--format", "{{.Id}}", ref).strip()
    if (
        image_exists(layout, base)
        and podman(layout, "image", "inspect", "--format", "{{.Id}}", base).strip()
        != standin_id
    ):
        raise OverlayError(
            f"an image named {base} exists that is not the stand-in {ref}",
            f"build with that image instead, or `podman untag {base}`",
        )
    podman(layout, "tag", ref, base)
    try:
        yield ref
    finally:
        podman(layout, "untag", ref, base)


def build_image(layout: Layout, tag: str) -> None:
    """``podman build`` of the project's Containerfile as docs/build.md gives it."""
    args = shlex.split(
        subprocess.run(
            [str(layout.root / "ci/overlay"), "--root", str(layout.root), "image-args"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    base = next(a.split("=", 1)[1] for a in args if a.startswith("BASE_IMAGE="))
    with standin_as(layout, base):
        podman(
            layout,
            "build",
            "--pull=never",
            "-f",
            str(layout.root / "Containerfile"),
            *args,
            "-t",
            tag,
            str(layout.root),
        )
