"""Copy ``overlay/`` onto the patched tree: new files only."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from vllm_overlay.errors import OverlayError


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
