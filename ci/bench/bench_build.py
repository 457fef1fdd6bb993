"""Build-route benchmark: wall time, downloads and environment size.

Each route builds this checkout's inputs in a copy of the checkout:
``floor`` copies the official wheel file (the least any route can do),
``assemble`` is ./build.sh, ``python-only`` is ./build.sh --python-only
(vLLM's own python-only build). Warm runs share a filled cache; cold runs
start from an empty one. Runs alternate between routes so machine noise
hits all of them; each route's repeats are split in two halves to show the
spread of running the same thing twice.

    python3 ci/bench/bench_build.py --repeats 4 --cold 1 --out docs/bench-build.json

``--rebase VERSION --baseline-rev REV`` instead times ``ci/overlay
rebase-check VERSION`` (warm: the sdist cached) of this checkout against the
tooling of git revision REV on the same patches, alternated, and writes the
"rebase-check" section of the markdown next to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_overlay.fetch import fetch  # noqa: E402
from vllm_overlay.paths import copy_checkout, default_layout  # noqa: E402
from vllm_overlay.pin import load_pin  # noqa: E402

REPO = default_layout()
ROUTES = {"assemble": [], "python-only": ["--python-only"]}


def _tree_size(path: Path) -> int:
    return sum(
        p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()
    )


def _timed_build(checkout: Path, args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(
        [str(checkout / "build.sh"), *args],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


def _floor(official: Path, scratch: Path) -> float:
    start = time.perf_counter()
    shutil.copyfile(official, scratch / official.name)
    elapsed = time.perf_counter() - start
    (scratch / official.name).unlink()
    return elapsed


def _summary(times: list[float]) -> dict[str, float | list[float]]:
    half = len(times) // 2
    out: dict[str, float | list[float]] = {
        "runs_s": times,
        "median_s": statistics.median(times),
    }
    if half:
        out["median_first_half_s"] = statistics.median(times[:half])
        out["median_second_half_s"] = statistics.median(times[half:])
    return out


def _timed_rebase_check(checkout: Path, version: str) -> float:
    start = time.perf_counter()
    subprocess.run(
        [
            str(checkout / "ci" / "overlay"),
            "rebase-check",
            version,
            "--json",
            str(checkout / "report.json"),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


_REBASE_SECTION = "## rebase-check of one version"


def bench_rebase(args: argparse.Namespace) -> int:
    times: dict[str, list[float]] = {args.baseline_rev: [], "this checkout": []}
    REPO.build.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=REPO.build) as tmp:
        current = copy_checkout(REPO, Path(tmp) / "current", REPO.cache).root
        baseline = Path(tmp) / "baseline"
        shutil.copytree(current, baseline, symlinks=True)
        shutil.rmtree(baseline / "ci")
        archive = subprocess.run(
            ["git", "-C", str(REPO.root), "archive", args.baseline_rev, "ci"],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(baseline)], input=archive, check=True)
        _timed_rebase_check(current, args.rebase)  # the sdist into the cache
        for _ in range(args.repeats):
            times[args.baseline_rev].append(_timed_rebase_check(baseline, args.rebase))
            times["this checkout"].append(_timed_rebase_check(current, args.rebase))
    result = {
        "machine": f"{os.cpu_count()} cores, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "load_average_1min_at_end": os.getloadavg()[0],
        "version": args.rebase,
        "warm": {k: _summary(v) for k, v in times.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    base = result["warm"][args.baseline_rev]["median_s"]
    lines = [
        _REBASE_SECTION,
        "",
        f"{result['date']}, {result['machine']}, 1-min load average "
        f"{result['load_average_1min_at_end']:.1f} at the end (a shared "
        f"machine); `ci/overlay rebase-check {args.rebase}` with the sdist "
        f"cached, {args.repeats} repeats alternated. Command: `python3 "
        f"ci/bench/bench_build.py --rebase {args.rebase} --baseline-rev "
        f"{args.baseline_rev} --repeats {args.repeats} --out {args.out}`.",
        "",
        "| tooling | median s | halves s | vs baseline |",
        "|---|---:|---|---:|",
    ]
    for name, w in result["warm"].items():
        halves = (
            f"{w['median_first_half_s']:.1f} / {w['median_second_half_s']:.1f}"
            if "median_first_half_s" in w
            else "-"
        )
        lines.append(
            f"| {name} | {w['median_s']:.1f} | {halves} "
            f"| {base / w['median_s']:.1f}x faster |"
        )
    md = REPO.root / "docs" / "benchmarks" / "build.md"
    text = md.read_text() if md.exists() else ""
    text = text.split(_REBASE_SECTION)[0].rstrip("\n") + "\n\n" + "\n".join(lines)
    md.write_text(text + "\n")
    print("\n".join(lines))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--cold", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rebase", metavar="VERSION")
    parser.add_argument("--baseline-rev", default="fe6bfd6")
    args = parser.parse_args()
    if args.rebase:
        return bench_rebase(args)

    official = fetch(load_pin(REPO.pin).wheel, REPO.downloads)
    warm: dict[str, list[float]] = {"floor": [], **{r: [] for r in ROUTES}}
    cold: dict[str, list[float]] = {r: [] for r in ROUTES}
    sizes: dict[str, dict[str, int]] = {}
    REPO.build.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=REPO.build) as tmp:
        scratch = Path(tmp)
        # One checkout per route: warm is the route run again where it last
        # ran, as a release engineer re-runs ./build.sh. Sharing one checkout
        # would time assemble re-laying the tree of copies python-only left.
        checkouts = {
            route: copy_checkout(REPO, scratch / f"warm-{route}", REPO.cache).root
            for route in ROUTES
        }
        for route, flags in ROUTES.items():  # fill the shared cache first
            _timed_build(checkouts[route], flags)
        for _ in range(args.repeats):
            warm["floor"].append(_floor(official, scratch))
            for route, flags in ROUTES.items():
                warm[route].append(_timed_build(checkouts[route], flags))
        for n in range(args.cold):
            for route, flags in ROUTES.items():
                cache = scratch / f"cold-cache-{route}-{n}"
                cache.mkdir()
                cold_checkout = copy_checkout(
                    REPO, scratch / f"cold-{route}-{n}", cache
                ).root
                cold[route].append(_timed_build(cold_checkout, flags))
                envs = [p for p in cache.iterdir() if p.name.startswith("build-env")]
                sizes[route] = {
                    "downloads_bytes": _tree_size(cache / "downloads"),
                    "build_env_bytes": sum(_tree_size(e) for e in envs),
                }
                shutil.rmtree(cold_checkout)
                shutil.rmtree(cache)
    result = {
        "machine": f"{os.cpu_count()} cores, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "warm": {route: _summary(t) for route, t in warm.items()},
        "cold": {route: _summary(t) for route, t in cold.items() if t},
        "sizes": sizes,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    md = args.out.with_suffix(".md")
    kept = md.read_text().partition(_REBASE_SECTION)[1:] if md.exists() else ()
    md.write_text(
        _markdown(result, args)
        + ("\n" + "".join(kept) if kept[0:1] != ("",) and kept else "")
    )
    print(args.out.with_suffix(".md").read_text())
    return 0


def _markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    warm, cold, sizes = result["warm"], result["cold"], result["sizes"]
    python_only = warm["python-only"]["median_s"]
    lines = [
        "# Build routes",
        "",
        f"{result['date']}, {result['machine']}; {args.repeats} warm repeats per "
        f"route (alternated), {args.cold} cold run(s) per route. Command: "
        f"`python3 ci/bench/bench_build.py --repeats {args.repeats} --cold "
        f"{args.cold}`. *halves*: median of the first and second half of the "
        "warm repeats (the spread of running the same route twice).",
        "",
        "| route | warm median s | halves s | vs python-only | cold s "
        "| downloads MB | build env MB |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for route, w in warm.items():
        halves = (
            f"{w['median_first_half_s']:.2f} / {w['median_second_half_s']:.2f}"
            if "median_first_half_s" in w
            else "-"
        )
        c = cold.get(route, {}).get("median_s")
        size = sizes.get(route, {})
        lines.append(
            f"| {route} | {w['median_s']:.2f} | {halves} "
            f"| {python_only / w['median_s']:.1f}x faster "
            f"| {'-' if c is None else f'{c:.1f}'} "
            f"| {size.get('downloads_bytes', 0) / 1e6:.0f} "
            f"| {size.get('build_env_bytes', 0) / 1e6:.0f} |"
        )
    lines += [
        "",
        "Cold runs start from an empty project cache (`.cache/`); pip's "
        "own cache and the machine's local torch files are not emptied, so "
        "the build venv's torch came from local disk. A cold run also unpacks "
        "the sdist into `.cache/pristine/`, which warm runs lay `build/tree` "
        'from (docs/build.md, "The cache").',
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
