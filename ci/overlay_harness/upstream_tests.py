"""Run upstream vLLM's own tests against an installed vLLM wheel, on a CPU.

Usage::

    python -m overlay_harness.upstream_tests record --tree T --python P --out B.json
    python -m overlay_harness.upstream_tests check --tree T --python P \
        [--baseline B.json] \
        [--extra tests/v1/core/test_new.py ... --expected ci/overlay-tests.txt]
    python -m overlay_harness.upstream_tests expected --tree T --python P \
        --extra tests/v1/core/test_new.py ... --out ci/overlay-tests.txt
    python -m overlay_harness.upstream_tests report --baseline B.json --out NOT_RUN.md

``T`` is an upstream source tree (unpatched or patched), ``P`` the python of a
venv where the matching vLLM wheel is installed.  The steps:

1. build a *test tree*: a directory holding only a copy of ``T/tests`` and
   ``T/pyproject.toml`` (pytest's configuration), so ``import vllm`` resolves
   to the installed wheel and never to the source tree; checked by running
   ``P`` in the test tree and requiring ``vllm.__file__`` to lie in one of
   ``P``'s site-packages directories;
2. run pytest there (``-n 2``, ``-p overlay_harness.pytest_cpu``, a per-test
   timeout, ``--junitxml``) on the selection below plus any ``--extra``;
3. parse the junit xml into ``{nodeid: outcome}``;
4. ``record`` writes the baseline (every node id, its outcome and, for each
   non-pass, a reason derived from the failure text by ``REASON_PATTERNS``;
   an entry of the baseline it replaces that has a hand-written ``note`` is
   kept as it was while its test exists, ``carry_notes``);
   ``check`` compares: a baseline pass that does not pass now, a baseline
   node id missing from the run, and a new node id that does not pass are
   each an error (exit 1); so is, with ``--expected``, a recorded node id of
   the new tests that did not pass (missing, not collected, skipped, failed)
   and a new node id that is not recorded there. The recorded list is what
   makes an emptied, renamed or uncollectable new test file fail: without
   it, a test that never ran is not a result at all. ``expected`` writes
   that list by collecting the ``--extra`` paths (``pytest --collect-only``).
   ``check`` without ``--baseline`` runs only the ``--extra`` paths, each of
   whose tests must pass: the rebase's gate (``ci/overlay rebase-test``).

Stdlib only: this module runs under any Python 3.11, not only the test venv.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final, Literal

from vllm_overlay.venv import requirement_text

Outcome = Literal["passed", "failed", "error", "skipped", "xfailed"]

BASELINE_FORMAT: Final = 1

# The upstream tests that exercise the code the patch series touches.  Paths
# are relative to the tree root; a directory means every test file under it.
SELECTION: Final[tuple[str, ...]] = (
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/prefix_cache",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_kv_sharing.py",
    "tests/distributed/test_kv_cache_events.py",
    "tests/distributed/test_events.py",
    "tests/v1/kv_connector/unit/offloading_connector/test_events.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_scheduler.py",
    # New in 0.34.0 beside the code the series patches.
    "tests/v1/core/test_reset_prefix_cache_e2e.py",
    "tests/v1/core/test_prompt_block_hash_vectors.py",
    "tests/v1/kv_connector/unit/test_cache_pollution_prevention.py",
    "tests/v1/simple_kv_offload/test_kv_events.py",
    "tests/v1/simple_kv_offload/test_host_buffer.py",
)

# Environment of the pytest run (added to a minimal copy of the caller's).
#   HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE: tests that need a model config from
#     the hub fail at once instead of retrying with back-off for minutes.
#   HF_HOME: an empty per-run directory, so the result does not depend on
#     whatever a machine happens to have cached (a baseline recorded on one
#     machine must mean the same on another).
#   VLLM_TARGET_DEVICE=cpu: vLLM resolves its CpuPlatform instead of
#     UnspecifiedPlatform; tests that ask for ``current_platform.device_type``
#     (HiSparse, NIXL, offloading) then get "cpu" instead of failing with
#     "Failed to infer device type".  Measured: more passes, none fewer.
#   VLLM_LOGGING_LEVEL=WARNING: smaller captured logs in the junit xml.
RUN_ENV: Final[Mapping[str, str]] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
}
# Caller variables passed through unchanged; everything else is dropped so a
# developer's shell (PYTHONPATH, VLLM_*, CUDA_*) cannot change the result.
PASS_ENV: Final[tuple[str, ...]] = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER")

PER_TEST_TIMEOUT_S: Final = 300
XDIST_WORKERS: Final = 2

# Reasons for a non-pass, derived from the failure text: the first pattern
# that matches (re.search) wins.  In a reason, ``{1}`` is the pattern's first
# group and ``{model}`` the first quoted ``'org/name'`` in the text (the model
# the test asked the hub for).  Keep this table small and explicit; a failure
# it does not know is reported as "unclassified <outcome>: <ExceptionType>".
REASON_PATTERNS: Final[tuple[tuple[str, str], ...]] = (
    (r"Failed to infer device type", "needs GPU: Failed to infer device type"),
    (r"Cannot access accelerator device", "needs GPU: no accelerator device"),
    (r"Torch not compiled with CUDA enabled", "needs GPU: torch without CUDA"),
    (r"Found no NVIDIA driver|no CUDA GPUs are available", "needs GPU: no CUDA"),
    (
        r"Invalid repository ID or local directory specified: '([^']+)'",
        "needs model hub: {1} config",
    ),
    (
        "OfflineModeIsEnabled|LocalEntryNotFoundError"
        "|outgoing traffic has been disabled",
        "needs model hub: {model}",
    ),
    (r"Timeout \(>[\d.]+s\)|Timeout >[\d.]+s", "timeout"),
    (r"worker '\w+' crashed", "worker crashed"),
    (r"No module named '([\w.]+)'", "missing module: {1}"),
)
_MODEL_ID: Final = r"'([A-Za-z0-9][\w.\-]*/[\w.\-]+)'"


_SITE_CHECK: Final = (
    "import json, site, sys, sysconfig, vllm\n"
    "dirs = set(site.getsitepackages() + [site.getusersitepackages()])\n"
    "dirs |= {sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']}\n"
    "print(json.dumps({'file': vllm.__file__, 'version': vllm.__version__,\n"
    "  'site': sorted(dirs), 'python': sys.version.split()[0]}))\n"
)
_VERSIONS_CHECK: Final = (
    "import json, sys, importlib.metadata as m\n"
    "out = {}\n"
    "for d in sys.argv[1:]:\n"
    "    try: out[d] = m.version(d)\n"
    "    except m.PackageNotFoundError: out[d] = None\n"
    "print(json.dumps(out))\n"
)
# The test environment's pins (the runner, its plugins), recorded with the
# baseline together with the engine's own versions.
TEST_REQUIREMENTS: Final = Path(__file__).resolve().parents[1] / "requirements-test.txt"
ENGINE_DISTRIBUTIONS: Final = ("vllm", "torch", "transformers")


def recorded_distributions(requirements: Path = TEST_REQUIREMENTS) -> list[str]:
    """The distributions whose versions a run records: the engine's and every
    pinned test requirement."""
    names = [
        re.split(r"[=<>!~ \[;]", line.strip(), maxsplit=1)[0]
        for line in requirement_text(requirements).splitlines()
        if line.strip() and not line.lstrip().startswith(("#", "-"))
    ]
    return [*ENGINE_DISTRIBUTIONS, *names]


class HarnessError(Exception):
    """Set-up problem (not a test result): bad tree, wrong import, no junit."""


@dataclasses.dataclass(frozen=True)
class TestResult:
    nodeid: str
    outcome: Outcome
    message: str  # failure/skip text ('' for a pass)
    duration_s: float


@dataclasses.dataclass(frozen=True)
class RunResult:
    results: dict[str, TestResult]
    pytest_rc: int
    wall_s: float
    junit: Path
    log: Path
    selection: tuple[str, ...]
    versions: dict[str, str | None]
    env: dict[str, str]


# --------------------------------------------------------------------------
# 1. test tree


def build_test_tree(tree: Path, dest: Path) -> Path:
    """Copy ``tree/tests`` and ``tree/pyproject.toml`` into ``dest``."""
    tests = tree / "tests"
    pyproject = tree / "pyproject.toml"
    if not tests.is_dir() or not pyproject.is_file():
        raise HarnessError(
            f"{tree}: not a vLLM source tree (needs tests/ and pyproject.toml); "
            "pass the root of an unpacked sdist or a patched scratch tree"
        )
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    shutil.copytree(
        tests,
        dest / "tests",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"),
        symlinks=True,
    )
    shutil.copy2(pyproject, dest / "pyproject.toml")
    return dest


def _run_env(
    test_tree: Path, overrides: Mapping[str, str] | None = None
) -> dict[str, str]:
    env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
    env.update(RUN_ENV)
    for k, v in (overrides or {}).items():  # an empty value removes the variable
        if v:
            env[k] = v
        else:
            env.pop(k, None)
    hf_home = test_tree / ".hf-home"
    hf_home.mkdir(exist_ok=True)
    env["HF_HOME"] = str(hf_home)
    # The plugin package (this module's parent package) must be importable.
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    return env


def check_vllm_import(python: Path, test_tree: Path, env: Mapping[str, str]) -> str:
    """Fail unless ``import vllm`` from the test tree is the installed wheel."""
    proc = subprocess.run(
        [str(python), "-c", _SITE_CHECK],
        check=False,
        cwd=test_tree,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise HarnessError(
            f"{python}: 'import vllm' failed from {test_tree}:\n"
            f"{proc.stderr.strip()[-2000:]}\n"
            "install the vLLM wheel into that venv first"
        )
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    vllm_file = Path(info["file"]).resolve()
    sites = [Path(s).resolve() for s in info["site"]]
    if not any(vllm_file.is_relative_to(s) for s in sites):
        raise HarnessError(
            f"'import vllm' from the test tree resolved to {vllm_file}, which is "
            f"not in {python}'s site-packages ({', '.join(map(str, sites))}); "
            "the tests would not test the installed wheel"
        )
    if vllm_file.is_relative_to(test_tree.resolve()):
        raise HarnessError(f"'import vllm' resolved inside the test tree: {vllm_file}")
    return str(info["version"])


def _versions(python: Path, env: Mapping[str, str]) -> dict[str, str | None]:
    proc = subprocess.run(
        [str(python), "-c", _VERSIONS_CHECK, *recorded_distributions()],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    data: dict[str, str | None] = json.loads(proc.stdout.strip().splitlines()[-1])
    return data


# --------------------------------------------------------------------------
# 2. pytest


def run_pytest(
    tree: Path,
    python: Path,
    selection: Sequence[str],
    work: Path,
    *,
    workers: int = XDIST_WORKERS,
    timeout_s: int = PER_TEST_TIMEOUT_S,
    pytest_args: Sequence[str] = (),
    env_overrides: Mapping[str, str] | None = None,
    echo: bool = True,
) -> RunResult:
    work.mkdir(parents=True, exist_ok=True)
    test_tree = build_test_tree(tree, work / "test-tree")
    for sel in selection:
        if not (test_tree / sel.split("::")[0]).exists():
            raise HarnessError(
                f"{tree}: selected test path {sel} does not exist; "
                "fix the selection or the --extra argument"
            )
    env = _run_env(test_tree, env_overrides)
    check_vllm_import(python, test_tree, env)
    versions = _versions(python, env)
    junit = work / "junit.xml"
    log = work / "pytest.log"
    junit.unlink(missing_ok=True)
    cmd = [
        str(python),
        "-m",
        "pytest",
        "-p",
        "overlay_harness.pytest_cpu",
        "-p",
        "no:cacheprovider",
        "-n",
        str(workers),
        f"--timeout={timeout_s}",
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit1",
        "-o",
        "junit_logging=no",
        "--continue-on-collection-errors",
        "-q",
        "-rfE",
        *pytest_args,
        *selection,
    ]
    start = time.monotonic()
    with log.open("w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=test_tree,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()
        rc = proc.wait()
    wall = time.monotonic() - start
    # 0: all passed, 1: some failed; anything else is not a test result.
    if rc not in (0, 1) or not junit.is_file():
        raise HarnessError(
            f"pytest exited {rc} without a usable result (junit: {junit}); see {log}"
        )
    results = parse_junit(junit, test_tree)
    run_env = {
        k: v for k, v in env.items() if k in RUN_ENV or k in (env_overrides or {})
    }
    return RunResult(results, rc, wall, junit, log, tuple(selection), versions, run_env)


# --------------------------------------------------------------------------
# 3. junit xml -> {nodeid: result}

_RANK: Final[dict[str, int]] = {
    "passed": 0,
    "skipped": 1,
    "xfailed": 2,
    "failed": 3,
    "error": 4,
}


def _nodeid_from_names(classname: str, name: str, test_tree: Path) -> str:
    """Rebuild a node id from junit's dotted classname (fallback only)."""
    if not classname:  # a collection report: name is the dotted module path
        parts, rest = name.split("."), []
    else:
        parts, rest = classname.split("."), [name]
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i])
        if (test_tree / f"{path}.py").is_file():
            return "::".join([f"{path}.py", *parts[i:], *rest])
        if (test_tree / path).is_dir() and i == len(parts) and not rest:
            return path
    return "::".join([*parts, *rest])


