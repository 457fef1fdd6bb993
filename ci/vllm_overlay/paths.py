"""Where things live in a checkout. Everything generated is git-ignored."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def pin(self) -> Path:
        return self.root / "pin.toml"

    @property
    def patches(self) -> Path:
        return self.root / "patches"

    @property
    def overlay(self) -> Path:
        return self.root / "overlay"

    @property
    def build_requirements(self) -> Path:
        return self.root / "ci" / "requirements-build.txt"

    @property
    def test_requirements(self) -> Path:
        return self.root / "ci" / "requirements-test.txt"

    @property
    def cache(self) -> Path:
        return self.root / ".cache"

    @property
    def downloads(self) -> Path:
        return self.cache / "downloads"

    @property
    def build(self) -> Path:
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
        """The maintainer's git workspace (README, 'Refresh a patch')."""
        return self.build / "workspace"

    @property
    def wheel_dir(self) -> Path:
        return self.build / "wheel"

    @property
    def logs(self) -> Path:
        return self.build / "logs"

    @property
    def dist(self) -> Path:
        return self.root / "dist"


def default_layout() -> Layout:
    return Layout(Path(__file__).resolve().parents[2])


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
    return Layout(dest)
