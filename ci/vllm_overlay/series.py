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

# DEP-3 fields every patch of this project must fill (docs/maintainers.md).
REQUIRED_FIELDS = ("Description", "Forwarded", "Last-Update")
ONE_OF_FIELDS = ("Author", "Origin")
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


def header_problems(patch: Patch) -> list[str]:
    problems = [
        f"DEP-3 field {field!r} is missing or empty"
        for field in REQUIRED_FIELDS
        if not patch.header.get(field)
    ]
    if not any(patch.header.get(field) for field in ONE_OF_FIELDS):
        problems.append("DEP-3 needs an 'Author' or an 'Origin' field")
    problems += [
        f"DEP-3 field {field!r} still holds the template text"
        for field, value in patch.header.items()
        if value.startswith("<")
    ]
    last_update = patch.header.get("Last-Update", "")
    if last_update and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", last_update):
        problems.append(f"Last-Update {last_update!r} is not YYYY-MM-DD")
    return problems


_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def diff_problems(patch: Patch) -> list[str]:
    """Hunks whose line counts do not add up, and added trailing whitespace."""
    problems: list[str] = []
    old_left = new_left = 0
    lines = patch.path.read_text().splitlines()
    for number, line in enumerate(lines, start=1):
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


def source_date_epoch(patches: list[Patch], pin_date: str) -> int:
    """The build's fixed timestamp: the newest Last-Update of the series, or
    ``pin_date`` (YYYY-MM-DD) when that is newer, at midnight UTC."""
    dates = [pin_date, *(p.header.get("Last-Update", "") for p in patches)]
    newest = max(d for d in dates if re.fullmatch(r"\d{4}-\d{2}-\d{2}", d))
    return int(datetime.datetime.fromisoformat(f"{newest}T00:00:00+00:00").timestamp())
