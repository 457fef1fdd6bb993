"""Prefix-cache hit look-up time against the number of copies of one key.

``BlockPool.get_cached_block`` on a key that ``N`` physical blocks hold
(N = 1, 8, 64, 1024, 8192), patched against unpatched vLLM, each tree in its
own worker process (``benchlib``), in one run.  Copies pile up this way in
a real engine whenever a block-aligned prompt repeats: its last block is
recomputed each time and cached as one more copy of the same key.

Two states of the key, since 0004 picks a copy by whether it is in use:

none_in_use   every copy free (in the free queue); both trees return the
              first copy inserted.
last_in_use   only the copy inserted last is referenced (ref_cnt 1); the
              patched tree returns it, the unpatched one the first copy.

The pool is built once per (N, state) in each worker, outside the timed
region; a repeat's figure per case is the best of ``PASSES`` runs of
``LOOKUPS`` look-ups in a row, reported per look-up.  Protocol as
``bench_block_pool``: repeats alternate the trees ABAB (order flipped every
repeat); figures are medians over repeats, with
the same-version spread (the median of each time-ordered half of a tree's
repeats, and the patched/unpatched ratio from each half alone).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import benchlib as bl

COPIES = (1, 8, 64, 1024, 8192)
STATES = ("none_in_use", "last_in_use")
LOOKUPS = 4000
# Each repeat's figure per case is the best of this many runs of LOOKUPS.
PASSES = 5


# --------------------------------------------------------------------------
# worker
# --------------------------------------------------------------------------


def pool_with_copies(num_copies: int, state: str, hasher: Any) -> tuple[Any, Any]:
    """A pool whose only cached key has ``num_copies`` blocks, and that key's
    block hash.  Each copy is cached through ``cache_full_blocks`` as the
    manager caches a recomputed block."""
    pool = bl.make_pool(num_copies + 1, events=False, policy=None)
    req = bl.make_request("r", range(1000, 1000 + bl.BLOCK_SIZE), hasher)
    blocks = pool.get_new_blocks(num_copies)
    for block in blocks:
        pool.cache_full_blocks(req, [block], 0, 1, bl.BLOCK_SIZE, 0)
    kept = blocks[-1:] if state == "last_in_use" else []
    pool.free_blocks(blocks[: num_copies - len(kept)])
    return pool, req.block_hashes[0]


class HitLookupWorker:
    def __init__(self, copies: list[int], lookups: int) -> None:
        hasher = bl.make_hasher()
        self.lookups = lookups
        self.cases = {
            (n, state): pool_with_copies(n, state, hasher)
            for n in copies
            for state in STATES
        }
        for pool, block_hash in self.cases.values():
            got = pool.get_cached_block(block_hash, [0])
            assert got is not None, "the key must hit"
            self.time_case(pool, block_hash, 10)

    @staticmethod
    def time_case(pool: Any, block_hash: Any, lookups: int) -> float:
        """Seconds per look-up: the best of ``PASSES`` runs of ``lookups``
        look-ups in a row (damps interruptions by other jobs)."""
        get = pool.get_cached_block
        groups = [0]
        best = float("inf")
        for _ in range(PASSES):
            t0 = time.perf_counter()
            for _ in range(lookups):
                get(block_hash, groups)
            best = min(best, time.perf_counter() - t0)
        return best / lookups

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        times = {}
        for (n, state), (pool, block_hash) in self.cases.items():
            times[f"{n}/{state}"] = self.time_case(pool, block_hash, self.lookups)
        picked_in_use = {
            f"{n}/{state}": pool.get_cached_block(block_hash, [0])[0].ref_cnt > 0
            for (n, state), (pool, block_hash) in self.cases.items()
        }
        return {
            "repeat": command["repeat"],
            "times": times,
            "picked_in_use": picked_in_use,
        }


def make_handler(argv: list[str]) -> Any:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree")
    ap.add_argument("--copies", type=int, nargs="+", required=True)
    ap.add_argument("--lookups", type=int, required=True)
    a = ap.parse_args(argv)
    return HitLookupWorker(a.copies, a.lookups).handle


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (copies, state): medians, halves and ratios."""
    rows = []
    for case in runs["patched"][0]["times"]:
        n, state = case.split("/")
        stats: dict[str, dict[str, Any]] = {}
        for tree, reps in runs.items():
            xs = [rep["times"][case] for rep in reps]
            h = len(xs) // 2
            stats[tree] = {
                "median_s": bl.median(xs),
                "half1_median_s": bl.median(xs[:h] or xs),
                "half2_median_s": bl.median(xs[h:]),
                "all_s": xs,
            }
        p, u = stats["patched"], stats["unpatched"]
        rows.append(
            {
                "copies": int(n),
                "state": state,
                "patched": p,
                "unpatched": u,
                "ratio": p["median_s"] / u["median_s"],
                "ratio_half1": p["half1_median_s"] / u["half1_median_s"],
                "ratio_half2": p["half2_median_s"] / u["half2_median_s"],
                "patched_half_ratio": p["half2_median_s"] / p["half1_median_s"],
                "unpatched_half_ratio": u["half2_median_s"] / u["half1_median_s"],
                "picked_in_use": {
                    tree: reps[-1]["picked_in_use"][case] for tree, reps in runs.items()
                },
            }
        )
    return sorted(rows, key=lambda r: (r["state"], r["copies"]))