def parse_junit(junit: Path, test_tree: Path) -> dict[str, TestResult]:
    root = ET.parse(junit).getroot()
    out: dict[str, TestResult] = {}
    for case in root.iter("testcase"):
        nodeid = ""
        for prop in case.iter("property"):
            if prop.get("name") == "nodeid":
                nodeid = prop.get("value", "")
        if not nodeid:
            nodeid = _nodeid_from_names(
                case.get("classname", ""), case.get("name", ""), test_tree
            )
        outcome: Outcome = "passed"
        message = ""
        for child in case:
            tag = child.tag
            text = " ".join(
                s for s in (child.get("message", ""), child.text or "") if s
            )
            if tag == "error":
                outcome, message = "error", text
            elif tag == "failure" and outcome != "error":
                outcome, message = "failed", text
            elif tag == "skipped" and outcome == "passed":
                is_xfail = child.get("type") == "pytest.xfail"
                outcome = "xfailed" if is_xfail else "skipped"
                message = child.get("message") or text
        result = TestResult(nodeid, outcome, message, float(case.get("time", "0")))
        prev = out.get(nodeid)
        if prev is None or _RANK[outcome] > _RANK[prev.outcome]:
            out[nodeid] = result
    return out


# --------------------------------------------------------------------------
# 4. reasons, baseline, comparison


