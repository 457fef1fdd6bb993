"""The project's Containerfile, built and run with podman over a stand-in
for the official base image (overlay_harness/image.py; no registry here)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, built_wheel
from overlay_harness import extensions, image
from vllm_overlay import manifest, notice

pytestmark = pytest.mark.real_release
TAG = "localhost/vllm-overlay-test:latest"


@pytest.fixture(scope="module")
def wheel() -> Path:
    return built_wheel()


@pytest.fixture(scope="module")
def built(wheel: Path) -> Iterator[str]:
    image.build_image(REPO, TAG)
    yield TAG
    image.podman(REPO, "rmi", TAG)


def _run(*args: str) -> str:
    return image.podman(REPO, "run", "--rm", "--entrypoint", "python3", TAG, *args)


def test_image_runs_the_wheels_manifest(built: str, wheel: Path) -> None:
    out = _run("-m", "vllm._overlay_manifest")
    assert json.loads(out) == manifest.read_wheel_manifest(wheel)


def test_image_labels_are_the_manifests_fields(built: str, wheel: Path) -> None:
    def labels(ref: str) -> dict[str, str]:
        out = image.podman(
            REPO, "image", "inspect", "--format", "{{json .Labels}}", ref
        )
        return json.loads(out) or {}

    added = {
        k: v
        for k, v in labels(built).items()
        if labels(image.standin_ref()).get(k) != v
    }
    assert added == manifest.labels(manifest.read_wheel_manifest(wheel))


def test_image_holds_every_compiled_extension_of_the_wheel(
    built: str, wheel: Path
) -> None:
    listing = _run(
        "-c",
        "import hashlib, pathlib, vllm\n"
        "root = pathlib.Path(vllm.__file__).parent\n"
        "for p in sorted(root.rglob('*.so')):\n"
        "    h = hashlib.sha256(p.read_bytes()).hexdigest()\n"
        "    print(h, p.relative_to(root.parent))\n",
    )
    members = extensions.compiled_modules(wheel).values()
    assert members, f"{wheel} has no compiled member"
    with zipfile.ZipFile(wheel) as archive:
        expected = {
            f"{hashlib.sha256(archive.read(n)).hexdigest()} {n}" for n in members
        }
    assert set(listing.splitlines()) == expected


def test_image_carries_the_licences(built: str, wheel: Path) -> None:
    """The project's LICENSE, and through the link to the installed wheel's
    licenses/ folder, vLLM's LICENSE and the notice of changed files."""
    doc = "/usr/share/doc/vllm-overlay"
    names = ["LICENSE", "vllm/LICENSE", f"vllm/{notice.NAME}"]
    out = _run(
        "-c",
        "import json, pathlib, sys\n"
        "print(json.dumps({n: (pathlib.Path(sys.argv[1]) / n).read_text()"
        " for n in sys.argv[2:]}))",
        doc,
        *names,
    )
    with zipfile.ZipFile(wheel) as archive:
        (info,) = {n.split("/")[0] for n in archive.namelist() if ".dist-info/" in n}
        licence = archive.read(f"{info}/licenses/LICENSE").decode()
        text = archive.read(f"{info}/licenses/{notice.NAME}").decode()
    assert json.loads(out) == {
        "LICENSE": (REPO.root / "LICENSE").read_text(),
        "vllm/LICENSE": licence,
        f"vllm/{notice.NAME}": text,
    }


def _steps(ref: str) -> list[str]:
    history = json.loads(image.podman(REPO, "history", "--format", "json", ref))
    return [h.get("CreatedBy") or h.get("createdBy") or "" for h in history]


def test_no_layer_holds_the_wheel(built: str) -> None:
    steps = _steps(built)
    ours = steps[: len(steps) - len(_steps(image.standin_ref()))]
    assert ours, "the image adds no layer to its base"
    assert not [s for s in ours if "COPY" in s or "ADD" in s], ours
    found = image.podman(
        REPO,
        "run",
        "--rm",
        "--entrypoint",
        "find",
        built,
        "/",
        "-xdev",
        "-name",
        "vllm-*.whl",
    )
    assert found == ""
