"""docs/benchmarks/README.md from the JSON reports alone: the summary, one
section per bench, the other reports' sections and the provenance
(``run_all.py`` renders it after a run and with ``--render-only``; its PNG
plots are drawn by the run, ``run_all.make_plots``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import bench_block_pool
import bench_consumer_fleet
import bench_fleet
import bench_hit_lookup
import bench_hit_selection
import bench_live_cost
import bench_scheduler
import benchlib as bl
import fleet_sim_report

# The block-pool time's goal, patched / unpatched (also the plot's line).
RATIO_GOAL = 1.02
# The one timed row whose goal is below 1.00.
GOAL_BELOW_ONE = ("c_duplicates", "logical")
# Issue 21: bytecodes patched / unpatched, per workload and policy ("*": any).
BYTECODE_GOALS = {
    ("a_upstream", "*"): 1.00,
    ("b_churn", "*"): 1.00,
    ("c_duplicates", "logical"): 0.95,
    ("c_duplicates", "last_copy"): 1.00,
    ("c_duplicates", "physical"): 1.02,
}


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def goal_of(workload: str, policy: str) -> tuple[str, Any]:
    if (workload, policy) == GOAL_BELOW_ONE:
        return "< 1.00", lambda r: r < 1.0
    return f"<= {RATIO_GOAL:.2f}", lambda r: r <= RATIO_GOAL


def bytecode_goal(workload: str, policy: str) -> float | None:
    """The goal of a bytecode row; None for building the pools (once per
    pool at start-up), the one row without a goal."""
    if workload == bench_block_pool.POOL_CONSTRUCTION:
        return None
    goal = BYTECODE_GOALS.get((workload, policy))
    return BYTECODE_GOALS[(workload, "*")] if goal is None else goal


def measured_on(res: dict[str, Any]) -> str:
    """`` Measured <date>.`` for a report run on its own, not by this run."""
    if "started" not in res:
        return ""
    quick = " with --quick (smaller workloads)" if res["quick"] else ""
    return f" Measured {res['started']}, on its own{quick}."


def passes_of(bp: dict[str, Any]) -> str:
    args = bp.get("worker_args", [])
    return args[args.index("--passes") + 1] if "--passes" in args else "1"


def block_pool_section(bp: dict[str, Any]) -> list[str]:
    """Section 1: the block pool's timed ratios, their spread, upstream's
    per-call times and the bytecode counts."""
    return [
        *block_pool_ratio_table(bp),
        *block_pool_range_table(bp),
        *upstream_per_call_table(bp),
        *bytecode_table(bp),
    ]


def block_pool_ratio_table(bp: dict[str, Any]) -> list[str]:
    """The section's method and its patched / unpatched ratios."""
    rows = {(r["tree"], r["workload"], r["policy"]): r for r in bp["rows"]}
    out = [
        "## 1. Block-pool hot path, patched / unpatched",
        "",
        (
            f"{bp['repeats']} repeats per tree, workers alternated ABAB (order "
            "flipped every repeat); "
            f"{bp.get('repeats_per_process', 1)} repeat(s) per pair of worker "
            f"processes, {bp.get('process_generations', 1)} pair(s) started in "
            "all. "
            "Times are the median over repeats, in ms (b and c: each repeat's "
            f"figure is the best of {passes_of(bp)} passes in fresh pools). "
            "Same-version spread: the "
            "repeats of each tree split in time order into a first and a second "
            "half; *halves* is the median of each half, *h2/h1* "
            "their ratio, *ratio half 1 / 2* the patched/unpatched ratio from "
            "each half alone." + measured_on(bp)
        ),
        "",
        (
            "| workload | policy | patched ms | unpatched ms | ratio "
            "| ratio half 1 / 2 | goal | met "
            "| patched halves | patched h2/h1 | unpatched halves | unpatched h2/h1 |"
        ),
        "|---|---|---:|---:|---:|---|---|---|---|---:|---|---:|",
    ]
    for r in bp["ratios"]:
        p = rows[("patched", r["workload"], r["policy"])]
        u = next(
            v
            for (t, w, _), v in rows.items()
            if t == "unpatched" and w == r["workload"]
        )
        goal, ok = goal_of(r["workload"], r["policy"])
        out.append(
            f"| {r['workload']} | {r['policy']} | {fmt_ms(r['patched_median_s'])} "
            f"| {fmt_ms(r['unpatched_median_s'])} | {r['ratio']:.3f} "
            f"| {r['ratio_half1']:.3f} / {r['ratio_half2']:.3f} | {goal} "
            f"| {'yes' if ok(r['ratio']) else 'no'} "
            f"| {fmt_ms(p['half1_median_s'])} / {fmt_ms(p['half2_median_s'])} "
            f"| {r['patched_half_ratio']:.3f} "
            f"| {fmt_ms(u['half1_median_s'])} / {fmt_ms(u['half2_median_s'])} "
            f"| {r['unpatched_half_ratio']:.3f} |"
        )
    return out


