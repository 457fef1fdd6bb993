"""Copy ``overlay/`` onto the patched tree: new files only."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from vllm_overlay.errors import OverlayError
from vllm_overlay.manifest import MODULE as MANIFEST_MODULE
from vllm_overlay.paths import Layout
from vllm_overlay.series import load_series


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
            "(`ci/overlay new NAME`, README 'Add a patch') and remove it from "
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
