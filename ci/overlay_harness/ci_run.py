"""How long a ``ci/test.sh`` run took, step by step: the report behind the
CI time that README.md and docs/testing.md state.

``ci/test.sh`` appends one line per step to a steps file (the step's start
in seconds since the epoch, its lane, its name) and ends each lane with a
step named ``end``; it samples the disk in use every 20 s into a disk file
(seconds, KiB used); pytest writes its JUnit XML. ``record`` turns them,
and the size of ``.cache/`` at the end, into ``build/ci-run.json``. A cold
fresh-clone run's report, copied to ``docs/cold-ci-run.json``, is what the
docs quote: ``headline`` is the README's sentence, ``breakdown`` the table
and ``disk_use`` the disk sentence in docs/testing.md, all checked by
``tests/test_docs.py``. No test asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# .ci/run's limit for a cold run (the brief CI runs under).
BUDGET_MIN = 45
# How many of the slowest test modules the report keeps.
SLOWEST_MODULES = 5
END = "end"


class ReportError(Exception):
    """A steps, disk or JUnit file that cannot be read as ``ci/test.sh``
    and pytest write it."""


Row = tuple[float, str, str]


def read_rows(path: Path) -> list[Row]:
    """The steps file's lines: (epoch seconds, lane, step)."""
    rows: list[Row] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split("\t")
        if len(fields) != 3:
            raise ReportError(
                f"{path}:{n}: {line!r} is not 'SECONDS<TAB>LANE<TAB>STEP'"
            )
        try:
            at = float(fields[0])
        except ValueError:
            raise ReportError(f"{path}:{n}: {fields[0]!r} is not a time") from None
        rows.append((at, fields[1], fields[2]))
    if not rows:
        raise ReportError(f"{path} names no step: was it written by ci/test.sh?")
    return rows


def timed_steps(rows: list[Row], started: float) -> list[dict[str, Any]]:
    """Each step with its lane, its start and its duration in seconds,
    counted from ``started`` (the epoch second the run began). A step lasts
    until the next step of its lane; the last one of a lane that has no
    ``end`` (a lane stopped by an error) lasts until the last line."""
    last = max(at for at, _, _ in rows)
    steps = []
    for i, (at, lane, name) in enumerate(rows):
        if name == END:
            continue
        later = [a for a, ln, _ in rows[i + 1 :] if ln == lane]
        steps.append(
            {
                "lane": lane,
                "step": name,
                "start_s": round(at - started, 1),
                "duration_s": round((later[0] if later else last) - at, 1),
            }
        )
    return steps


def slowest_modules(junits: list[Path]) -> list[dict[str, Any]]:
    """The test modules that took longest, with their summed test times,
    over the JUnit files of the lanes' pytest runs."""
    cases: list[ET.Element] = []
    for junit in junits:
        try:
            cases += ET.parse(junit).getroot().iter("testcase")
        except (OSError, ET.ParseError) as e:
            raise ReportError(
                f"{junit}: not a JUnit XML file pytest wrote ({e})"
            ) from e
    per_module: dict[str, float] = defaultdict(float)
    for case in cases:
        # "tests.test_docs" or "tests.test_docs.TestClass": the module is
        # the path up to the first test_ part.
        parts = case.get("classname", "").split(".")
        cut = next((i for i, p in enumerate(parts) if p.startswith("test_")), -1)
        module = "/".join(parts[: cut + 1]) + ".py"
        per_module[module] += float(case.get("time", "0"))
    ranked = sorted(per_module.items(), key=lambda kv: -kv[1])
    return [
        {"module": m, "duration_s": round(s, 1)} for m, s in ranked[:SLOWEST_MODULES]
    ]


def read_disk(path: Path) -> dict[str, Any]:
    """The disk file's samples: KiB in use at the start, and the most
    beyond that."""
    used = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split("\t")
        if len(fields) != 2 or not fields[1].isdigit():
            raise ReportError(f"{path}:{n}: {line!r} is not 'SECONDS<TAB>KIB_USED'")
        used.append(int(fields[1]))
    if not used:
        raise ReportError(f"{path} holds no sample: was it written by ci/test.sh?")
    return {
        "samples": len(used),
        "used_at_start_gib": round(used[0] / 2**20, 1),
        "peak_growth_gib": round((max(used) - used[0]) / 2**20, 1),
    }


