"""Rebase dry-run: how the series fits other upstream releases.

Each patch is tried alone on a fresh tree of the target release and in
sequence (a patch that fits with offset or fuzz is applied loosely so the
next ones see it; a conflicting one is left out). The result is a matrix of
``apply.Fit`` classes, printed for people and written as JSON for machines.
With ``--write``, the patches that apply are refreshed into an output
directory together with a pin for the target; the rest need a human.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay import apply, workspace
from vllm_overlay.errors import OverlayError
from vllm_overlay.fetch import default_index_url, fetch, list_files
from vllm_overlay.pin import Pin, PinnedFile
from vllm_overlay.series import Patch
from vllm_overlay.source import extract_sdist

_NEEDS_HUMAN = {apply.Fit.CONFLICT, apply.Fit.TARGET_GONE}


@dataclass(frozen=True)
class Release:
    version: str
    sdist: PinnedFile
    wheel: PinnedFile | None


@dataclass(frozen=True)
class PatchFit:
    alone: apply.FitReport
    in_sequence: apply.FitReport


def find_release(
    version: str,
    wheel_tag: str,
    index_url: str | None = None,
    project: str = "vllm",
) -> Release:
    """Name and sha256 of a release's files, as the index lists them: the
    sdist of vllm, the wheel of ``project`` (the pin's wheel project)."""
    index_url = index_url or default_index_url()
    entries = {e["filename"]: e for e in list_files(index_url, "vllm")}
    if project != "vllm":
        entries.update((e["filename"], e) for e in list_files(index_url, project))

    def pinned(filename: str) -> PinnedFile | None:
        entry = entries.get(filename)
        if entry is None or "sha256" not in entry.get("hashes", {}):
            return None
        return PinnedFile(filename, entry["hashes"]["sha256"])

    sdist = pinned(f"vllm-{version}.tar.gz")
    if sdist is None:
        raise OverlayError(
            f"the package index has no sdist for vllm {version}",
            "check the version number",
        )
    distribution = project.replace("-", "_")
    return Release(version, sdist, pinned(f"{distribution}-{version}-{wheel_tag}.whl"))


def fit_series(
    pristine: Path, patches: list[Patch], scratch: Path
) -> dict[str, PatchFit]:
    """Classify every patch alone and in sequence on copies of ``pristine``."""
    sequence = scratch / "sequence"
    shutil.copytree(pristine, sequence, symlinks=True)
    fits: dict[str, PatchFit] = {}
    for patch in patches:
        alone_tree = scratch / "alone"
        shutil.copytree(pristine, alone_tree, symlinks=True)
        alone = apply.classify(alone_tree, patch)
        shutil.rmtree(alone_tree)
        in_sequence = apply.classify(sequence, patch)
        if in_sequence.fit not in _NEEDS_HUMAN | {apply.Fit.ALREADY_UPSTREAM}:
            apply.apply_loosely(sequence, patch)
        fits[patch.name] = PatchFit(alone, in_sequence)
    shutil.rmtree(sequence)
    return fits


def matrix(results: dict[str, dict[str, PatchFit]], names: list[str]) -> str:
    """Patches x versions; a cell is 'alone / in sequence' when they differ."""
    versions = list(results)

    def cell(fit: PatchFit) -> str:
        a, s = fit.alone.fit.value, fit.in_sequence.fit.value
        return a if a == s else f"{a} / {s}"

    rows = [["patch", *versions]] + [
        [name, *(cell(results[v][name]) for v in versions)] for name in names
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(
    releases: dict[str, Release], results: dict[str, dict[str, PatchFit]]
) -> dict:
    def fit_json(r: apply.FitReport) -> dict[str, str]:
        return {"fit": r.fit.value, "detail": r.detail}

    return {
        version: {
            "sdist": {
                "filename": releases[version].sdist.filename,
                "sha256": releases[version].sdist.sha256,
            },
            "patches": {
                name: {
                    "alone": fit_json(f.alone),
                    "in_sequence": fit_json(f.in_sequence),
                }
                for name, f in fits.items()
            },
        }
        for version, fits in results.items()
    }


def _commit_short(tree: Path) -> str:
    text = (tree / "vllm" / "_version.py").read_text()
    match = re.search(r"commit_id = '?g?([0-9a-f]+)", text)
    return match.group(1) if match else ""


def write_rebased(
    pin: Pin,
    release: Release,
    pristine: Path,
    patches: list[Patch],
    fits: dict[str, PatchFit],
    out: Path,
) -> list[str]:
    """Refresh the patches that apply into ``out``; return those needing a human."""
    if release.wheel is None:
        raise OverlayError(
            f"no {pin.wheel_tag} wheel of {pin.wheel_project} {release.version} "
            "on the package index",
            "pick a release with a wheel",
        )
    human = [
        n
        for n, f in fits.items()
        if f.in_sequence.fit in _NEEDS_HUMAN | {apply.Fit.ALREADY_UPSTREAM}
    ]
    ws = out / "workspace"
    shutil.copytree(pristine, ws, symlinks=True)
    workspace.make_workspace(ws, [p for p in patches if p.name not in human], upto=None)
    (out / "patches").mkdir()
    workspace.export(ws, out / "patches")
    text = pin.path.read_text()
    for old, new in (
        (f'tag = "{pin.tag}"', f'tag = "v{release.version}"'),
        (f'version = "{pin.version}"', f'version = "{release.version}"'),
        (f'commit = "{pin.commit}"', 'commit = ""'),
        (
            f'commit_short = "{pin.commit_short}"',
            f'commit_short = "{_commit_short(pristine)}"',
        ),
        (pin.sdist.filename, release.sdist.filename),
        (pin.sdist.sha256, release.sdist.sha256),
        (pin.wheel.filename, release.wheel.filename),
        (pin.wheel.sha256, release.wheel.sha256),
    ):
        text = text.replace(old, new)
    (out / "pin.toml").write_text(text)
    return human


def dry_run(
    pin: Pin,
    patches: list[Patch],
    versions: list[str],
    cache_dir: Path,
    work: Path,
    json_out: Path,
    write: bool,
) -> int:
    releases: dict[str, Release] = {}
    results: dict[str, dict[str, PatchFit]] = {}
    needs_human: dict[str, list[str]] = {}
    for version in versions:
        release = find_release(version, pin.wheel_tag, project=pin.wheel_project)
        releases[version] = release
        sdist = fetch(release.sdist, cache_dir)
        scratch = work / version
        if scratch.exists():
            shutil.rmtree(scratch)
        pristine = scratch / "pristine"
        extract_sdist(sdist, pristine)
        print(
            f"  {version}: {release.sdist.filename} sha256 {release.sdist.sha256}",
            file=sys.stderr,
        )
        results[version] = fit_series(pristine, patches, scratch)
        if write:
            needs_human[version] = write_rebased(
                pin, release, pristine, patches, results[version], scratch / "rebased"
            )
            print(
                f"  {version}: refreshed series and pin in {scratch / 'rebased'}",
                file=sys.stderr,
            )
    print(matrix(results, [p.name for p in patches]))
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(
        json.dumps(report(releases, results), indent=2, sort_keys=True) + "\n"
    )
    for version, names in needs_human.items():
        for name in names:
            print(f"needs a human on {version}: {name}", file=sys.stderr)
        print(
            f"needs a human on {version}: pin.toml's [upstream.wheel] torch "
            "and [build] torch (read them off that release's wheel METADATA)",
            file=sys.stderr,
        )
    return 0
