"""The simulated fleet's report: its section of docs/benchmarks/README.md,
the first screen above it, its summary rows and the README's one-sentence
headline, all from ``fleet_sim.json`` alone (``bench_fleet_sim.py`` measures
it; ``run_all.py --render-only`` renders it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import benchlib as bl

# The names the report's rows carry; the driver (bench_fleet_sim.py) builds
# its matrix from them.
ROUTINGS = ("longest", "dynamo")
UPSTREAM_RECOVERY = ("ignore", "relearn", "reset")
OURS = "logical"
SECTION = "8. Fleet at scale: a simulated fleet of real Schedulers"
ANCHOR = "#8-fleet-at-scale-a-simulated-fleet-of-real-schedulers"
CHAT = ("chat-0.25", "chat-0.5", "chat-0.75")
# The report's file, beside the README it renders into.
REPORT = "fleet_sim.json"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _sp(v: dict[str, float], fmt: Callable[[float], str] = _pct) -> str:
    """A median and its min - max over seeds."""
    if v["min"] == v["max"]:
        return fmt(v["median"])
    return f"{fmt(v['median'])} ({fmt(v['min'])} to {fmt(v['max'])})"


def _num(x: float) -> str:
    return f"{x:,.0f}"


def _steps(x: float) -> str:
    return f"{x:.2f}"


class Rows:
    """The report's rows, looked up by their configuration."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.fleet = {
            (r["workload"], r["engines"], r["stream"], r["index"], r["routing"]): r
            for r in report["fleet"]
        }
        self.gap = {
            (r["workload"], r["stream"], r["index"], r["recovery"]): r
            for r in report["gap"]
        }
        self.streams = sorted(
            {r["stream"] for r in report["fleet"]}, key=lambda s: (s != bl.UPSTREAM, s)
        )
        plan = report["plan"]
        self.workloads: list[str] = plan["workloads"]
        self.fleets: list[int] = plan["fleets"]

    def get(
        self, workload: str, n: int, stream: str, index: str, routing: str = "longest"
    ) -> dict[str, Any]:
        row: dict[str, Any] = self.fleet[(workload, n, stream, index, routing)]
        return row

    def over(
        self, workloads: Sequence[str], stream: str, index: str, metric: str, which: str
    ) -> list[float]:
        """``which`` (min, median, max) of ``metric`` over workloads, fleets
        and routings."""
        return [
            self.fleet[(w, n, stream, index, rt)][metric][which]
            for w in workloads
            for n in self.fleets
            for rt in ROUTINGS
            if (w, n, stream, index, rt) in self.fleet
        ]


def _range_pct(xs: Sequence[float]) -> str:
    if not xs:
        return "not run"
    lo, hi = min(xs), max(xs)
    return f"{100 * lo:.1f} %" if lo == hi else f"{100 * lo:.1f}-{100 * hi:.1f} %"


def _range_num(xs: Sequence[float]) -> str:
    if not xs:
        return "not run"
    lo, hi = min(xs), max(xs)
    return f"{lo:,.0f}" if lo == hi else f"{lo:,.0f}-{hi:,.0f}"


def _points(report: dict[str, Any], workloads: Sequence[str], index: str) -> str:
    xs = [
        r["hit_points"][k]
        for r in report["vs_upstream"]
        if r["workload"] in workloads and r["index"] == index and r["stream"] == OURS
        for k in ("min", "max")
    ]
    if not xs:
        return "not run"
    return f"{min(xs):+.1f} to {max(xs):+.1f} points"


def _gap_after(
    rows: Rows, workload: str, stream: str, index: str, recovery: str, metric: str
) -> dict[str, float]:
    v: dict[str, float] = rows.gap[(workload, stream, index, recovery)][metric]
    return v