def tree_gib(root: Path) -> float:
    """What ``root`` takes on the disk (as ``du``: allocated blocks, links
    not followed, each hard-linked file once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(folder, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return round(total / 2**30, 1)


def record(
    steps: Path,
    junits: list[Path],
    disk: Path,
    cache: Path,
    started: float,
    cold: bool,
    status: int,
) -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    rows = read_rows(steps)
    return {
        "commit": commit or "unknown",
        "date": datetime.fromtimestamp(started, UTC).date().isoformat(),
        "cores": os.cpu_count(),
        "cold": cold,
        "passed": status == 0,
        "total_s": round(max(at for at, _, _ in rows) - started, 1),
        "steps": timed_steps(rows, started),
        "slowest_test_modules": slowest_modules([j for j in junits if j.exists()]),
        "disk": {**read_disk(disk), "cache_gib": tree_gib(cache)},
    }


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def headline(report: dict[str, Any]) -> str:
    """The README's sentence: how long a cold fresh-clone run took."""
    total = report["total_s"] / 60
    within = "within" if total <= BUDGET_MIN else "over"
    return (
        f"A cold fresh-clone `.ci/run` of {report['commit'][:10]} took "
        f"{minutes(report['total_s'])} minutes end to end on a "
        f"{report['cores']}-core machine ({report['date']}), {within} the "
        f"{BUDGET_MIN}-minute budget."
    )


def breakdown(report: dict[str, Any]) -> str:
    """The table in docs/testing.md: each step, then the slowest modules."""
    lines = ["| lane | step | starts at (min) | takes (min) |", "|---|---|---|---|"]
    lines += [
        f"| {s['lane']} | {s['step']} | {minutes(s['start_s'])} | "
        f"{minutes(s['duration_s'])} |"
        for s in report["steps"]
    ]
    lines += [
        f"| project tests | `{m['module']}` |  | {minutes(m['duration_s'])} |"
        for m in report["slowest_test_modules"]
    ]
    return "\n".join(lines)


def disk_use(report: dict[str, Any]) -> str:
    """The disk sentence in docs/testing.md."""
    disk = report["disk"]
    return (
        f"It used up to {disk['peak_growth_gib']} GiB of disk beyond the "
        f"{disk['used_at_start_gib']} GiB in use at its start (df every 20 s, "
        f"{disk['samples']} samples), and left {disk['cache_gib']} GiB in "
        "`.cache/` for later runs to reuse."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="write the report of a ci/test.sh run")
    rec.add_argument("--steps", type=Path, required=True)
    rec.add_argument(
        "--junit", type=Path, action="append", default=[], help="one per pytest run"
    )
    rec.add_argument("--disk", type=Path, required=True)
    rec.add_argument("--cache", type=Path, required=True)
    rec.add_argument("--started", type=float, required=True)
    rec.add_argument("--cold", choices=("yes", "no"), required=True)
    rec.add_argument("--status", type=int, required=True)
    rec.add_argument("--out", type=Path, required=True)
    show = sub.add_parser("show", help="print the docs' sentence and table")
    show.add_argument("report", type=Path)
    args = parser.parse_args(argv)
    source = args.out if args.command == "record" else args.report
    try:
        if args.command == "record":
            report = record(
                args.steps,
                args.junit,
                args.disk,
                args.cache,
                args.started,
                args.cold == "yes",
                args.status,
            )
            tmp = args.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(report, indent=2) + "\n")
            tmp.replace(args.out)
        else:
            report = json.loads(source.read_text())
        print(headline(report))
        print(breakdown(report))
        print(disk_use(report))
    except KeyError as e:
        print(
            f"error: {source} has no field {e}: show a build/ci-run.json "
            "that ci/test.sh wrote",
            file=sys.stderr,
        )
        return 1
    except (OSError, ValueError, ReportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
