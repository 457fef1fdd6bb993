"""The patch series: quilt's ``series`` file and the DEP-3 headers.

``patches/series`` lists one patch per line in application order; ``#``
starts a comment. Only ``-p1`` patches are supported, so no per-line options.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay.errors import OverlayError

# DEP-3's fields (Bug-<Vendor> besides): any other name is a typo or text
# that lost its continuation indent, and a misspelt field reads as missing.
DEP3_FIELDS = frozenset(
    {
        "Description",
        "Subject",
        "Origin",
        "Bug",
        "Forwarded",
        "Author",
        "From",
        "Reviewed-by",
        "Acked-by",
        "Last-Update",
        "Applied-Upstream",
    }
)
# Forwarded is a URL, or one of these words (docs/maintainers.md, "The patch
# format"). DEP-3 also reads any other value, "yes" included, as "forwarded";
# this project asks for the URL instead, so a reader can open what upstream
# was sent.
FORWARDED_WORDS = ("no", "not-needed")
# Origin's keywords for a change upstream made (DEP-3): such a patch needs no
# Forwarded field.
UPSTREAM_ORIGINS = ("upstream, ", "backport, ")
_URL = re.compile(r"https?://[^\s/]+\S*")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
SEPARATOR = "---"
# A header says what the patch changes and why, for a reviewer; figures and
# history belong in reports and commit bodies (docs/maintainers.md).
HEADER_MAX_LINES = 25
HEADER_MAX_WIDTH = 79
_FIELD = re.compile(r"^([A-Za-z][A-Za-z0-9-]*):\s?(.*)$")
_DIFF_START = re.compile(r"^(--- |diff |Index: )")
_TARGET = re.compile(r"^\+\+\+ (?:b/)?(\S+)")


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path
    header: dict[str, str]
    targets: tuple[str, ...]  # upstream-relative paths the patch touches


def header_text(text: str) -> str:
    """Everything before the first file diff, verbatim."""
    offset = 0
    for line in text.splitlines(keepends=True):
        if _DIFF_START.match(line):
            break
        offset += len(line)
    return text[:offset]


def parse_header(text: str) -> dict[str, str]:
    """DEP-3 fields before the diff; continuation lines start with a space."""
    fields: dict[str, str] = {}
    last: str | None = None
    for line in header_text(text).splitlines():
        if line.startswith((" ", "\t")) and last is not None:
            fields[last] += "\n" + line.strip()
            continue
        if m := _FIELD.match(line):
            last = m.group(1)
            fields[last] = m.group(2).strip()
        elif line.strip() == "---":
            break
    return fields


def parse_targets(text: str) -> tuple[str, ...]:
    return tuple(m.group(1) for line in text.splitlines() if (m := _TARGET.match(line)))


def read_series(patches_dir: Path) -> list[str]:
    series = patches_dir / "series"
    if not series.is_file():
        raise OverlayError(
            f"{series} not found", "create it: one patch file name per line"
        )
    names: list[str] = []
    for number, raw in enumerate(series.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *options = line.split()
        if options and options != ["-p1"]:
            raise OverlayError(
                f"{series}:{number}: unsupported options {' '.join(options)!r}",
                "write patches as -p1 (a/ and b/ prefixes) and drop the options",
            )
        if "/" in name or name.startswith("."):
            raise OverlayError(
                f"{series}:{number}: {name!r} must be a plain file name in patches/",
                "move the patch into patches/ and list it by name",
            )
        if name in names:
            raise OverlayError(
                f"{series}:{number}: {name} is listed twice",
                "remove the duplicate line",
            )
        names.append(name)
    return names


def load_series(patches_dir: Path) -> list[Patch]:
    """Read the series, checking it and patches/ agree both ways."""
    names = read_series(patches_dir)
    for name in names:
        if not (patches_dir / name).is_file():
            raise OverlayError(
                f"{patches_dir / 'series'} lists {name}, which is not in {patches_dir}",
                f"add {patches_dir / name} or remove its line from series",
            )
    unlisted = sorted(
        p.name for p in patches_dir.glob("*.patch") if p.name not in names
    )
    if unlisted:
        raise OverlayError(
            f"{patches_dir} has patches that series does not list: "
            f"{', '.join(unlisted)}",
            "add them to patches/series in order, or delete them",
        )
    patches = []
    for name in names:
        path = patches_dir / name
        text = path.read_text()
        targets = parse_targets(text)
        if not targets:
            raise OverlayError(f"{path} contains no diff", "regenerate the patch")
        for target in targets:
            if target.startswith("/") or ".." in Path(target).parts:
                raise OverlayError(
                    f"{path}: target path {target!r} leaves the tree",
                    "regenerate the patch from the tree root with a/ b/ prefixes",
                )
        patches.append(Patch(name, path, parse_header(text), targets))
    return patches


def is_date(text: str) -> bool:
    """A real calendar day written YYYY-MM-DD (DEP-3's Last-Update)."""
    if not _DATE.fullmatch(text):
        return False
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return True


def header_problems(patch: Patch) -> list[str]:
    """What keeps the patch's header from DEP-3 and the project's fixed format
    (docs/maintainers.md, "The patch format"), each with the edit that fixes
    it."""
    header = patch.header
    # A field still holding workspace.HEADER_TEMPLATE's <placeholder> is
    # reported as that alone, not also as a malformed value.
    filled = {
        field: value
        for field, value in header.items()
        if not any(line.startswith("<") for line in value.splitlines())
    }
    problems = [
        f"{field} still holds the template text: fill it in"
        for field in header
        if field not in filled
    ]
    description = header.get("Description", header.get("Subject"))
    if description is None:
        problems.append(
            "no Description: add 'Description: <one-line summary>' with the why "
            "on the lines below it, each indented by one space"
        )
    elif not description.split("\n")[0]:
        problems.append(
            "Description has no summary on its first line: put a one-line "
            "summary right after 'Description:'"
        )
    if not any(header.get(field) for field in ("Author", "From", "Origin")):
        problems.append(
            "no Author or Origin: add 'Author: Name <address>', or for a "
            "backport 'Origin: backport, <upstream URL>'"
        )
    # DEP-3: a patch taken from upstream ("upstream" or "backport" origin)
    # has nothing to forward; Forwarded is for the project's own changes.
    from_upstream = header.get("Origin", "").startswith(UPSTREAM_ORIGINS)
    if not header.get("Forwarded") and not from_upstream:
        problems.append(
            "no Forwarded: add 'Forwarded: <upstream URL>', 'Forwarded: no' "
            "(not sent yet; say why in Description) or 'Forwarded: not-needed' "
            "(must never go upstream)"
        )
    if not header.get("Last-Update"):
        problems.append(
            "no Last-Update: add 'Last-Update: YYYY-MM-DD', the day of the "
            "patch's last change"
        )
    for field, value in filled.items():
        if field == "Forwarded":
            if value and value not in FORWARDED_WORDS and not _URL.fullmatch(value):
                problems.append(
                    f"Forwarded: {value!r} is not a URL, no or not-needed: set "
                    "it to the upstream URL, to no (not sent yet; say why in "
                    "Description) or to not-needed (must never go upstream)"
                )
        elif field == "Last-Update":
            if value and not is_date(value):
                problems.append(
                    f"Last-Update {value!r} is not a date written YYYY-MM-DD: "
                    "set it to the day of the patch's last change"
                )
        elif field == "Bug" or field.startswith("Bug-"):
            if not _URL.fullmatch(value):
                problems.append(
                    f"{field}: {value!r} is not a URL: set it to the bug's "
                    "http(s) URL, or remove the line"
                )
        elif field not in DEP3_FIELDS:
            problems.append(
                f"{field!r} is not a DEP-3 field: correct its name "
                f"({', '.join(sorted(DEP3_FIELDS))}, Bug-<Vendor>), or indent "
                "the line by one space if it continues the field above"
            )
    lines = header_text(patch.path.read_text()).splitlines()
    if len(lines) - 1 > HEADER_MAX_LINES:
        problems.append(
            f"the header is {len(lines) - 1} lines, over {HEADER_MAX_LINES}: say "
            "what changes and why; move figures to a report and the history to "
            "the commit body"
        )
    for number, line in enumerate(lines, start=1):
        if len(line) > HEADER_MAX_WIDTH:
            problems.append(
                f"header line {number} is {len(line)} characters, over "
                f"{HEADER_MAX_WIDTH}: wrap it onto a line that starts with one space"
            )
    if lines[-1:] != [SEPARATOR]:
        problems.append(
            f"the header does not end with a line {SEPARATOR!r}: put that line "
            "right before the diff"
        )
    return problems


_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
# What `patch`, `git apply --reject` and editors leave beside a file; a diff
# that touches one would ship it inside the wheel.
_LEFTOVER_SUFFIXES = (".orig", ".rej", "~")


def diff_problems(patch: Patch) -> list[str]:
    """Hunks whose line counts do not add up, added trailing whitespace, and
    files that are leftovers of a failed apply or an editor."""
    problems: list[str] = []
    old_left = new_left = 0
    lines = patch.path.read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        if line.startswith("diff --git ") and line.endswith(_LEFTOVER_SUFFIXES):
            name = line.rsplit(" b/", 1)[-1]
            problems.append(
                f"line {number}: diff adds the leftover file {name}; delete it in"
                " the workspace and re-export the series"
            )
        if old_left or new_left:
            tag = line[:1]
            if tag in (" ", ""):
                old_left, new_left = old_left - 1, new_left - 1
            elif tag == "-":
                old_left -= 1
            elif tag == "+":
                new_left -= 1
                if line != line.rstrip():
                    problems.append(f"line {number}: added line ends in whitespace")
            elif tag != "\\":
                problems.append(f"line {number}: hunk ends early")
                old_left = new_left = 0
            if old_left < 0 or new_left < 0:
                problems.append(f"line {number}: hunk is longer than its header says")
                old_left = new_left = 0
        elif m := _HUNK.match(line):
            old_left = int(m.group(1) or 1)
            new_left = int(m.group(2) or 1)
    if old_left or new_left:
        problems.append("last hunk ends early")
    return problems


def patch_map(patches: list[Patch]) -> str:
    """The table of docs/architecture.md's "The engine series", from the
    headers: each patch, its one-line summary and where it stands upstream
    (``Forwarded``)."""
    lines = ["| patch | what it changes | forwarded |", "|---|---|---|"]
    for patch in patches:
        summary = patch.header.get("Description", "").split("\n")[0]
        forwarded = patch.header.get("Forwarded", "")
        lines.append(f"| `{patch.path.stem}` | {summary} | {forwarded} |")
    return "\n".join(lines) + "\n"


def source_date_epoch(patches: list[Patch], pin_date: str) -> int:
    """The build's fixed timestamp: the newest Last-Update of the series, or
    ``pin_date`` (YYYY-MM-DD) when that is newer, at midnight UTC."""
    dates = [pin_date, *(p.header.get("Last-Update", "") for p in patches)]
    newest = max(d for d in dates if is_date(d))
    return int(datetime.datetime.fromisoformat(f"{newest}T00:00:00+00:00").timestamp())