def classify(result: TestResult) -> str:
    """A short reason for a non-pass, from ``REASON_PATTERNS``."""
    text = result.message
    for pattern, reason in REASON_PATTERNS:
        m = re.search(pattern, text)
        if m:
            reason = reason.replace("{1}", m.group(1) if m.groups() else "")
            if "{model}" in reason:
                model = re.search(_MODEL_ID, text)
                reason = reason.replace(
                    "{model}", f"{model.group(1)} config" if model else "a model"
                )
            return reason
    if result.outcome in ("skipped", "xfailed"):
        first = text.strip().splitlines()[0] if text.strip() else ""
        first = re.sub(r"^Skipped: |^\S+:\d+: ", "", first)
        return f"{result.outcome} upstream: {first[:120]}".rstrip(": ")
    m = re.search(r"\b([A-Z]\w*(?:Error|Exception))\b", text)
    kind = m.group(1) if m else result.outcome
    return f"unclassified {result.outcome}: {kind}"


def baseline_entries(results: Mapping[str, TestResult]) -> dict[str, dict[str, str]]:
    entries: dict[str, dict[str, str]] = {}
    for nodeid in sorted(results):
        r = results[nodeid]
        entry: dict[str, str] = {"outcome": r.outcome}
        if r.outcome != "passed":
            entry["reason"] = classify(r)
        entries[nodeid] = entry
    return entries


