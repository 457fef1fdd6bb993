"""Copy ``overlay/`` onto the patched tree: new files only."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import sys
from pathlib import Path

from vllm_overlay.errors import OverlayError
from vllm_overlay.manifest import MODULE as MANIFEST_MODULE
from vllm_overlay.paths import Layout
from vllm_overlay.pin import Pin, load_pin
from vllm_overlay.series import Patch, load_series


def overlay_files(overlay_dir: Path) -> list[str]:
    """Upstream-relative paths of the overlay's files, sorted."""
    if not overlay_dir.is_dir():
        return []
    return sorted(
        p.relative_to(overlay_dir).as_posix()
        for p in overlay_dir.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )


def copy_overlay(overlay_dir: Path, tree: Path) -> list[str]:
    files = overlay_files(overlay_dir)
    collisions = [f for f in files if (tree / f).exists()]
    if collisions:
        raise OverlayError(
            f"overlay/{collisions[0]} would replace the upstream file "
            f"{collisions[0]}"
            + (f" (and {len(collisions) - 1} more)" if len(collisions) > 1 else ""),
            "overlay/ only adds files: express the change as a patch "
            "(`ci/overlay new NAME`, docs/maintainers.md, recipe 1) and remove it from "
            "overlay/",
        )
    for rel in files:
        target = tree / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(overlay_dir / rel, target)
    print(f"  copied {len(files)} overlay files", file=sys.stderr)
    return files


def patched_files(layout: Layout) -> set[str]:
    """Upstream-relative files the series changes or the overlay adds."""
    touched = {t for p in load_series(layout.patches) for t in p.targets}
    return touched | set(overlay_files(layout.overlay))


def touched_files(layout: Layout) -> set[str]:
    """Files of the built tree that differ from upstream's: the patched ones
    and the generated provenance manifest."""
    return patched_files(layout) | {MANIFEST_MODULE}


def check_checkout(layout: Layout) -> list[Patch]:
    """Every check that needs only the checkout's own files, so a mistake in
    them is reported before any download or tree: the pin, the series (entries
    both ways, headers' targets) and overlay files that replace a file a patch
    changes. (An overlay file that replaces an unpatched upstream file is only
    known once the tree is laid: ``copy_overlay``.)"""
    load_pin(layout.pin)
    patches = load_series(layout.patches)
    targets = {t for p in patches for t in p.targets}
    if clash := [f for f in overlay_files(layout.overlay) if f in targets]:
        raise OverlayError(
            f"overlay/{clash[0]} would replace {clash[0]}, which the series patches",
            "overlay/ only adds files: move the change into the patch and remove "
            f"overlay/{clash[0]}",
        )
    return patches


def series_digest(layout: Layout) -> str:
    """sha256 over what the wheel carries besides the pinned release: the
    series in order with each patch's bytes, and overlay/'s files."""
    digest = hashlib.sha256()
    for patch in load_series(layout.patches):
        digest.update(f"patch {patch.name}\n".encode())
        digest.update(patch.path.read_bytes())
    for rel in overlay_files(layout.overlay):
        digest.update(f"overlay {rel}\n".encode())
        digest.update((layout.overlay / rel).read_bytes())
    return digest.hexdigest()


def labelled_pin(layout: Layout) -> Pin:
    """The pin with the series' digest appended to its local label, so two
    different series never give the same wheel name and version:
    ``0.34.0+overlay.1.s<10 hex>``. ``local_label`` stays the human part."""
    pin = load_pin(layout.pin)
    label = f"{pin.local_label}.s{series_digest(layout)[:10]}"
    return dataclasses.replace(pin, local_label=label)