def block_pool_range_table(bp: dict[str, Any]) -> list[str]:
    """Min, median and max over repeats, per tree and workload."""
    out = [
        "",
        "Min - max over repeats (ms):",
        "",
        "| tree | workload | policy | min | median | max |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in bp["rows"]:
        out.append(
            f"| {r['tree']} | {r['workload']} | {r['policy']} | {fmt_ms(r['min_s'])} "
            f"| {fmt_ms(r['median_s'])} | {fmt_ms(r['max_s'])} |"
        )
    return out


def upstream_per_call_table(bp: dict[str, Any]) -> list[str]:
    """a_upstream per call, as upstream's benchmark prints it."""
    det: dict[str, list[dict[str, float]]] = {}
    for tree, reps in bp["runs"].items():
        det[tree] = [rep["upstream_detail"] for rep in reps]
    out = [
        "",
        (
            "a_upstream per call (median over repeats of the per-repeat averages, "
            "as upstream's benchmark prints them):"
        ),
        "",
        "| tree | get_new_blocks avg us | free_blocks avg us |",
        "|---|---:|---:|",
    ]
    for tree, ds in det.items():
        g = bl.median([d["get_avg_us"] for d in ds])
        f = bl.median([d["free_avg_us"] for d in ds])
        out.append(f"| {tree} | {g:.3f} | {f:.3f} |")
    return out


def bytecode_table(bp: dict[str, Any]) -> list[str]:
    """The bytecode counts against issue 21's goals, and the plot."""
    out = [
        "",
        (
            "Python bytecode instructions executed by one pass of a's "
            "get/free calls (10,000-block pools, 20 rounds per size), by "
            "building those five pools (a_pool_construction: once per pool "
            "at start-up, in no timed call, so without a goal), and by one "
            "pass of b and c (counted under an opcode tracer, identical on "
            "every run: the interpreted work each tree does, not weighed by "
            "cost), with issue 21's goals:"
        ),
        "",
        "| workload | policy | patched | unpatched | ratio | goal | met |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for r in bp["bytecodes"]:
        limit = bytecode_goal(r["workload"], r["policy"])
        goal, met = (
            ("-", "-")
            if limit is None
            else (f"<= {limit:.2f}", "yes" if r["ratio"] <= limit else "no")
        )
        out.append(
            f"| {r['workload']} | {r['policy']} | {r['patched']} "
            f"| {r['unpatched']} | {r['ratio']:.4f} | {goal} | {met} |"
        )
    out += ["", "![block-pool ratios](block_pool_ratios.png)", ""]
    return out


def events_section(ev: dict[str, Any]) -> list[str]:
    out = [
        "## 2. Event volume per workload and policy",
        "",
        (
            "One `KVEventBatch` per drained step, encoded with msgspec's msgpack "
            "encoder as `ZmqEventPublisher` does; *bytes* = topic + 8-byte "
            "sequence + payload per message. *min* = keys appearing / disappearing "
            "in the pool's own index (one store and one removal per key "
            "lifetime). *end mirrors*: stale/missing keys of the set and counting "
            "mirrors against the pool's resident keys after the run."
        ),
        "",
        (
            "| workload | tree | policy | BlockStored ev | stored hashes | min stores "
            "| stored/min | BlockRemoved ev | removed hashes | min removals "
            "| removed/min | messages | bytes | bytes vs logical | end mirrors "
            "set s/m, count s/m |"
        ),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(ev["rows"], key=lambda r: (r["workload"], r["tree"])):
        mc = r["mirror_check_at_end"]
        out.append(
            f"| {r['workload']} | {r['tree']} | {r['policy']} | {r['stored_events']} "
            f"| {r['stored_hashes']} | {r['min_stores']} | {r['stored_vs_min']:.2f} "
            f"| {r['removed_events']} | {r['removed_hashes']} | {r['min_removals']} "
            f"| {r['removed_vs_min']:.2f} | {r['messages']} | {r['frame_bytes']} "
            f"| {r['bytes_vs_logical']:.2f} "
            f"| {mc['set']['stale']}/{mc['set']['missing']}, "
            f"{mc['count']['stale']}/{mc['count']['missing']} |"
        )
    out += ["", "![event volume](events_per_policy.png)", ""]
    return out


def router_runs(rt: dict[str, Any]) -> list[tuple[str, str, str, Any]]:
    """(tree, trace, policy, result) for every router run, trace-major."""
    runs = [
        (tree, trace, policy, r)
        for tree, per_trace in rt["results"].items()
        for trace, per_policy in per_trace.items()
        for policy, r in per_policy.items()
    ]
    return sorted(runs, key=lambda x: x[1])


def router_section(rt: dict[str, Any]) -> list[str]:
    out = [
        "## 3. Router accuracy (real v1 Scheduler, made-up model outputs)",
        "",
        (
            f"{rt['num_requests']} requests per trace, {rt['num_gpu_blocks']} GPU "
            "blocks of 16 tokens. Traces: *chat* (shared system prompts, canned "
            "block-aligned questions repeated exactly, follow-up turns extending "
            "them, random turns) and *families* (random block-aligned prefixes of "
            "6 long prompts: the seed's A = H1..H3 / B = H1..H7 pattern). "
            "*vs engine*: mirror score (capped at num_tokens - 1 like the "
            "engine) against `KVCacheManager.get_computed_blocks`; *vs index*: "
            "uncapped mirror score against the longest prefix in the pool's index. "
            "over/under: requests the mirror scores higher/lower than the engine."
        ),
        "",
        (
            "| trace | tree | policy | mirror | exact vs engine | MAE blocks "
            "| over | under | max err | exact vs index | MAE vs index |"
        ),
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for tree, trace, policy, r in router_runs(rt):
        for mirror in ("set", "count"):
            e = r["scores"][f"{mirror}_vs_engine"]
            i = r["scores"][f"{mirror}_vs_index"]
            out.append(
                f"| {trace} | {tree} | {policy} | {mirror} "
                f"| {pct(e['exact_rate'])} "
                f"| {e['mae_blocks']:.3f} | {e['over']} | {e['under']} "
                f"| {e['max_abs']} | {pct(i['exact_rate'])} "
                f"| {i['mae_blocks']:.3f} |"
            )
    out += [
        "",
        "Trace and event stream per run:",
        "",
        (
            "| trace | tree | policy | max seqs | requests | steps "
            "| requests with a hit | mean hit blocks | stored hashes "
            "| removed hashes | messages | bytes "
            "| events pending at arrival | end: set stale/missing/orphan rm "
            "| end: count stale/missing/orphan rm |"
        ),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for tree, trace, policy, r in router_runs(rt):
        ev = r["events"]
        s, c = r["end_check"]["set"], r["end_check"]["count"]
        out.append(
            f"| {trace} | {tree} | {policy} | {r['max_num_seqs']} "
            f"| {r['requests']} | {r['steps']} "
            f"| {r['requests_with_hit']} | {r['mean_engine_hit_blocks']:.2f} "
            f"| {ev['stored_hashes']} | {ev['removed_hashes']} "
            f"| {ev['messages']} | {ev['frame_bytes']} "
            f"| {r['pending_events_at_arrival']} "
            f"| {s['stale']}/{s['missing']}/{s['orphan_removals']} "
            f"| {c['stale']}/{c['missing']}/{c['orphan_removals']} |"
        )
    out += ["", "![router exact-match rate](router_exact.png)", ""]
    return out


def provenance_lines(
    results: dict[str, Any], digest_before: dict[str, str], digest_after: dict[str, str]
) -> list[str]:
    out = ["## Provenance", ""]
    seen: set[tuple[str, str]] = set()
    for res in results.values():
        for name, info in res["provenance"].items():
            key = (name, info["block_pool_file"])
            if key in seen:
                continue
            seen.add(key)
            out.append(
                f"- {name}: `vllm.v1.core.block_pool` from "
                f"{bl.block_pool_where(name, info)}; Python {info['python']}, "
                "copy_semantics switch: "
                f"{'yes' if info['has_copy_semantics'] else 'no'}; vllm/*.py at "
                f"start: {digest_before[name]}"
                + (
                    ", unchanged at the end"
                    if digest_after[name] == digest_before[name]
                    else f"; CHANGED during the run, at the end: {digest_after[name]}"
                )
            )
    out += [
        "- wall time per bench (block_pool includes the workers' start-up, "
        "vLLM import and warm-up): "
        + ", ".join(f"{k} {v['wall_s']:.0f} s" for k, v in results.items()),
        "",
    ]
    return out


# --------------------------------------------------------------------------
# hit selection and duplicates (docs/architecture.md): its own script, on
# three trees (upstream, the series without 0006, the patched tree); its full
# report is dup_first.md.
# --------------------------------------------------------------------------


def hit_selection_section(hs: dict[str, Any]) -> list[str]:
    out = [
        "## 4. Duplicate copies: upstream, the series without 0006, with 0006",
        "",
        "`bench_hit_selection.py`: medians over seeds; per seed, the event "
        "volume per policy and the spread in [dup_first.md](dup_first.md).",
        "",
        "| trace | tree | hit tokens | blocks computed | mean copies per key |",
        "|---|---|---:|---:|---:|",
    ]
    for trace, per_tree in hs["summary"].items():
        for tree, v in per_tree.items():
            out.append(
                f"| {trace} | {tree} | {v['hit_tokens']['median']:g} "
                f"| {v['blocks_computed']['median']:g} "
                f"| {v['copies_mean']['median']:.3f} |"
            )
    return [*out, ""]


def snapshot_section(sn: dict[str, Any]) -> list[str]:
    """``bench_snapshot.py``'s report (snapshot.json): the record's cost on
    the live publish path per scenario against its goal, its memory, and
    snapshots against held keys."""
    return [
        *snapshot_live_table(sn),
        *record_cost_lines(sn),
        *snapshot_table(sn),
        *snapshot_limit_lines(sn),
        "",
    ]


def snapshot_live_table(sn: dict[str, Any]) -> list[str]:
    """The section's method and the live publish path, record on / off."""
    live, goal = sn["live"], sn["goal_cpu_ratio"]
    any_scenario = next(iter(live.values()))
    out = [
        "## 6. The snapshot record (0008)",
        "",
        f"`bench_snapshot.py`, run {sn['when']} (load average "
        f"{sn['load_average_before'][0]:.1f} before, "
        f"{sn['load_average_after'][0]:.1f} after, on 2 cores): the real "
        f"`ZmqEventPublisher` publishing {any_scenario['batches']:,} batches "
        "as fast as it takes them, with the record on and off, alternated in "
        "one run, to a SUB socket on "
        "127.0.0.1 in another process (a router's side, not counted), after an "
        "untimed fill to the scenario's held keys; medians "
        f"over {len(any_scenario['cpu_seconds']['on'])} repeats. The engine's "
        f"process (the publisher's) runs on core {sn['engine_core']}, the "
        "reader and the record process (nice 10) on core "
        f"{', '.join(map(str, sn['other_cores']))}. "
        "Goal: CPU of "
        f"the engine's process on / off <= {goal:.2f}; the record process's "
        "own CPU is given apart. The spread is "
        "each mode's first half of the repeats over its second.",
        "",
        "| scenario | held keys | batch | measure | record on, µs per batch "
        "| record off | on / off | goal | met | spread (h1/h2) |",
        "|---|---:|---|---|---:|---:|---:|---|---|---|",
    ]
    for name, sc in live.items():
        for kind, label in (("cpu", "process CPU"), ("wall", "wall")):
            per = sc[f"{kind}_us_per_batch"]
            ratio = sc[f"{kind}_ratio_on_over_off"]
            spread = sc[f"{kind}_spread_first_half_over_second"]
            met = ("yes" if ratio <= goal else "no") if kind == "cpu" else "-"
            out.append(
                f"| {name} | {sc['held_keys_at_end']:,} | {sc['events_per_batch']} "
                f"| {label} | {per['on']:.1f} | {per['off']:.1f} | {ratio:.3f} "
                f"| {f'<= {goal:.2f}' if kind == 'cpu' else '-'} | {met} "
                f"| on {spread['on']:.2f}, off {spread['off']:.2f} |"
            )
    return out


def record_cost_lines(sn: dict[str, Any]) -> list[str]:
    """The record process's own CPU and memory, and the publisher thread's
    share of the work."""
    live = sn["live"]
    any_scenario = next(iter(live.values()))

    def per_scenario(key: str) -> str:
        return ", ".join(f"{sc[key]:.1f} µs ({name})" for name, sc in live.items())

    return [
        "",
        "The record process's CPU per batch while it follows the same stream "
        f"(record on): {per_scenario('record_process_cpu_us_per_batch')}; "
        "its decode and `KVEventRecord.apply` alone: "
        f"{per_scenario('apply_cpu_us_per_batch')}.",
        "",
        *record_memory_table(sn),
        "",
        "The publisher thread's own work for the record, alone "
        "(`RecordProcess.put`: the copy into the ring and a share of the "
        "message that announces a chunk; thread CPU, with a record process "
        "following on the other core, medians over "
        f"{len(any_scenario['handoff_cpu_us_samples'])} repeats): "
        + ", ".join(
            f"{sc['handoff_cpu_us_per_batch']:.2f} µs ({name}: "
            f"{sc['handoff_cpu_us_per_batch'] / sc['cpu_us_per_batch']['off']:.1%} "
            "of the record-off process CPU per batch)"
            for name, sc in live.items()
        )
        + ". The live ratio's spread (the table) shows how far this "
        "machine's noise reaches.",
    ]


def snapshot_table(sn: dict[str, Any]) -> list[str]:
    """Snapshots by held keys: request to end, and the live batches' delay."""
    out = [
        "",
        "Snapshots: request to end message at the consumer, and the longest "
        "delay from `publish` to a SUB socket of a live batch published every "
        "millisecond while the snapshot is sent, against as long a span "
        "without one (medians over repeats):",
        "",
        "| held keys | request to end, ms | all repeats, ms "
        "| longest live delay, ms | all repeats, ms | without a snapshot, ms |",
        "|---:|---:|---|---:|---|---:|",
    ]
    for r in sn["snapshot"]:
        out.append(
            f"| {r['held_keys']:,} | {r['request_to_end_ms']:.1f} "
            f"| {', '.join(f'{t:.1f}' for t in r['request_to_end_ms_all'])} "
            f"| {r['live_delay_max_ms']:.1f} "
            f"| {', '.join(f'{t:.1f}' for t in r['live_delay_max_ms_all'])} "
            f"| {r['live_delay_max_without_ms']:.1f} |"
        )
    return out


def snapshot_limit_lines(sn: dict[str, Any]) -> list[str]:
    """The snapshot's growth and the clients the engine does not trust,
    each against its goal."""
    growth = snapshot_growth(sn)
    goal = sn["goal_snapshot_1m_over_100k"]
    clients, held, flood = sn["clients"], sn["held"], sn["flood"]
    return [
        "",
        f"A snapshot of the largest record takes {growth:.1f} times as long as "
        f"one of a tenth of its keys (goal <= {goal}: "
        f"{'met' if growth <= goal else 'not met'}).",
        "",
        "Clients the engine does not trust: "
        f"{clients['clients']} clients that each ask for a snapshot of "
        f"{clients['held_keys']:,} keys and a replay of the whole buffer and "
        "never read (a one-message receive queue, a 4 KiB receive buffer) "
        f"added {clients['added_mib']:.1f} MiB to the engine's process at its "
        f"peak, until they were cut off (goal <= {clients['goal_mib']} MiB: "
        f"{'met' if clients['added_mib'] <= clients['goal_mib'] else 'not met'}). "
        f"{held['clients']} clients that each ask for a replay of "
        f"{held['batches']} batches of {held['batch_mib']:.2f} MiB, never read "
        "and stay connected after they are cut off (unbounded, they could "
        f"hold {held['unbounded_mib']:.0f} MiB) added {held['added_mib']:.1f} "
        f"MiB at its peak over three rounds of cut-offs (bound in total: "
        f"{held['bound_mib']:.0f} MiB). "
        f"A client sending {flood['requests_sent']:,} requests of "
        f"{flood['request_bytes']:,} bytes, the largest the socket accepts, in "
        f"{flood['seconds']:g} s delayed live batches (one a millisecond) "
        f"{flood['live_p99_ms']:.1f} ms at p99 (max {flood['live_max_ms']:.1f} "
        f"ms) against {flood['live_p99_without_ms']:.1f} ms without it "
        f"(goal <= {flood['goal_p99_ms']:g} ms: "
        f"{'met' if flood['live_p99_ms'] <= flood['goal_p99_ms'] else 'not met'}).",
    ]


def rebuild_section(rb: dict[str, Any]) -> list[str]:
    """``bench_rebuild.py``'s report (rebuild.json): what rebuilding a lost
    record from the block pool costs (0011)."""
    cost = rb["announcements"]
    spread = cost["spread_first_half_over_second"]
    per_request_us = (
        (cost["median_s"]["on"] - cost["median_s"]["off"]) / cost["requests"] * 1e6
    )
    out = [
        "### Rebuilding a lost record (0011)",
        "",
        f"`bench_rebuild.py`, run {rb['when']} (load average "
        f"{rb['load_average_before'][0]:.2f} before, "
        f"{rb['load_average_after'][0]:.2f} after). The block pool keeps each "
        "cached key's announcement for it: on the block pool's churn workload "
        f"({cost['requests']:,} requests of 4-32 blocks, a real `BlockPool`, "
        f"events on, {cost['repeats']} repeats ABAB) that takes "
        f"{cost['ratio_on_over_off']:.2f} times as long as without "
        f"({per_request_us:.0f} µs more per request; the same version's "
        f"halves: {spread['off']:.2f} and {spread['on']:.2f}). Only the "
        "block pool's calls are timed here: an engine step also runs the "
        "model, and a request's blocks are cached once.",
        "",
        "| held keys | record killed to snapshots served, s | of which the "
        "wait before the rebuild, s | longest engine-thread pause, ms |",
        "|---|---|---|---|",
    ]
    for r in rb["rebuild"]:
        out.append(
            f"| {r['held_keys']:,} | {r['kill_to_served_s']:.2f} | "
            f"{r['rebuild_delay_s']:g} | {r['longest_serve_ms']:.1f} |"
        )
    return [*out, ""]


def snapshot_growth(sn: dict[str, Any]) -> float:
    """The largest snapshot's time over the time of the one of a tenth of
    its keys (both in the report)."""
    by_keys: dict[int, float] = {
        r["held_keys"]: r["request_to_end_ms"] for r in sn["snapshot"]
    }
    largest = max(by_keys)
    tenth = min(by_keys, key=lambda keys: abs(keys - largest / 10))
    return by_keys[largest] / by_keys[tenth]


def record_memory_table(sn: dict[str, Any]) -> list[str]:
    """The record process's memory per held key, per pattern."""
    goal = sn["goal_bytes_per_key"]
    out = [
        "The record's memory, per held key: a real record process's unique "
        "memory (USS) holding the keys, less a control's fed the same stores "
        "with every block evicted (its one-off cost of decoding them). RSS "
        "also counts the 64 MiB ring the record process shares with the "
        f"engine's, once batches have passed through it. Goal <= {goal} bytes "
        "per key of 16 tokens in every pattern.",
        "",
        "| pattern | stores x blocks | held keys | USS, MiB | control USS, MiB "
        "| bytes per key | goal | RSS, MiB |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for name, m in sn["memory"].items():
        met = "met" if m["bytes_per_key"] <= goal else "not met"
        out.append(
            f"| {name} | {m['stores']:,} x {m['blocks_per_store']} "
            f"| {m['held_keys']:,} | {m['uss_mib']:.1f} "
            f"| {m['control_uss_mib']:.1f} | {m['bytes_per_key']:.0f} | {met} "
            f"| {m['rss_mib']:.0f} |"
        )
    return out


# --------------------------------------------------------------------------
# render: the Markdown from the JSON files alone
# --------------------------------------------------------------------------

REPORT = "README.md"
KV_BENCHES = ("block_pool", "hit_lookup", "events", "router", "scheduler")


def _ratios(rows: list[dict[str, Any]], workload: str, key: str, digits: int) -> str:
    """``policy ratio, ...`` for ``workload``; a workload without events
    (policy ``-``) is its ratio alone."""
    return ", ".join(
        f"{r[key]:.{digits}f}"
        if r["policy"] == "-"
        else f"{r['policy']} {r[key]:.{digits}f}"
        for r in rows
        if r["workload"] == workload
    )


def summary_section(
    results: dict[str, Any],
    build: dict[str, Any] | None,
    snapshot: dict[str, Any] | None,
    fleet: dict[str, Any] | None,
    fleet_sim: dict[str, Any] | None = None,
) -> list[str]:
    """One row per measure, every figure taken from the sections below (or
    build.json, ``bench_build.py``'s report, snapshot.json,
    ``bench_snapshot.py``'s, fleet.json, ``bench_fleet.py``'s, and
    fleet_sim.json, ``bench_fleet_sim.py``'s, when they are there)."""
    rows = [
        *block_pool_rows(results["block_pool"]),
        *scheduler_rows(results["scheduler"]),
        event_row(results["events"]),
        *router_rows(results["router"]),
        bench_live_cost.summary_row(results["live_cost"]),
    ]
    if build is not None:
        rows.append(build_row(build))
    if snapshot is not None:
        rows += snapshot_rows(snapshot)
    if fleet is not None:
        rows.append(bench_fleet.summary_row(fleet))
    if fleet_sim is not None:
        rows += fleet_sim_report.summary_rows(fleet_sim)
    return [
        "## Summary",
        "",
        "Ratios are patched / unpatched medians measured side by side in this "
        "run; the same-version row is how far one tree's first and second "
        "half of the repeats differ, so a timed ratio closer to 1 than that "
        "says nothing. Bytecode counts are exact and the same on every run. "
        "Goals and whether each was met: sections 1, 5 and 6.",
        "",
        "| measure | figure |",
        "|---|---|",
        *(f"| {m} | {v} |" for m, v in rows),
        "",
    ]


def block_pool_rows(bp: dict[str, Any]) -> list[tuple[str, str]]:
    """The block pool's times, their same-version spread and its bytecodes."""
    return [
        (
            "block-pool time, upstream allocate/free (a_upstream), patched / unpatched",
            _ratios(bp["ratios"], "a_upstream", "ratio", 3),
        ),
        (
            "block-pool time, hashed churn with events (b_churn)",
            _ratios(bp["ratios"], "b_churn", "ratio", 3),
        ),
        (
            "block-pool time, duplicate-heavy (c_duplicates)",
            _ratios(bp["ratios"], "c_duplicates", "ratio", 3),
        ),
        (
            "same version run twice (h2/h1 of either tree, every workload)",
            same_version_spread(bp["ratios"]),
        ),
        (
            "bytecode instructions, a_upstream, patched / unpatched (exact)",
            _ratios(bp["bytecodes"], "a_upstream", "ratio", 4),
        ),
        (
            "bytecode instructions, b_churn, patched / unpatched (exact)",
            _ratios(bp["bytecodes"], "b_churn", "ratio", 4),
        ),
        (
            "bytecode instructions, c_duplicates (exact)",
            _ratios(bp["bytecodes"], "c_duplicates", "ratio", 4),
        ),
    ]


def scheduler_rows(sc: dict[str, Any]) -> list[tuple[str, str]]:
    """The scheduler step's time, its same-version spread and its bytecodes."""
    return [
        (
            "scheduler step time (schedule + update_from_output), patched / unpatched",
            _ratios(sc["ratios"], "scheduler_step", "ratio", 3),
        ),
        (
            "scheduler step, same version run twice (h2/h1 of either tree)",
            same_version_spread(sc["ratios"]),
        ),
        (
            "scheduler step, bytecode instructions (exact)",
            _ratios(sc["bytecodes"], "scheduler_step", "ratio", 4),
        ),
    ]


def same_version_spread(ratios: list[dict[str, Any]]) -> str:
    """The range of either tree's h2/h1 (its second half of the repeats
    over its first) over ``ratios``."""
    spread = [
        r[k] for r in ratios for k in ("patched_half_ratio", "unpatched_half_ratio")
    ]
    return f"{min(spread):.3f} to {max(spread):.3f}"


def event_row(ev: dict[str, Any]) -> tuple[str, str]:
    """The duplicate-heavy workload's event bytes per policy."""
    return (
        "event bytes on the wire vs `logical`, c_duplicates",
        ", ".join(
            f"{r['policy']} {r['bytes_vs_logical']:.2f}x"
            for r in ev["rows"]
            if r["workload"] == "c_duplicates" and r["tree"] == "patched"
        ),
    )


def router_rows(rt: dict[str, Any]) -> list[tuple[str, str]]:
    """Each router run's exact-match rates against the engine."""
    rows = []
    for tree, trace, policy, r in router_runs(rt):
        s, c = (r["scores"][f"{m}_vs_engine"]["exact_rate"] for m in ("set", "count"))
        rows.append(
            (
                f"router exact-match vs engine, {trace} trace, {tree} {policy}",
                f"set mirror {pct(s)}, counting mirror {pct(c)}",
            )
        )
    return rows


def build_row(build: dict[str, Any]) -> tuple[str, str]:
    """build.json's warm builds, assemble against python-only."""
    w = build["warm"]
    a, p, f = (w[k] for k in ("assemble", "python-only", "floor"))
    return (
        f"warm build, assemble vs python-only ({build['date']}, [build.md](build.md))",
        f"{a['median_s']:.2f} s (halves {a['median_first_half_s']:.2f} / "
        f"{a['median_second_half_s']:.2f}) vs {p['median_s']:.2f} s "
        f"({p['median_s'] / a['median_s']:.1f}x); floor (copying the "
        f"wheel) {f['median_s']:.2f} s",
    )


def snapshot_rows(snapshot: dict[str, Any]) -> list[tuple[str, str]]:
    """snapshot.json's live cost against its goal, and its largest snapshot."""
    live, goal = snapshot["live"], snapshot["goal_cpu_ratio"]
    largest = snapshot["snapshot"][-1]
    return [
        (
            "snapshot record (0008), live publish path, process CPU on / off "
            f"(section 6; goal <= {goal:.2f})",
            ", ".join(
                f"{name} {sc['cpu_ratio_on_over_off']:.3f} "
                f"({'met' if sc['cpu_ratio_on_over_off'] <= goal else 'not met'})"
                for name, sc in live.items()
            )
            + "; memory "
            + ", ".join(
                f"{m['bytes_per_key']:.0f}" for m in snapshot["memory"].values()
            )
            + " bytes per held key by pattern",
        ),
        (
            f"snapshot of {largest['held_keys']:,} held keys, request to end",
            f"{largest['request_to_end_ms']:.0f} ms; longest live delay "
            f"{largest['live_delay_max_ms']:.1f} ms (without a snapshot "
            f"{largest['live_delay_max_without_ms']:.1f} ms)",
        ),
    ]


def roles(run: dict[str, Any]) -> dict[str, str]:
    """The run's machine paths, each by the name a reader knows it by."""
    return {
        run["trees"]["patched"]: "build/tree",
        run["trees"]["unpatched"]: "$(ci/overlay pristine-tree)",
        run["python"]: "$python",
    }


def trees_line(provenance: dict[str, Any]) -> str:
    """The trees and the workers' Python by role and version."""
    p, u = provenance["patched"], provenance["unpatched"]
    return (
        f"Patched tree: `build/tree` (the series on vLLM {p['vllm_version']}); "
        f"unpatched tree: `ci/overlay pristine-tree` (the vLLM "
        f"{u['vllm_version']} sdist); workers' Python {p['python']} (the test "
        "venv, `PYTHONPATH=ci python3 -m overlay_harness.testenv "
        "dist/vllm-*.whl`)."
    )


def render(out: Path) -> None:
    """``out``'s Markdown from ``out``'s JSON files alone: README.md,
    dup_first.md and hit_lookup.md."""
    data = run_reports(out)
    build = optional_report(out, "build.json")
    # Measured by its own command (bench_snapshot.py), not by this run.
    snapshot = optional_report(out, "snapshot.json")
    # And bench_rebuild.py's.
    rebuild = optional_report(out, "rebuild.json")
    # Measured by its own command too (bench_fleet.py, run on request).
    fleet = optional_report(out, "fleet.json")
    # The simulated fleet (bench_fleet_sim.py, run by ci/bench.sh).
    sim = optional_report(out, fleet_sim_report.REPORT)
    # One router process following a fleet (bench_consumer_fleet.py).
    follow = optional_report(out, bench_consumer_fleet.REPORT)
    run, hits = data["run"], data["dup_first"]
    lines = [
        *readme_head(data, sim),
        *summary_section(data, build, snapshot, fleet, sim),
        *block_pool_section(data["block_pool"]),
        *bench_scheduler.report_lines(data["scheduler"]),
        *bench_hit_lookup.report_lines(data["hit_lookup"]),
        *events_section(data["events"]),
        *router_section(data["router"]),
        *hit_selection_section(hits),
        *bench_live_cost.report_lines(data["live_cost"]),
        *(snapshot_section(snapshot) if snapshot is not None else []),
        *(rebuild_section(rebuild) if rebuild is not None else []),
        *(bench_fleet.report_lines(fleet) if fleet is not None else []),
        *(fleet_sim_report.report_lines(sim) if sim is not None else []),
        *(bench_consumer_fleet.report_lines(follow) if follow is not None else []),
        *provenance_lines(
            {k: data[k] for k in KV_BENCHES},
            run["tree_digest_start"],
            run["tree_digest_end"],
        ),
        "Plots: " + ", ".join(run["plots"]),
        "",
    ]
    # Written once every report has rendered, so a bad one changes nothing.
    bench_hit_selection.write_markdown(hits, out)
    bench_hit_lookup.write_markdown(data["hit_lookup"], out)
    (out / REPORT).write_text("\n".join(lines))


def run_reports(out: Path) -> dict[str, Any]:
    """The reports ``run_all.py`` writes, each one required."""
    data: dict[str, Any] = {}
    for name in (*KV_BENCHES, "dup_first", "live_cost", "run"):
        path = out / f"{name}.json"
        if not path.is_file():
            raise SystemExit(f"{path}: missing; run the benchmarks into {out} first")
        data[name] = json.loads(path.read_text())
    return data


def optional_report(out: Path, name: str) -> dict[str, Any] | None:
    """``out``/``name`` where it is there: a report of another command."""
    path = out / name
    report: dict[str, Any] | None = (
        json.loads(path.read_text()) if path.is_file() else None
    )
    return report


def readme_head(data: dict[str, Any], sim: dict[str, Any] | None) -> list[str]:
    """The README's title, what it links to, the fleet's first screen, the
    method, the run and its command."""
    run = data["run"]
    return [
        "# KV-event benchmarks" + (" (quick smoke run)" if run["quick"] else ""),
        "",
        "Generated by `ci/bench.sh` (`ci/bench/run_all.py`) from the JSON "
        "reports in this folder; edit nothing here by hand. Re-render "
        "without measuring: `python3 ci/bench/run_all.py --render-only --out "
        "docs/benchmarks`. Other reports: [dup_first.md](dup_first.md) "
        "(duplicates leave first, hit selection), [hit_lookup.md]"
        "(hit_lookup.md), [build.md](build.md) (build routes), "
        "[live_router.md](live_router.md) (a real CPU server), "
        "[../mutation.md](../mutation.md) (the mutation suite).",
        "",
        *(fleet_sim_report.first_screen(sim) if sim is not None else []),
        "Method: every figure is a median over repeats with the spread of the "
        "same version run twice (first and second half of the repeats); no "
        "timing is asserted in any test. The block-pool workers turn on "
        "vLLM's envs cache as `EngineCore` does once it has started (without "
        "it every event hash pays an `os.environ` lookup no running engine "
        "pays). Where the same version's halves move more than the overhead "
        "being measured, the Python bytecode instructions each tree executes "
        "(under an opcode tracer) are the exact figure for the interpreted "
        "work the patches add, though not weighed by cost.",
        "",
        (
            f"Run {run['started']} UTC, {run['elapsed_s']:.0f} s, "
            f"{data['block_pool']['repeats']} repeats (block pool), machine "
            f"{run['machine_start']}; at the end: {run['machine_end']}."
        ),
        "",
        trees_line(data["block_pool"]["provenance"]),
        "",
        f"Command: `{bl.role_command(run['command'], roles(run))}`",
        "",
    ]