def counts(outcomes: Iterable[str]) -> dict[str, int]:
    c: dict[str, int] = {k: 0 for k in _RANK}
    for o in outcomes:
        c[o] += 1
    return c


def carry_notes(
    previous: Mapping[str, Mapping[str, str]], tests: dict[str, dict[str, str]]
) -> list[str]:
    """Keep the hand-written entries of ``previous`` in ``tests``, the new
    record: an entry with a ``note`` (why it was set by hand, e.g. a test
    that passes on the unpatched tree recorded as failing on purpose) is
    kept as it was, outcome and reason too, while its node id still runs;
    return one line per note kept (with this run's outcome) or dropped
    because its test is gone."""
    lines = []
    for nodeid, entry in sorted(previous.items()):
        if "note" not in entry:
            continue
        if nodeid in tests:
            now = tests[nodeid]["outcome"]
            tests[nodeid] = dict(entry)
            lines.append(
                f"kept the note of {nodeid} and its entry ({entry['outcome']}; "
                f"this run: {now}): {entry['note']}"
            )
        else:
            lines.append(
                f"DROPPED the note of {nodeid}: its test is gone: {entry['note']}"
            )
    return lines


def write_baseline(
    run: RunResult,
    out: Path,
    tree: Path,
    previous: Mapping[str, Mapping[str, str]] | None = None,
) -> tuple[dict[str, object], list[str]]:
    """Write the baseline of ``run``, keeping the notes of ``previous`` (the
    entries of the baseline it replaces, ``carry_notes``); return its meta
    and what became of each note."""
    tests = baseline_entries(run.results)
    notes = carry_notes(previous or {}, tests)
    meta: dict[str, object] = {
        "counts": counts(e["outcome"] for e in tests.values()),
        "env": dict(sorted(run.env.items())),
        "per_test_timeout_s": PER_TEST_TIMEOUT_S,
        "recorded_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "selection": list(run.selection),
        "tree": tree.name,
        "versions": dict(sorted(run.versions.items())),
        "wall_s": round(run.wall_s, 1),
        "workers": XDIST_WORKERS,
    }
    # Sorted keys throughout; one line per node id so diffs stay readable.
    lines = ["{", f'"format": {BASELINE_FORMAT},']
    lines.append('"meta": ' + json.dumps(meta, sort_keys=True) + ",")
    lines.append('"tests": {')
    items = [
        json.dumps(k) + ": " + json.dumps(v, sort_keys=True) for k, v in tests.items()
    ]
    lines.append(",\n".join(items))
    lines.append("}")
    lines.append("}")
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    json.loads(tmp.read_text())  # never leave invalid JSON behind
    tmp.replace(out)
    return meta, notes


