"""Where things live in a checkout, per target. Everything generated is
git-ignored.

A target is a pin: the main one is ``pin.toml``, another is
``targets/NAME/pin.toml``. The pin names its series and overlay folders;
a named target's generated files live under ``build/targets/NAME/``, and
every target publishes into the one ``dist/``. Every command takes its
paths from here, so each works for every target unchanged.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay.errors import OverlayError
from vllm_overlay.pin import load_pin


@dataclass(frozen=True)
class Layout:
    root: Path
    target: str = ""  # "" is the main target (pin.toml)

    @property
    def command(self) -> str:
        """How a hint names the tool for this target, so that it runs as
        printed."""
        return f"ci/overlay --target {self.target}" if self.target else "ci/overlay"

    @property
    def pin(self) -> Path:
        if self.target:
            return self.targets / self.target / "pin.toml"
        return self.root / "pin.toml"

    @property
    def targets(self) -> Path:
        return self.root / "targets"

    @property
    def patches(self) -> Path:
        return self.root / load_pin(self.pin).series

    @property
    def overlay(self) -> Path:
        return self.root / load_pin(self.pin).overlay

    @property
    def build_requirements(self) -> Path:
        return self.root / "ci" / "requirements-build.txt"

    @property
    def lint_requirements(self) -> Path:
        return self.root / "ci" / "requirements-lint.txt"

    @property
    def test_requirements(self) -> Path:
        return self.root / "ci" / "requirements-test.txt"

    @property
    def serve_requirements(self) -> Path:
        return self.root / "ci" / "requirements-serve.txt"

    @property
    def cache(self) -> Path:
        return self.root / ".cache"

    @property
    def downloads(self) -> Path:
        return self.cache / "downloads"

    @property
    def build(self) -> Path:
        if self.target:
            return self.root / "build" / "targets" / self.target
        return self.root / "build"

    @property
    def partial_tree(self) -> Path:
        """The tree while patches go in; never built from."""
        return self.build / "tree.partial"

    @property
    def tree(self) -> Path:
        """The tree once the whole series and overlay are in."""
        return self.build / "tree"

    @property
    def pristine_tree(self) -> Path:
        """The unpatched upstream tree, for side-by-side benchmarks."""
        return self.build / "pristine"

    @property
    def workspace(self) -> Path:
        """The maintainer's git workspace (docs/maintainers.md)."""
        return self.build / "workspace"

    @property
    def wheel_dir(self) -> Path:
        return self.build / "wheel"

    @property
    def consumer_wheel_dir(self) -> Path:
        """The reference consumer's own wheel (main target only)."""
        return self.build / "consumer-wheel"

    @property
    def logs(self) -> Path:
        return self.build / "logs"

    @property
    def dist(self) -> Path:
        return self.root / "dist"


def default_layout(target: str = "") -> Layout:
    return target_layout(Path(__file__).resolve().parents[2], target)


def target_names(root: Path) -> list[str]:
    """The checkout's targets: the main one ("") and each
    ``targets/NAME/pin.toml``."""
    return ["", *sorted(p.parent.name for p in (root / "targets").glob("*/pin.toml"))]


def target_layout(root: Path, target: str) -> Layout:
    """The layout of ``target`` in the checkout at ``root``; a named target
    must have its pin."""
    layout = Layout(root, target)
    if target and not layout.pin.is_file():
        known = target_names(root)[1:]
        raise OverlayError(
            f"no target {target!r}: {layout.pin} does not exist",
            "use one of: "
            + ", ".join(f"--target {k}" for k in known)
            + (" or " if known else "")
            + "no --target (the main target, pin.toml)",
        )
    return layout


def copy_checkout(layout: Layout, dest: Path, cache: Path | None) -> Layout:
    """Copy the files git tracks in ``layout`` to ``dest``: a checkout of its
    own (build/, dist/), sharing ``cache`` when one is given."""
    files = subprocess.run(
        ["git", "-C", str(layout.root), "ls-files", "-z"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for rel in filter(None, files.split("\0")):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(layout.root / rel, dest / rel)
    if cache is not None:
        (dest / ".cache").symlink_to(cache)
    return Layout(dest, layout.target)