def headline(report: dict[str, Any]) -> str:
    """The one-sentence claim, quoted verbatim in the project README."""
    rows = Rows(report)
    up, chat = bl.UPSTREAM, [w for w in CHAT if w in rows.workloads]
    gw = report["plan"]["gap_workloads"][0]

    def gap(stream: str, index: str, recovery: str) -> tuple[str, str]:
        row = rows.gap[(gw, stream, index, recovery)]
        return _pct(row["exact"]["median"]), _pct(row["hit_ratio"]["median"])

    ignore, relearn, reset = (gap(up, "counting", r) for r in UPSTREAM_RECOVERY)
    ours = gap(OURS, "consumer", "snapshot")
    moon = [w for w in ("conversation",) if w in rows.workloads]
    moon_text = (
        "; on the Mooncake conversation trace the two streams' hit ratios "
        f"differ by {_points(report, moon, 'set')}"
        if moon
        else ""
    )
    return (
        f"In a simulated fleet of {' and '.join(map(str, rows.fleets))} real vLLM "
        "schedulers behind Dynamo's RadixTree used as a set, the official stream "
        "predicted the chosen engine's cached prefix exactly on "
        f"{_range_pct(rows.over(chat, up, 'set', 'exact', 'median'))} of chat "
        "requests with repeated block-aligned openers, by configuration (the "
        "tree rejecting "
        f"{_range_num(rows.over(chat, up, 'set', 'tree_rejections', 'median'))} "
        "events a run), ours on "
        f"{_range_pct(rows.over(chat, OURS, 'set', 'exact', 'median'))} with "
        f"{_range_num(rows.over(chat, OURS, 'set', 'tree_rejections', 'median'))}; "
        "behind a counting filter both are exact; ours minus the official "
        f"hit ratio: {_points(report, chat, 'set')}{moon_text}. After a missed "
        f"burst longer than the replay buffer ({gw}), a counting router on the "
        f"official stream that goes on was exact on {ignore[0]} % of the "
        f"following requests at {ignore[1]} % hit ratio; dropping its keys to "
        f"relearn gave {relearn[0]} % exact at {relearn[1]} %, resetting the "
        f"engines' caches {reset[0]} % at {reset[1]} %; ours, restarted with the "
        "shipped "
        f"consumer, recovered by snapshot: exact on {ours[0]} % at {ours[1]} % "
        f"(medians over {len(report['plan']['seeds'])} seeds, {report['started']} "
        "UTC)."
    )


def first_screen(report: dict[str, Any]) -> list[str]:
    """The top of docs/benchmarks: which router you run, what the fork
    gives it."""
    rows = Rows(report)
    up, chat = bl.UPSTREAM, [w for w in CHAT if w in rows.workloads]
    moon = [w for w in ("conversation", "synthetic") if w in rows.workloads]
    gw = report["plan"]["gap_workloads"][0]

    def exact(stream: str, index: str, ws: Sequence[str]) -> str:
        return _range_pct(rows.over(ws, stream, index, "exact", "median"))

    def after(stream: str, index: str, recovery: str) -> str:
        e = _gap_after(rows, gw, stream, index, recovery, "exact")
        h = _gap_after(rows, gw, stream, index, recovery, "hit_ratio")
        return f"{recovery}: exact {_pct(e['median'])} %, hit {_pct(h['median'])} %"

    wire = [
        rows.get(w, n, s, "oracle")["wire_bytes_per_request"]["median"]
        for w in chat
        for n in rows.fleets
        for s in (up, OURS)
    ]
    ratio = [wire[k] / wire[k + 1] for k in range(0, len(wire), 2)]
    return [
        "## What the fork gives your router",
        "",
        (
            f"From [section {SECTION.split('.')[0]}]({ANCHOR}) (a simulated fleet "
            f"of {' and '.join(map(str, rows.fleets))} real vLLM schedulers "
            "under cache pressure; medians over seeds, the range across "
            "workloads, fleet sizes and routing policies). Official: the "
            "unpatched stream; ours: `copy_semantics` `logical`. Exact: the "
            "router's predicted prefix on the engine it picks equals what that "
            "engine holds."
        ),
        "",
        "| your router's index | chat with repeated openers, official / ours "
        f"| Mooncake traces, official / ours | after a missed burst ({gw}), "
        "official / ours |",
        "|---|---|---|---|",
        (
            "| set: a store inserts, a removal deletes (AIBrix-style; Dynamo's "
            f"RadixTree fed raw) | exact {exact(up, 'set', chat)} / "
            f"{exact(OURS, 'set', chat)}; hit ratio {_points(report, chat, 'set')} "
            f"| exact {exact(up, 'set', moon)} / {exact(OURS, 'set', moon)}; "
            f"hit ratio {_points(report, moon, 'set')} "
            f"| {after(up, 'set', 'ignore')}; {after(up, 'set', 'relearn')}; "
            f"{after(up, 'set', 'reset')} / {after(OURS, 'consumer', 'snapshot')} |"
        ),
        (
            "| counting filter (Dynamo, llm-d) "
            f"| exact {exact(up, 'counting', chat)} / "
            f"{exact(OURS, 'counting', chat)}: no gain "
            f"| exact {exact(up, 'counting', moon)} / "
            f"{exact(OURS, 'counting', moon)}: no gain "
            f"| {after(up, 'counting', 'ignore')}; "
            f"{after(up, 'counting', 'relearn')}; {after(up, 'counting', 'reset')} "
            f"/ {after(OURS, 'consumer', 'snapshot')} |"
        ),
        (
            "| none (round-robin) | nothing to gain | nothing to gain "
            "| nothing to gain |"
        ),
        "",
        (
            "Event bytes on the wire per request, chat workloads, official / "
            f"ours: {min(ratio):.2f}-{max(ratio):.2f}x. Where the fork does not "
            "matter: a counting filter on a gapless stream, and traffic that "
            "rarely repeats a block-aligned prompt (the Mooncake traces). What "
            "it gives every router: the exact view back after a gap or a "
            "restart, by snapshot."
        ),
        "",
    ]


