"""Apply the series onto a scratch tree with zero fuzz and zero offset.

GNU patch does the work; every patch is first tried with ``--dry-run`` so a
patch that would need fuzz, land at another line, or fail leaves the tree as
the previous patch left it. ``classify`` names what is wrong, which is also
what the rebase dry-run reports.
"""

from __future__ import annotations

import enum
import itertools
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay.errors import OverlayError
from vllm_overlay.series import Patch

_OFFSET = re.compile(r"^Hunk #\d+ succeeded at \d+ \(offset -?\d+ lines?\)", re.M)
_FUZZ = re.compile(r"^Hunk #\d+ succeeded at \d+ with fuzz \d+", re.M)
_FAILED = re.compile(r"^Hunk #\d+ FAILED at \d+.*$", re.M)


class Fit(enum.Enum):
    CLEAN = "clean"
    OFFSET = "offset only"
    FUZZ = "needs fuzz"
    CONFLICT = "conflict"
    ALREADY_UPSTREAM = "already upstream"
    TARGET_GONE = "target file gone"


@dataclass(frozen=True)
class FitReport:
    fit: Fit
    detail: str  # patch's own words: offset/fuzz/failed hunk lines


def _patch(tree: Path, patch: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            "patch",
            "-p1",
            "--batch",
            "--forward",
            "--no-backup-if-mismatch",
            "--reject-file=-",
            "-d",
            str(tree),
            "-i",
            str(patch.resolve()),
            *options,
        ],
        capture_output=True,
        text=True,
        # The fit is read from patch's messages ("with fuzz", "offset"),
        # which a translated locale would word otherwise.
        env={**os.environ, "LC_ALL": "C"},
    )


def classify(tree: Path, patch: Patch) -> FitReport:
    """How ``patch`` fits ``tree`` now, without changing the tree."""
    missing = [t for t in patch.targets if not (tree / t).exists()]
    creates = _created_files(patch)
    gone = [t for t in missing if t not in creates]
    if gone:
        return FitReport(Fit.TARGET_GONE, ", ".join(gone))
    strict = _patch(tree, patch.path, "--dry-run", "--fuzz=0")
    out = strict.stdout + strict.stderr
    if strict.returncode == 0:
        if offsets := _OFFSET.findall(out):
            return FitReport(Fit.OFFSET, "; ".join(offsets))
        return FitReport(Fit.CLEAN, "")
    if _patch(tree, patch.path, "--dry-run", "--reverse", "--fuzz=0").returncode == 0:
        return FitReport(Fit.ALREADY_UPSTREAM, "applies in reverse")
    loose = _patch(tree, patch.path, "--dry-run", "--fuzz=3")
    if loose.returncode == 0:
        fuzz = _FUZZ.findall(loose.stdout + loose.stderr)
        return FitReport(Fit.FUZZ, "; ".join(fuzz))
    failed = _FAILED.findall(loose.stdout + loose.stderr) or [out.strip()]
    return FitReport(Fit.CONFLICT, "; ".join(failed))


def _created_files(patch: Patch) -> set[str]:
    text = patch.path.read_text()
    created = set()
    lines = text.splitlines()
    for before, after in itertools.pairwise(lines):
        if before.startswith("--- /dev/null") and after.startswith("+++ "):
            created.add(after[4:].split("\t")[0].removeprefix("b/"))
    return created


def apply_patch(tree: Path, patch: Patch, command: str = "ci/overlay") -> None:
    """Apply ``patch`` exactly; ``command`` is the tool as the target's
    hints name it (``Layout.command``)."""
    report = classify(tree, patch)
    if report.fit is not Fit.CLEAN:
        raise OverlayError(
            f"{patch.path}: does not apply exactly ({report.fit.value}: "
            f"{report.detail})",
            # Both commands work on the whole series, so running them as
            # printed refreshes this patch and keeps every later one.
            f"refresh it: `{command} workspace` (applies the series with "
            f"quilt's tolerance, stops at a conflict), then `{command} export` "
            "(docs/maintainers.md, recipe 3)",
        )
    result = _patch(tree, patch.path, "--fuzz=0", "--quiet")
    if result.returncode != 0:  # dry-run passed, so this is the machine's fault
        raise OverlayError(
            f"{patch.path}: patch failed after a clean dry-run: {result.stderr}",
            "check disk space and permissions of the build directory",
        )


def apply_loosely(tree: Path, patch: Patch) -> None:
    """Apply with offset and up to 3 lines of fuzz (one more than quilt's
    default of 2); only for the workspace, whose export then records the
    exact fit."""
    result = _patch(tree, patch.path, "--fuzz=3", "--quiet")
    if result.returncode != 0:
        raise OverlayError(
            f"{patch.path}: {result.stdout}{result.stderr}",
            "resolve it by hand in the workspace",
        )


def apply_series(tree: Path, patches: list[Patch], command: str = "ci/overlay") -> None:
    for patch in patches:
        apply_patch(tree, patch, command)
        print(f"  applied {patch.name}", file=sys.stderr)
