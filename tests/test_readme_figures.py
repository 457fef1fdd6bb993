"""README's figures equal the files under docs/ that the commands README
names write (ci/bench.sh, the upstream-test runner): a figure cannot drift
from its artifact, and a figure without one fails here."""

from __future__ import annotations

import itertools
import json
import re

from conftest import REPO

README = (REPO.root / "README.md").read_text()
DOCS = REPO.root / "docs"


def _section(title: str) -> str:
    start = README.index(f"\n{title}\n")
    end = README.find("\n#", start + len(title) + 2)
    return README[start : end if end != -1 else None]


def _table_after(text: str, header: str) -> str:
    lines = text[text.index(header) :].splitlines()
    return "\n".join(itertools.takewhile(lambda ln: ln.startswith("|"), lines))


def _pct(a: float, b: float) -> str:
    return f"{(b - a) / a * 100:+.1f} %"


def _dup_first() -> dict:
    return json.loads((DOCS / "benchmarks" / "dup_first.json").read_text())


def test_hit_selection_table_is_the_benchmark_output() -> None:
    hs = _dup_first()
    p, q = hs["summary"]["families_high"], hs["summary"]["families_low"]

    def pair(trace: dict, metric: str) -> tuple[float, float]:
        return trace["upstream"][metric]["median"], trace["series"][metric]["median"]

    runs = hs["runs"]["families_high"]
    fewer = [
        f["blocks_computed"] - r["blocks_computed"]
        for f, r in zip(runs["upstream"], runs["series"], strict=True)
    ]
    assert min(fewer) >= 0, "README says never more"
    ht, bc = pair(p, "hit_tokens"), pair(p, "blocks_computed")
    cm, dk = pair(p, "copies_mean"), pair(p, "dup_keys_mean")
    hr = pair(q, "hit_rate")
    mx = q["upstream"]["copies_max"]["max"], q["series"]["copies_max"]["max"]
    traces = hs["traces"]
    expected = "\n".join(
        [
            "| trace | metric | first copy (0.33.0) | copy in use (0004) |",
            "|---|---|---|---|",
            f"| 24 families, {traces['families_high']['num_blocks']} blocks "
            f"(pressure) | hit tokens | {ht[0]:g} | {ht[1]:g} ({_pct(*ht)}) |",
            f"| | blocks computed | {bc[0]:g} | {bc[1]:g} (per seed "
            f"{min(fewer):g} to {max(fewer):g} fewer, never more) |",
            f"| | mean copies per resident key | {cm[0]:.3f} | {cm[1]:.3f} |",
            f"| | keys with more than one copy | {dk[0]:.2f} | {dk[1]:.2f} "
            f"({_pct(*dk)}) |",
            f"| 8 families, {traces['families_low']['num_blocks']} blocks (little "
            f"pressure) | hit rate | {hr[0]:.4f} | {hr[1]:.4f} |",
            f"| | max copies per key | {mx[0]:g} | {mx[1]:g} |",
        ]
    )
    assert _table_after(README, "| trace | metric |") == expected


def test_dup_first_table_is_the_benchmark_output() -> None:
    hs = _dup_first()
    assert not hs["quick"] and len(hs["seeds"]) >= 5
    rows = [
        "| trace | GPU blocks | blocks computed | hit tokens | mean copies per key "
        "| max copies per key |",
        "|---|---:|---|---|---|---|",
    ]
    for trace, per_tree in hs["summary"].items():

        def three(metric: str, stat: str, digits: int, per_tree: dict = per_tree):
            return " / ".join(
                f"{per_tree[t][metric][stat]:.{digits}f}"
                for t in ("upstream", "series", "dup_first")
            )

        rows.append(
            f"| {trace} | {hs['traces'][trace]['num_blocks']} "
            f"| {three('blocks_computed', 'median', 1)} "
            f"| {three('hit_tokens', 'median', 0)} "
            f"| {three('copies_mean', 'median', 3)} "
            f"| {three('copies_max', 'max', 0)} |"
        )
    assert _table_after(README, "| trace | GPU blocks |") == "\n".join(rows)
    assert (
        _table_after(
            (DOCS / "benchmarks" / "dup_first.md").read_text(),
            "| trace | blocks computed |",
        )
        in README
    )


def _numbers(text: str) -> list[str]:
    return re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.]*\d)", text)


def test_benchmark_summary_figures_are_in_the_reports() -> None:
    """Every number in README's Benchmarks table is one of the generated
    reports' numbers, as written there or rounded to the README's digits."""
    reports = " ".join(
        (DOCS / "benchmarks" / name).read_text()
        for name in ("benchmarks.md", "build.md")
    )
    available = [float(n) for n in _numbers(reports)]
    table = _table_after(_section("## Benchmarks"), "| measure | result |")
    missing = []
    for row in table.splitlines()[2:]:
        for figure in _numbers(row.split("|")[2]):
            digits = len(figure.partition(".")[2])
            if not any(round(v, digits) == float(figure) for v in available):
                missing.append(f"{figure} ({row.split('|')[1].strip()})")
    assert not missing, f"README figures in no report under docs/: {missing}"


def test_upstream_counts_are_the_baselines() -> None:
    meta = json.loads((REPO.root / "ci" / "upstream-baseline.json").read_text())
    counts = meta["meta"]["counts"]
    total, passed = sum(counts.values()), counts["passed"]
    assert (
        f"Of the {total} upstream\n   tests in the selection, {passed} pass on the "
        f"CPU; the other {total - passed} all need" in README
    )
    expected = REPO.root / "ci" / "overlay-tests.txt"
    n_new = sum("::" in ln for ln in expected.read_text().splitlines())
    assert f"`ci/overlay-tests.txt`, {n_new} node ids" in README