def report_lines(report: dict[str, Any]) -> list[str]:
    """The simulated fleet's section of docs/benchmarks/README.md."""
    rows = Rows(report)
    return [
        *_introduction(report),
        *_prediction_table(rows),
        *_against_upstream_table(report, rows),
        *_wire_table(rows),
        *_gap_table(report),
        "",
    ]


def _method(r: dict[str, Any]) -> str:
    """What was simulated, on which trees, and the run's machine."""
    plan = r["plan"]
    stats = ", ".join(
        f"{w} {_pct(v['repeated_prompts'])} % repeats, "
        f"{_pct(v['block_aligned'])} % block-aligned"
        for w, v in r["workload_stats"].items()
    )
    return (
        "`ci/bench/bench_fleet_sim.py` (see its docstring): "
        f"{' and '.join(map(str, plan['fleets']))} real vLLM `Scheduler`s "
        f"of {plan['kv_blocks_per_engine']} KV blocks of "
        f"{plan['block_size']} tokens, {plan['max_num_seqs']} sequences and "
        f"{plan['max_num_batched_tokens']} prompt tokens a step, made-up "
        "model outputs, stepped in lockstep; "
        f"{plan['load_per_engine_per_tick']} arrivals per engine per step; "
        f"prompts at most {plan['max_prompt_blocks']} blocks. Indexes: "
        f"Dynamo's `RadixTree` ({r['dynamo']}) as a set and behind a "
        "counting filter, the pools themselves (oracle), or none "
        "(round-robin). Routing: longest predicted prefix, or Dynamo's "
        "cost (blocks to prefill plus active blocks). "
        f"{plan['requests']} requests a run, seeds "
        f"{', '.join(map(str, plan['seeds']))} (a chat seed draws its own "
        "conversations; a Mooncake seed takes the next window of the "
        "trace). Share of requests repeating an earlier prompt exactly, "
        f"and block-aligned (seed {plan['seeds'][0]}): {stats}. Trees: "
        "`build/tree` (ours: the series on vLLM "
        f"{r['provenance']['patched']['vllm_version']}, each `copy_semantics` "
        "policy) and `ci/overlay pristine-tree` (official: the vLLM "
        f"{r['provenance']['unpatched']['vllm_version']} sdist), each in its "
        "own worker processes "
        f"({', '.join(f'{k} {v}' for k, v in r['workers'].items())}) on "
        f"Python {r['provenance']['patched']['python']} (the test venv with "
        f"{r['dynamo']} layered over it). "
        f"Run {r['started']} UTC, {r['wall_s']:.0f} s on {r['cpus']} CPUs, "
        f"load average {r['load_average_start']:.1f} at the start and "
        f"{r['load_average_end']:.1f} at the end (other work on the "
        f"machine); the workers' CPU time {r['cpu_s']:.0f} s, "
        f"{r['cpu_s'] / r['cpus']:.0f} s on {r['cpus']} idle cores."
    )


def _introduction(r: dict[str, Any]) -> list[str]:
    """The section's title, method, headline and how to read it."""
    return [
        f"## {SECTION}" + (" (quick smoke run)" if r["quick"] else ""),
        "",
        _method(r),
        "",
        headline(r),
        "",
        (
            "Where a counting index is exact on both streams, a difference in "
            "hit ratio is the engine's, not the stream's: the series also "
            "changes which copy of a block the pool evicts first "
            "([dup_first.md](dup_first.md)). The policy `physical` announces "
            "every copy, as upstream does, for counting routers: a set index "
            "on it is wrong the way it is on upstream's stream."
        ),
        "",
        (
            "The two-server live benchmark (section 7, `ci/bench/bench_fleet.py`) "
            "stays, run on request and no longer by `ci/bench.sh`: it is the "
            "one measure with real API servers, real HTTP and wall-clock time "
            "to first token, and it checks this benchmark's glue "
            "(`DynamoFeed`) on a live ZMQ stream decoded with the served "
            "schema; but at two engines it cannot tell the wheels apart, the "
            "live tests (`tests/test_cpu_server*.py`) already cover the "
            "server's stream, and it takes about 23 minutes."
        ),
        "",
    ]


