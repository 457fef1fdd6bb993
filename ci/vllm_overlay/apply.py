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
_PATCHING = re.compile(r"^(?:patching|checking) file (?P<file>.+)$")
_FUZZED = re.compile(
    r"^Hunk #(?P<hunk>\d+) succeeded at (?P<line>\d+) with fuzz (?P<fuzz>\d+)"
)
# quilt's default: at most 2 of a hunk's 3 context lines may be ignored.
MAX_FUZZ = 2


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
    loose = _patch(tree, patch.path, "--dry-run", f"--fuzz={MAX_FUZZ}")
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
    """Apply with offset and at most quilt's default fuzz; only for the
    workspace, whose export then records the exact fit. Each hunk that
    needed fuzz is printed as a warning naming it: fuzz ignores context
    lines, so the result is worth a look."""
    result = _patch(tree, patch.path, f"--fuzz={MAX_FUZZ}")
    if result.returncode != 0:
        raise OverlayError(
            f"{patch.path}: {result.stdout}{result.stderr}",
            "resolve it by hand in the workspace",
        )
    for warning in fuzzed_hunks(patch, result.stdout):
        print(f"  warning: {patch.name}: {warning}", file=sys.stderr)


def fuzzed_hunks(patch: Patch, output: str) -> list[str]:
    """File, ``@@`` header and fuzz of each hunk that GNU patch's
    ``output`` says needed fuzz."""
    headers = {
        target: [x for x in section.splitlines() if x.startswith("@@")]
        for target, section in file_sections(patch.path.read_text())
    }
    found = []
    current = ""
    for line in output.splitlines():
        if match := _PATCHING.match(line):
            current = match["file"]
        elif match := _FUZZED.match(line):
            header = headers.get(current, [])[int(match["hunk"]) - 1 :][:1]
            found.append(
                f"{current} {''.join(header)}: applied at line {match['line']} "
                f"with fuzz {match['fuzz']} ({match['fuzz']} context lines not "
                "compared)"
            )
    return found


def file_sections(text: str) -> list[tuple[str, str]]:
    """(target, that file's part of the diff) for each file a patch changes."""
    lines = text.splitlines(keepends=True)
    starts: list[int] = []
    for i, line in enumerate(lines):
        if (
            line.startswith("diff ")
            or (
                line.startswith("--- ")
                and lines[i + 1 : i + 2] != []
                and lines[i + 1].startswith("+++ ")
                # a plain `diff -u` file header, not the one after `diff --git`
                and (
                    not starts
                    or any(x.startswith("+++ ") for x in lines[starts[-1] : i])
                )
            )
        ):
            starts.append(i)
    sections = []
    for start, end in zip(starts, [*starts[1:], len(lines)], strict=True):
        part = lines[start:end]
        target = next(
            (m.group(1) for x in part if (m := re.match(r"^\+\+\+ (?:b/)?(\S+)", x))),
            "",
        )
        sections.append((target, "".join(part)))
    return sections


def apply_series(tree: Path, patches: list[Patch], command: str = "ci/overlay") -> None:
    for patch in patches:
        apply_patch(tree, patch, command)
        print(f"  applied {patch.name}", file=sys.stderr)