def drive(
    python: str,
    patched: Path,
    unpatched: Path,
    repeats: int,
    quick: bool,
    log: Any = sys.stderr,
    shared: dict[str, bl.Worker] | None = None,
) -> dict[str, Any]:
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, not {repeats}")
    lookups = 200 if quick else LOOKUPS
    args = ["--copies", *map(str, COPIES), "--lookups", str(lookups)]
    trees = {"patched": patched, "unpatched": unpatched}
    t0 = time.time()
    started = f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M}"
    session = bl.Session(
        "hit_lookup", python, Path(__file__).resolve(), trees, args, shared
    )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    try:
        for rep in range(repeats):
            order = (
                ["patched", "unpatched"] if rep % 2 == 0 else ["unpatched", "patched"]
            )
            for name in order:
                runs[name].append(session.call(name, {"cmd": "run", "repeat": rep}))
            print(f"[hit_lookup] repeat {rep + 1}/{repeats} done", file=log, flush=True)
    finally:
        session.close()
    return {
        "bench": "hit_lookup",
        "started": started,
        "machine": (
            f"{platform.node()}, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}"
        ),
        "repeats": repeats,
        "quick": quick,
        "lookups_per_sample": lookups,
        "worker_args": args,
        "trees": {k: str(v) for k, v in trees.items()},
        "provenance": session.infos,
        "wall_s": time.time() - t0,
        "runs": runs,
        "rows": summarize(runs),
    }


def report_lines(res: dict[str, Any]) -> list[str]:
    """The Markdown section (``run_all.py`` puts it in both reports)."""
    out = [
        "## Hit look-up time against copies of one key, patched / unpatched",
        "",
        (
            f"`BlockPool.get_cached_block` on a key held by N blocks; "
            f"{res['repeats']} repeats per tree, alternated; each repeat's "
            f"figure is the best of {PASSES} runs of {res['lookups_per_sample']} "
            "look-ups in a row; medians over repeats, in us per look-up. "
            "*halves*: the "
            "median of the first and second half of a tree's repeats (the "
            "same-version spread); *in use*: whether the copy returned is "
            "referenced."
        ),
        "",
        (
            "| state | copies | patched us | unpatched us | ratio "
            "| ratio half 1 / 2 | patched halves | unpatched halves "
            "| in use (p / u) |"
        ),
        "|---|---:|---:|---:|---:|---|---|---|---|",
    ]
    for r in res["rows"]:
        p, u = r["patched"], r["unpatched"]
        out.append(
            f"| {r['state']} | {r['copies']} | {p['median_s'] * 1e6:.3f} "
            f"| {u['median_s'] * 1e6:.3f} | {r['ratio']:.3f} "
            f"| {r['ratio_half1']:.3f} / {r['ratio_half2']:.3f} "
            f"| {p['half1_median_s'] * 1e6:.3f} / {p['half2_median_s'] * 1e6:.3f} "
            f"| {u['half1_median_s'] * 1e6:.3f} / {u['half2_median_s'] * 1e6:.3f} "
            f"| {'yes' if r['picked_in_use']['patched'] else 'no'} / "
            f"{'yes' if r['picked_in_use']['unpatched'] else 'no'} |"
        )
    out.append("")
    return out


def write_report(res: dict[str, Any], out: Path) -> None:
    """``out``/hit_lookup.json and ``out``/hit_lookup.md."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "hit_lookup.json").write_text(json.dumps(res, indent=1))
    write_markdown(res, out)


def write_markdown(res: dict[str, Any], out: Path) -> None:
    """``out``/hit_lookup.md from the report alone (``run_all.py --render-only``)."""
    title = "# Hit look-up benchmark" + (" (quick smoke run)" if res["quick"] else "")
    machine = f"Run {res['started']} UTC, {res['wall_s']:.0f} s, {res['machine']}."
    trees = "; ".join(
        f"{k}: {bl.block_pool_where(k, info)}" for k, info in res["provenance"].items()
    )
    lines = [title, "", machine, "", f"Block pools: {trees}.", "", *report_lines(res)]
    (out / "hit_lookup.md").write_text("\n".join(lines))


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--out", type=Path, help="write hit_lookup.json and .md here")


def run(a: argparse.Namespace) -> dict[str, Any]:
    res = drive(a.python, a.patched_tree, a.unpatched_tree, a.repeats, a.quick)
    if a.out:
        write_report(res, a.out)
    return res


def summary(res: dict[str, Any]) -> Iterator[str]:
    for r in res["rows"]:
        yield (
            f"{r['state']:<12} {r['copies']:>5} copies: patched "
            f"{r['patched']['median_s'] * 1e6:.3f} us, unpatched "
            f"{r['unpatched']['median_s'] * 1e6:.3f} us, ratio {r['ratio']:.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    return bl.bench_main(
        argv,
        __doc__,
        make_handler,
        run,
        summary,
        add_args,
        json_help="write the full result here",
    )


if __name__ == "__main__":
    sys.exit(main())