@dataclasses.dataclass(frozen=True)
class Baseline:
    tests: dict[str, dict[str, str]]
    selection: tuple[str, ...]
    meta: dict[str, object]


def load_baseline(path: Path) -> Baseline:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HarnessError(
            f"{path}: cannot read baseline ({e}); re-run 'record'"
        ) from e
    if data.get("format") != BASELINE_FORMAT:
        raise HarnessError(f"{path}: baseline format {data.get('format')!r} unknown")
    meta = data["meta"]
    return Baseline(data["tests"], tuple(meta["selection"]), meta)


@dataclasses.dataclass(frozen=True)
class Comparison:
    regressions: list[str]  # baseline passed, now not passed
    missing: list[str]  # in baseline, not in this run
    new_not_passed: list[str]  # not in baseline, did not pass
    new_passed: list[str]
    fixed: list[str]  # baseline not passed, passes now
    expected_not_passed: list[str] = dataclasses.field(default_factory=list)
    unlisted: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.regressions
            or self.missing
            or self.new_not_passed
            or self.expected_not_passed
            or self.unlisted
        )


def compare(
    baseline: Baseline,
    results: Mapping[str, TestResult],
    expected: Sequence[str] | None = None,
) -> Comparison:
    """``expected``: the recorded node ids of the new tests (``--expected``);
    each must pass, and every new node id must be one of them."""
    regressions, missing, fixed = [], [], []
    for nodeid, entry in sorted(baseline.tests.items()):
        r = results.get(nodeid)
        if r is None:
            missing.append(nodeid)
        elif entry["outcome"] == "passed" and r.outcome != "passed":
            regressions.append(nodeid)
        elif entry["outcome"] != "passed" and r.outcome == "passed":
            fixed.append(nodeid)
    new = sorted(set(results) - set(baseline.tests))
    new_not = [n for n in new if results[n].outcome != "passed"]
    new_ok = [n for n in new if results[n].outcome == "passed"]
    if expected is None:
        return Comparison(regressions, missing, new_not, new_ok, fixed)
    expected_not = [
        n
        for n in sorted(expected)
        if n not in results or results[n].outcome != "passed"
    ]
    unlisted = sorted(set(new) - set(expected))
    return Comparison(
        regressions, missing, new_not, new_ok, fixed, expected_not, unlisted
    )