def _prediction_table(rows: Rows) -> list[str]:
    """Prediction and routing, one row per configuration and stream."""
    lines = [
        "### Prediction and routing",
        "",
        (
            "Per configuration, medians over seeds (min-max). Exact %: requests "
            "whose predicted prefix on the engine the index picks equals the "
            "pool's (the oracle's), scored for every index in every run; the "
            "row's own index routes. Rejections: events Dynamo's tree refused "
            "(a removal of a block it does not hold, a store under an unknown "
            "parent), per run. Same as oracle %: decisions equal to the "
            "oracle's under the same routing policy. Hit %: prompt tokens "
            "served from cache (the engines' own `num_cached_tokens`); TTFT: "
            "mean steps from arrival to first token. Tokens computed: prompt "
            "tokens not served from cache when the request was first "
            "scheduled (a preempted request's recomputation not counted). "
            "The simulation is deterministic: the same seeds give the same "
            "figures on every run, so a range is the seeds' (the workload's "
            "draws), not noise."
        ),
        "",
        "| workload | engines | routing | stream | set exact % | set rejections "
        "| counting exact % | set same as oracle % | counting same as oracle % "
        "| hit % set | hit % counting | hit % oracle | hit % round-robin "
        "| tokens computed, set | TTFT set | TTFT oracle |",
        "|---|---:|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in rows.workloads:
        for n in rows.fleets:
            for rt in ROUTINGS:
                for s in rows.streams:
                    lines.append(_prediction_row(rows, w, n, rt, s))
    return lines


def _prediction_row(rows: Rows, w: str, n: int, rt: str, s: str) -> str:
    """One configuration's row of the prediction table."""
    st, co = (
        rows.get(w, n, s, "set", rt),
        rows.get(w, n, s, "counting", rt),
    )
    orc, rr = (
        rows.get(w, n, s, "oracle", rt),
        rows.get(w, n, s, "round-robin", "-"),
    )
    return (
        f"| {w} | {n} | {rt} | {s} | {_sp(st['exact'])} "
        f"| {_sp(st['tree_rejections'], _num)} | {_sp(co['exact'])} "
        f"| {_sp(st['agree_with_oracle'])} "
        f"| {_sp(co['agree_with_oracle'])} | {_sp(st['hit_ratio'])} "
        f"| {_sp(co['hit_ratio'])} | {_sp(orc['hit_ratio'])} "
        f"| {_sp(rr['hit_ratio'])} "
        f"| {_sp(st['tokens_computed'], _num)} "
        f"| {_sp(st['ttft_steps_mean'], _steps)} "
        f"| {_sp(orc['ttft_steps_mean'], _steps)} |"
    )


def _against_upstream_table(r: dict[str, Any], rows: Rows) -> list[str]:
    """Ours against the official stream, the set and counting indexes."""
    lines = [
        "",
        "### Ours against the official stream, seed by seed",
        "",
        (
            "The same workload window, fleet and router on each stream: "
            "hit-ratio points (ours minus official) and the change in tokens "
            "computed, medians over seeds (min-max)."
        ),
        "",
        "| workload | engines | index | routing | policy | hit points "
        "| tokens computed |",
        "|---|---:|---|---|---|---|---|",
    ]
    for v in sorted(
        r["vs_upstream"],
        key=lambda v: (
            rows.workloads.index(v["workload"]),
            v["engines"],
            v["index"],
            v["routing"],
            v["stream"],
        ),
    ):
        if v["index"] not in ("set", "counting"):
            continue
        lines.append(
            f"| {v['workload']} | {v['engines']} | {v['index']} | {v['routing']} "
            f"| {v['stream']} | {_sp(v['hit_points'], lambda x: f'{x:+.2f}')} "
            f"| {_sp(v['tokens_computed_change'], lambda x: f'{100 * x:+.1f} %')} |"
        )
    return lines


def _wire_table(rows: Rows) -> list[str]:
    """Event bytes and events per request, per stream."""
    lines = [
        "",
        "### Event volume on the wire",
        "",
        (
            "Bytes per request as `ZmqEventPublisher` frames them (topic, "
            "sequence number, msgpack batch), and events per request, from the "
            "oracle-routed runs (the same routing information on every "
            "stream), longest-prefix routing; medians over seeds."
        ),
        "",
        "| workload | engines | "
        + " | ".join(f"{s} bytes | {s} events" for s in rows.streams)
        + " |",
        "|---|---:|" + "---:|---:|" * len(rows.streams),
    ]
    for w in rows.workloads:
        for n in rows.fleets:
            cells = []
            for s in rows.streams:
                o = rows.get(w, n, s, "oracle")
                cells += [
                    _num(o["wire_bytes_per_request"]["median"]),
                    f"{o['events_per_request']['median']:.2f}",
                ]
            lines.append(f"| {w} | {n} | " + " | ".join(cells) + " |")
    return lines


def _gap_table(r: dict[str, Any]) -> list[str]:
    """A missed burst: each recovery after the gap."""
    plan = r["plan"]
    lines = [
        "",
        "### A missed burst longer than the replay buffer",
        "",
        (
            f"{plan['gap_engines']} engines, longest-prefix routing. A third "
            f"into the trace the router misses every batch for "
            f"{plan['gap_ticks']} steps (the publishers buffer "
            f"{plan['buffer_steps']}); it routes on its stale view meanwhile. "
            "Then, on the official stream: `ignore` (go on), `relearn` (drop "
            "every engine's keys, learn from the next events) or `reset` "
            "(reset every engine's prefix cache, then relearn); on ours: the "
            "router restarts with the shipped consumer "
            "(`kv_events_consumer.Follower`) on each engine's real "
            "`ZmqEventPublisher` on 127.0.0.1, which recovers by snapshot. "
            "Figures over the requests that arrive after the gap; exact before: "
            "the requests before it; batches missed: per engine, over seeds "
            "(an engine idle through the gap publishes none); snapshots: "
            "the restarted consumers' recoveries, summed over seeds. A "
            "relearning router never learns a block that stays cached, as it "
            "is never stored again: every request of the Mooncake conversation "
            "trace opens with the same block, so it under-predicts them all."
        ),
        "",
        "| workload | stream | index | recovery | exact % before | exact % after "
        "| same as oracle % after | hit % after | tokens computed after "
        "| TTFT after | batches missed per engine | snapshots |",
        "|---|---|---|---|---|---|---|---|---|---|---|---:|",
    ]
    for g in r["gap"]:
        lines.append(
            f"| {g['workload']} | {g['stream']} | {g['index']} | {g['recovery']} "
            f"| {_sp(g['exact_before_gap'])} | {_sp(g['exact'])} "
            f"| {_sp(g['agree_with_oracle'])} | {_sp(g['hit_ratio'])} "
            f"| {_sp(g['tokens_computed'], _num)} "
            f"| {_sp(g['ttft_steps_mean'], _steps)} "
            f"| {g['missed_batches']['min']}-{g['missed_batches']['max']} "
            f"| {g['snapshots']} |"
        )
    return lines


def summary_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The simulated fleet's rows in the benchmark summary."""
    rows = Rows(report)
    up, chat = bl.UPSTREAM, [w for w in CHAT if w in rows.workloads]
    gw = report["plan"]["gap_workloads"][0]
    link = f"([section {SECTION.split('.')[0]}]({ANCHOR}))"
    ignore = _gap_after(rows, gw, up, "counting", "ignore", "exact")
    ours = _gap_after(rows, gw, OURS, "consumer", "snapshot", "exact")
    return [
        (
            f"simulated fleet, set index exact on chat, official / ours {link}",
            f"{_range_pct(rows.over(chat, up, 'set', 'exact', 'median'))} / "
            f"{_range_pct(rows.over(chat, OURS, 'set', 'exact', 'median'))}",
        ),
        (
            "simulated fleet, hit ratio, ours - official, set index",
            f"chat {_points(report, chat, 'set')}",
        ),
        (
            f"simulated fleet, after a missed burst ({gw}), counting index exact",
            f"official (ignore) {_pct(ignore['median'])} %, ours (snapshot) "
            f"{_pct(ours['median'])} %",
        ),
        (
            "simulated fleet, full matrix",
            f"{report['wall_s']:.0f} s wall on {report['cpus']} CPUs (load "
            f"average {report['load_average_end']:.1f} at the end); workers' "
            f"CPU {report['cpu_s']:.0f} s",
        ),
    ]