def load_expected(path: Path) -> list[str]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise HarnessError(
            f"{path}: cannot read the expected node ids ({e}); write it with "
            "'python -m overlay_harness.upstream_tests expected'"
        ) from e
    ids = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    if not ids:
        raise HarnessError(f"{path}: lists no node ids")
    return ids


def collect_ids(
    tree: Path, python: Path, selection: Sequence[str], work: Path
) -> list[str]:
    """The node ids pytest collects from ``selection`` in the test tree."""
    test_tree = build_test_tree(tree, work / "test-tree")
    env = _run_env(test_tree)
    check_vllm_import(python, test_tree, env)
    proc = subprocess.run(
        [
            str(python),
            "-m",
            "pytest",
            "-p",
            "overlay_harness.pytest_cpu",
            "-p",
            "no:cacheprovider",
            "--collect-only",
            "-q",
            *selection,
        ],
        cwd=test_tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    # -q prints one node id a line (ids may hold spaces: parametrize values),
    # then a blank line and the summary.
    listing = proc.stdout.split("\n\n", 1)[0].splitlines()
    ids = [ln for ln in listing if "::" in ln and not ln[:1].isspace()]
    if proc.returncode != 0 or not ids:
        raise HarnessError(
            f"collecting {' '.join(selection)} failed (pytest exit "
            f"{proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
        )
    return sorted(ids)


def version_drift(
    baseline: Mapping[str, object], run: Mapping[str, str | None]
) -> list[str]:
    """Versions of this run that are not the baseline's. vLLM is compared
    without its local label: the overlay wheel is the pinned release plus the
    series, and the baseline ran the official one."""
    out = []
    for name in sorted(set(baseline) | set(run)):
        then, now = baseline.get(name), run.get(name)
        if name == "vllm" and isinstance(then, str) and now is not None:
            then, now = then.split("+")[0], now.split("+")[0]
        if name not in baseline:
            out.append(f"{name} {now}: not recorded in the baseline")
        elif then != now:
            out.append(f"{name}: baseline {then}, this run {now}")
    return out


def _first_line(text: str, width: int = 160) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()[:width]
    return ""


def format_comparison(
    cmp: Comparison, results: Mapping[str, TestResult], baseline: Baseline
) -> str:
    out: list[str] = []
    c = counts(r.outcome for r in results.values())
    # Without a baseline only the overlay's own tests ran (the rebase gate).
    out.append(
        ("upstream tests: " if baseline.tests else "overlay tests: ")
        + f"{len(results)} run "
        + ", ".join(f"{k} {v}" for k, v in c.items())
        + (f"; baseline {len(baseline.tests)} node ids" if baseline.tests else "")
    )

    def section(title: str, ids: list[str], show_msg: bool) -> None:
        if not ids:
            return
        out.append(f"{title} ({len(ids)}):")
        for n in ids:
            line = f"  {n}"
            r = results.get(n)
            if show_msg and r is not None:
                line += f"  [{r.outcome}] {_first_line(r.message)}"
            out.append(line)

    section("REGRESSION: passed in the baseline, not now", cmp.regressions, True)
    section("MISSING: in the baseline, not in this run", cmp.missing, False)
    section("NEW TEST NOT PASSING", cmp.new_not_passed, True)
    section(
        "EXPECTED NEW TEST DID NOT PASS (missing, not collected, skipped or failed)",
        cmp.expected_not_passed,
        True,
    )
    section(
        "NEW TEST NOT IN THE EXPECTED LIST (re-run 'expected' and commit the list)",
        cmp.unlisted,
        False,
    )
    section("new tests passing", cmp.new_passed, False)
    section(
        "now passing, not in the baseline (re-record the baseline?)", cmp.fixed, False
    )
    out.append("OK: no regression" if cmp.ok else "FAILED")
    return "\n".join(out)


def render_report(baseline: Baseline) -> str:
    """Markdown summary of the baseline tests that do not pass: counts by
    reason, then every test function by name, per reason and file."""
    not_passed = {
        k: v for k, v in sorted(baseline.tests.items()) if v["outcome"] != "passed"
    }
    by_reason: dict[str, int] = {}
    for v in not_passed.values():
        by_reason[v["reason"]] = by_reason.get(v["reason"], 0) + 1
    meta = baseline.meta
    c = meta.get("counts", {})
    lines = [
        "# Upstream tests that do not pass on CPU",
        "",
        (
            "Generated by `python -m overlay_harness.upstream_tests report` from the "
            "checked-in baseline; do not edit by hand."
        ),
        "",
        f"Baseline: {len(baseline.tests)} tests on the unpatched tree "
        f"(`{meta.get('tree')}`, vllm {dict(meta.get('versions', {})).get('vllm')}, "  # type: ignore[call-overload]
        f"recorded {meta.get('recorded_utc')}): "
        + ", ".join(f"{k} {v}" for k, v in dict(c).items())  # type: ignore[call-overload]
        + ".",
        "",
        "Selection: " + ", ".join(f"`{s}`" for s in baseline.selection) + ".",
        "",
        "## By reason",
        "",
    ]
    for reason, n in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"- {n} × {reason}")
    lines += [
        "",
        "## Tests, by reason and file",
        "",
        "Each test function by name; `×N` counts its parametrized cases.",
    ]
    grouped: dict[str, dict[str, dict[str, int]]] = {}
    for nodeid, v in not_passed.items():
        file, _, name = nodeid.partition("::")
        function = name.split("[", 1)[0]
        per_file = grouped.setdefault(v["reason"], {}).setdefault(file, {})
        per_file[function] = per_file.get(function, 0) + 1
    for reason in sorted(grouped, key=lambda r: (-by_reason[r], r)):
        lines += ["", f"### {reason}", ""]
        for file, functions in sorted(grouped[reason].items()):
            named = ", ".join(
                f"`{function}`" + (f" ×{n}" if n > 1 else "")
                for function, n in functions.items()
            )
            lines.append(f"- `{file}`: {named}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------
# CLI


def _expected_command(tree: Path, python: Path, extra: Sequence[str], out: Path) -> str:
    return shlex.join(
        [
            "PYTHONPATH=ci",
            str(python),
            "-m",
            "overlay_harness.upstream_tests",
            "expected",
            "--tree",
            str(tree),
            "--python",
            str(python),
            "--extra",
            *extra,
            "--out",
            str(out),
        ]
    )


def _work_dir(arg: str | None) -> tuple[Path, bool]:
    if arg:
        return Path(arg).resolve(), False
    return Path(tempfile.mkdtemp(prefix="vllm-upstream-tests-")), True


def _main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m overlay_harness.upstream_tests")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("record", "check"):
        p = sub.add_parser(name)
        p.add_argument("--tree", required=True, type=Path, help="vLLM source tree")
        p.add_argument(
            "--python", required=True, type=Path, help="python of the wheel's venv"
        )
        p.add_argument(
            "--work", help="work directory (default: a temp dir, removed on success)"
        )
        p.add_argument("--timeout", type=int, default=PER_TEST_TIMEOUT_S)
        p.add_argument("-q", "--quiet", action="store_true", help="do not echo pytest")
        p.add_argument(
            "--env",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a variable of the run environment (empty VALUE removes)",
        )
        if name == "record":
            p.add_argument("--out", required=True, type=Path)
            p.add_argument(
                "--selection",
                nargs="+",
                default=list(SELECTION),
                help="test paths (default: the built-in selection)",
            )
        else:
            p.add_argument(
                "--baseline",
                type=Path,
                help="the unpatched tree's outcomes; without it only --extra "
                "runs, and every test of it must pass (the rebase's gate)",
            )
            p.add_argument(
                "--extra", nargs="*", default=[], help="more test paths (new tests)"
            )
            p.add_argument(
                "--expected",
                type=Path,
                help="recorded node ids of the new tests: each must pass",
            )
    p = sub.add_parser("expected", help="record the node ids of the new tests")
    p.add_argument("--tree", required=True, type=Path, help="patched vLLM tree")
    p.add_argument("--python", required=True, type=Path, help="python of the venv")
    p.add_argument("--extra", nargs="+", required=True, help="new test paths")
    p.add_argument("--out", required=True, type=Path)
    p = sub.add_parser("report")
    p.add_argument("--baseline", required=True, type=Path)
    p.add_argument("--out", type=Path, help="write here instead of stdout")
    args = ap.parse_args(argv)

    try:
        if args.cmd == "report":
            text = render_report(load_baseline(args.baseline))
            if args.out:
                args.out.write_text(text)
            else:
                sys.stdout.write(text)
            return 0

        tree: Path = args.tree.resolve()
        python: Path = args.python.absolute()
        if not python.is_file():
            raise HarnessError(
                f"{python}: no such interpreter; pass the test venv's python "
                "(PYTHONPATH=ci python3 -m overlay_harness.testenv dist/*.whl "
                "prints it)"
            )
        if args.cmd == "expected":
            with tempfile.TemporaryDirectory(prefix="vllm-collect-") as tmp:
                ids = collect_ids(tree, python, args.extra, Path(tmp))
            command = _expected_command(args.tree, args.python, args.extra, args.out)
            args.out.write_text(
                "# Node ids of the overlay's new tests; each must pass in 'check'.\n"
                f"# Written by: {command}\n" + "".join(f"{i}\n" for i in ids)
            )
            print(f"{len(ids)} node ids written: {args.out}")
            return 0
        if args.cmd == "check":
            if args.baseline is None and not args.extra:
                raise HarnessError("check without --baseline runs --extra: name tests")
            base = (
                load_baseline(args.baseline) if args.baseline else Baseline({}, (), {})
            )
            expected = load_expected(args.expected) if args.expected else None
            selection = [*base.selection, *args.extra]
        else:
            selection = list(args.selection)
            # The baseline a re-record replaces: its notes are kept. Read
            # before the run, so an unreadable one stops before minutes.
            previous = load_baseline(args.out).tests if args.out.is_file() else {}
        work, is_temp = _work_dir(args.work)
        run = run_pytest(
            tree,
            python,
            selection,
            work,
            timeout_s=args.timeout,
            env_overrides=dict(e.split("=", 1) for e in args.env),
            echo=not args.quiet,
        )
        if args.cmd == "record":
            meta, notes = write_baseline(run, args.out, tree, previous)
            print("\n".join(notes) if notes else "no hand-written notes to keep")
            print(f"baseline written: {args.out}: {meta['counts']}, {meta['wall_s']} s")
            ok = True
        else:
            cmp = compare(base, run.results, expected)
            if args.baseline and base.meta.get("env") != run.env:
                print(
                    "warning: run environment differs from the baseline's: "
                    f"baseline {base.meta.get('env')}, now {run.env}"
                )
            drift = version_drift(dict(base.meta.get("versions", {})), run.versions)  # type: ignore[call-overload]
            if drift and args.baseline:
                print(
                    "VERSION DRIFT between the baseline and this run (outcomes "
                    "may differ for that reason alone; pin the baseline's "
                    "versions in ci/requirements-test.txt, or re-record the "
                    "baseline on the unpatched tree):\n  " + "\n  ".join(drift)
                )
            print(format_comparison(cmp, run.results, base))
            if cmp.unlisted or cmp.expected_not_passed:
                print(
                    "if the new tests changed on purpose, record them: "
                    + _expected_command(
                        args.tree, args.python, args.extra, args.expected
                    )
                )
            print(f"pytest wall time {run.wall_s:.0f} s; junit {run.junit}")
            ok = cmp.ok
        if is_temp and ok:
            shutil.rmtree(work, ignore_errors=True)
        elif not ok:
            print(f"kept for inspection: {work}")
        return 0 if ok else 1
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def main() -> None:
    sys.exit(_main())


if __name__ == "__main__":
    main()
