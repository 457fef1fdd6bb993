"""Tests of ci/overlay_harness/upstream_tests.py on small synthetic inputs.

The end-to-end tests need a python with vLLM installed; they use the
interpreter running these tests (the project's test venv).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from overlay_harness import upstream_tests as ut
from vllm_overlay.venv import requirement_text

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.a.test_x" name="test_ok" file="tests/a/test_x.py" time="0.1">
  <properties><property name="nodeid" value="tests/a/test_x.py::test_ok"/></properties>
</testcase>
<testcase classname="tests.a.test_x.TestK" name="test_p[a.b-1]" time="0.1"/>
<testcase classname="tests.a.test_x" name="test_gpu" time="0.1">
  <failure message="RuntimeError: Failed to infer device type, please set">tb</failure>
</testcase>
<testcase classname="tests.a.test_x" name="test_hub" time="0.1">
  <failure message="pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, Invalid repository ID or local directory specified: 'facebook/opt-125m'.">tb</failure>
</testcase>
<testcase classname="tests.a.test_x" name="test_hub2" time="0.1">
  <error message="failed on setup with &quot;huggingface_hub.errors.LocalEntryNotFoundError: Cannot find
  an appropriate cached snapshot folder; outgoing traffic has been disabled.&quot;">
  model = 'Qwen/Qwen3.5-0.8B'</error>
</testcase>
<testcase classname="tests.a.test_x" name="test_skip" time="0">
  <skipped type="pytest.skip" message="needs 2 GPUs">tests/a/test_x.py:9: needs 2 GPUs</skipped>
</testcase>
<testcase classname="tests.a.test_x" name="test_teardown" time="0.1">
  <error message="failed on teardown with &quot;ValueError: x&quot;">tb</error>
</testcase>
<testcase classname="" name="tests.a.test_broken" time="0">
  <error message="collection failure">ImportError: No module named 'flashinfer'</error>
</testcase>
</testsuite></testsuites>
"""


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "tests" / "a").mkdir(parents=True)
    (tmp_path / "tests" / "a" / "test_x.py").write_text("")
    (tmp_path / "tests" / "a" / "test_broken.py").write_text("")
    return tmp_path


def test_parse_junit_nodeids_and_outcomes(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    (tree / "j.xml").write_text(JUNIT)
    res = ut.parse_junit(tree / "j.xml", tree)
    got = {k: v.outcome for k, v in res.items()}
    assert got == {
        "tests/a/test_x.py::test_ok": "passed",
        "tests/a/test_x.py::TestK::test_p[a.b-1]": "passed",
        "tests/a/test_x.py::test_gpu": "failed",
        "tests/a/test_x.py::test_hub": "failed",
        "tests/a/test_x.py::test_hub2": "error",
        "tests/a/test_x.py::test_skip": "skipped",
        "tests/a/test_x.py::test_teardown": "error",
        "tests/a/test_broken.py": "error",
    }
    reasons = {
        k: v["reason"] for k, v in ut.baseline_entries(res).items() if "reason" in v
    }
    assert (
        reasons["tests/a/test_x.py::test_gpu"]
        == "needs GPU: Failed to infer device type"
    )
    assert reasons["tests/a/test_x.py::test_hub"] == (
        "needs model hub: facebook/opt-125m config"
    )
    assert reasons["tests/a/test_x.py::test_hub2"] == (
        "needs model hub: Qwen/Qwen3.5-0.8B config"
    )
    assert reasons["tests/a/test_x.py::test_skip"] == "skipped upstream: needs 2 GPUs"
    assert reasons["tests/a/test_broken.py"] == "missing module: flashinfer"
    assert (
        reasons["tests/a/test_x.py::test_teardown"] == "unclassified error: ValueError"
    )


def _base(tests: dict[str, dict[str, str]]) -> ut.Baseline:
    return ut.Baseline(tests, ("tests/a",), {})


def _res(**outcomes: str) -> dict[str, ut.TestResult]:
    return {k: ut.TestResult(k, o, "", 0.0) for k, o in outcomes.items()}  # type: ignore[arg-type]


def test_compare() -> None:
    base = _base(
        {
            "a": {"outcome": "passed"},
            "b": {"outcome": "passed"},
            "c": {"outcome": "failed", "reason": "needs GPU"},
            "d": {"outcome": "passed"},
            "e": {"outcome": "failed", "reason": "x"},
        }
    )
    cmp = ut.compare(
        base,
        _res(a="passed", b="failed", c="failed", e="passed", n1="passed", n2="skipped"),
    )
    assert cmp.regressions == ["b"]
    assert cmp.missing == ["d"]
    assert cmp.new_not_passed == ["n2"]
    assert cmp.new_passed == ["n1"]
    assert cmp.fixed == ["e"]
    assert not cmp.ok
    assert ut.compare(
        base, _res(a="passed", b="passed", c="error", d="passed", e="failed")
    ).ok


def test_baseline_file_roundtrip_and_report(tmp_path: Path) -> None:
    res = {
        "t.py::b": ut.TestResult("t.py::b", "failed", "Failed to infer device type", 0),
        "t.py::a": ut.TestResult("t.py::a", "passed", "", 0),
    }
    run = ut.RunResult(
        res, 1, 3.0, tmp_path / "j", tmp_path / "l", ("t.py",), {"vllm": "0.33.0"}, {}
    )
    out = tmp_path / "b.json"
    ut.write_baseline(run, out, tmp_path)
    text = out.read_text()
    data = json.loads(text)
    assert list(data["tests"]) == ["t.py::a", "t.py::b"]
    assert (
        '"t.py::b": {"outcome": "failed", "reason": "needs GPU: Failed to infer device type"}'
        in text
    )
    base = ut.load_baseline(out)
    md = ut.render_report(base)
    assert "### needs GPU: Failed to infer device type\n\n- `t.py`: `b`\n" in md
    assert "`a`" not in md


def test_vllm_import_check_rejects_shadowing(tmp_path: Path) -> None:
    fake = tmp_path / "src"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text("__version__ = 'fake'\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(fake)}
    with pytest.raises(ut.HarnessError, match="not in .*site-packages"):
        ut.check_vllm_import(Path(sys.executable), tmp_path, env)


@pytest.mark.timeout(600)
def test_record_then_check_end_to_end(tmp_path: Path) -> None:
    """A synthetic tree through the real CLI, with this interpreter's vLLM."""
    tree = tmp_path / "tree"
    (tree / "tests").mkdir(parents=True)
    (tree / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    (tree / "tests" / "test_s.py").write_text(
        textwrap.dedent(
            """
            import torch, vllm, pytest
            def test_ok():
                torch.accelerator.empty_cache()  # no-op through the plugin
                assert "site-packages" in vllm.__file__
            def test_gpu():
                raise RuntimeError("Failed to infer device type")
            @pytest.mark.parametrize("x", [1, 2])
            def test_p(x):
                assert x in (1, 2)
            """
        )
    )
    pkg_root = Path(ut.__file__).resolve().parent.parent
    cli = [sys.executable, "-m", "overlay_harness.upstream_tests"]
    common = ["--tree", str(tree), "--python", sys.executable, "-q"]
    base = tmp_path / "base.json"
    r = subprocess.run(
        [*cli, "record", *common, "--out", str(base), "--selection", "tests/test_s.py"],
        check=False,
        cwd=pkg_root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    tests = json.loads(base.read_text())["tests"]
    assert tests == {
        "tests/test_s.py::test_gpu": {
            "outcome": "failed",
            "reason": "needs GPU: Failed to infer device type",
        },
        "tests/test_s.py::test_ok": {"outcome": "passed"},
        "tests/test_s.py::test_p[1]": {"outcome": "passed"},
        "tests/test_s.py::test_p[2]": {"outcome": "passed"},
    }
    # "patch" the tree: one regression, one dropped test, one new failing test
    (tree / "tests" / "test_s.py").write_text(
        textwrap.dedent(
            """
            def test_ok():
                assert False
            def test_gpu():
                pass
            def test_p():
                pass
            """
        )
    )
    r = subprocess.run(
        [*cli, "check", *common, "--baseline", str(base)],
        check=False,
        cwd=pkg_root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert (
        "REGRESSION: passed in the baseline, not now (1):\n  tests/test_s.py::test_ok"
        in r.stdout
    )
    assert "MISSING: in the baseline, not in this run (2)" in r.stdout
    assert "new tests passing (1):\n  tests/test_s.py::test_p" in r.stdout


def test_compare_with_expected_new_tests() -> None:
    base = _base({"a": {"outcome": "passed"}})
    expected = ["n1", "n2", "n3"]
    cmp = ut.compare(
        base, _res(a="passed", n1="passed", n2="skipped", n4="passed"), expected
    )
    assert cmp.expected_not_passed == ["n2", "n3"]  # skipped; never ran
    assert cmp.unlisted == ["n4"]
    assert not cmp.ok
    assert ut.compare(
        base, _res(a="passed", n1="passed", n2="passed", n3="passed"), expected
    ).ok


@pytest.mark.timeout(600)
def test_expected_new_tests_end_to_end(tmp_path: Path) -> None:
    """The new tests are recorded by collection; emptying one file, renaming
    another out of test_*.py and skipping a test each fail the check, though
    every test that did run passed."""
    tree = tmp_path / "tree"
    (tree / "tests" / "new").mkdir(parents=True)
    (tree / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    (tree / "tests" / "test_up.py").write_text("def test_up():\n    pass\n")
    new = {
        "test_a.py": "def test_a():\n    pass\n",
        "test_b.py": "def test_b():\n    pass\n",
        "test_c.py": "import pytest\ndef test_c1():\n    pass\n"
        "@pytest.mark.parametrize('x', ['a b'])\ndef test_c2(x):\n    pass\n",
    }
    for name, text in new.items():
        (tree / "tests" / "new" / name).write_text(text)
    pkg_root = Path(ut.__file__).resolve().parent.parent
    cli = [sys.executable, "-m", "overlay_harness.upstream_tests"]
    common = ["--tree", str(tree), "--python", sys.executable]
    extra = [f"tests/new/{n}" for n in new]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*cli, *args],
            check=False,
            cwd=pkg_root,
            capture_output=True,
            text=True,
            timeout=600,
        )

    base, listed = tmp_path / "base.json", tmp_path / "new-tests.txt"
    up = ut.TestResult("tests/test_up.py::test_up", "passed", "", 0.0)
    ut.write_baseline(
        ut.RunResult(
            {up.nodeid: up}, 0, 1.0, base, base, ("tests/test_up.py",), {}, {}
        ),
        base,
        tree,
    )
    r = run("expected", *common, "--extra", *extra, "--out", str(listed))
    assert r.returncode == 0, r.stdout + r.stderr
    assert [ln for ln in listed.read_text().splitlines() if "::" in ln] == [
        "tests/new/test_a.py::test_a",
        "tests/new/test_b.py::test_b",
        "tests/new/test_c.py::test_c1",
        "tests/new/test_c.py::test_c2[a b]",
    ]
    (tree / "tests" / "new" / "test_a.py").write_text("")
    (tree / "tests" / "new" / "test_b.py").rename(tree / "tests" / "new" / "b.py")
    (tree / "tests" / "new" / "test_c.py").write_text(
        "import pytest\ndef test_c1():\n    pass\n@pytest.mark.skip('off')\n"
        "@pytest.mark.parametrize('x', ['a b'])\ndef test_c2(x):\n    pass\n"
    )
    extra_now = ["tests/new/test_a.py", "tests/new/test_c.py"]  # as test.sh finds them
    r = run(
        "check", *common, "-q", "--baseline", str(base),
        "--extra", *extra_now, "--expected", str(listed),
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert (
        "EXPECTED NEW TEST DID NOT PASS (missing, not collected, skipped or failed) (3):\n"
        "  tests/new/test_a.py::test_a\n"
        "  tests/new/test_b.py::test_b\n"
        "  tests/new/test_c.py::test_c2[a b]  [skipped]"
    ) in r.stdout
    assert "overlay_harness.upstream_tests expected --tree" in r.stdout


def test_a_test_file_without_tests_fails_the_project_run(tmp_path: Path) -> None:
    """tests/conftest.py turns an empty test file into a collection error and
    refuses a file that defines tests under a name pytest does not collect."""
    suite = tmp_path / "tests"
    suite.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), suite)
    (suite / "test_ok.py").write_text("def test_ok():\n    pass\n")
    (suite / "test_emptied.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(Path(ut.__file__).parents[1])}

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )

    r = run()
    assert r.returncode != 0, r.stdout
    assert "tests/test_emptied.py collects no test" in r.stdout
    (suite / "test_emptied.py").unlink()
    (suite / "renamed.py").write_text("def test_hidden():\n    pass\n")
    r = run()
    assert r.returncode != 0, r.stdout
    assert "tests/renamed.py defines tests but is not a test_*.py file" in (
        r.stdout + r.stderr
    )
    (suite / "renamed.py").unlink()
    assert run().returncode == 0


def test_version_drift() -> None:
    baseline = {"vllm": "0.33.0", "pytest": "9.2.0", "torch": "2.13.0+cpu"}
    run = {
        "vllm": "0.33.0+overlay.1",
        "pytest": "9.0.3",
        "torch": "2.13.0+cpu",
        "hypothesis": "6.170.17",
    }
    assert ut.version_drift(baseline, run) == [
        "hypothesis 6.170.17: not recorded in the baseline",
        "pytest: baseline 9.2.0, this run 9.0.3",
    ]
    assert ut.version_drift(baseline, {**baseline, "vllm": "0.33.0+overlay.1"}) == []


def test_every_pinned_test_requirement_is_recorded() -> None:
    pins = [
        line
        for line in requirement_text(ut.TEST_REQUIREMENTS).splitlines()
        if line and not line.startswith(("#", "-r "))
    ]
    assert all("==" in p for p in pins), "pin every test requirement exactly"
    assert ut.recorded_distributions()[3:] == [p.split("==")[0] for p in pins]


def test_check_without_a_baseline_runs_only_the_new_tests(tmp_path: Path) -> None:
    """The rebase's gate: no baseline, so upstream's tests do not run (their
    failing one is not seen); every test of --extra must pass, and a check
    with nothing to run is an error, not a pass."""
    tree = tmp_path / "tree"
    (tree / "tests" / "new").mkdir(parents=True)
    (tree / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    (tree / "tests" / "test_up.py").write_text("def test_up():\n    assert 0\n")
    new = tree / "tests" / "new" / "test_n.py"
    new.write_text("def test_n():\n    pass\n")
    pkg_root = Path(ut.__file__).resolve().parent.parent

    def check(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "overlay_harness.upstream_tests", "check", "-q"]
            + ["--tree", str(tree), "--python", sys.executable, "--extra", *extra],
            cwd=pkg_root,
            capture_output=True,
            text=True,
            timeout=600,
        )

    passed = check("tests/new/test_n.py")
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "overlay tests: 1 run passed 1," in passed.stdout
    assert "VERSION DRIFT" not in passed.stdout
    new.write_text("def test_n():\n    assert 0\n")
    failed = check("tests/new/test_n.py")
    assert failed.returncode == 1
    assert "tests/new/test_n.py::test_n  [failed]" in failed.stdout
    nothing = check()
    assert nothing.returncode == 2 and "name tests" in nothing.stderr


def test_re_record_keeps_the_notes_of_tests_that_still_run(tmp_path: Path) -> None:
    """An entry set by hand carries a note (0.33.0's baseline records
    test_emit_cached_block_events as failed on purpose); a re-record over
    that baseline, through the real CLI, keeps it as it was while its test
    still runs, and reports a note whose test is gone."""
    tree = tmp_path / "tree"
    (tree / "tests").mkdir(parents=True)
    (tree / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    (tree / "tests" / "test_n.py").write_text(
        "def test_kept():\n    pass\ndef test_plain():\n    pass\n"
        "def test_gone():\n    pass\n"
    )
    base = tmp_path / "base.json"
    cli = [sys.executable, "-m", "overlay_harness.upstream_tests", "record", "-q"]
    record = [*cli, "--tree", str(tree), "--python", sys.executable]
    record += ["--out", str(base), "--selection", "tests/test_n.py"]

    def run() -> str:
        r = subprocess.run(
            record,
            cwd=Path(ut.__file__).resolve().parent.parent,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    run()
    data = json.loads(base.read_text())
    hand = {"note": "set by hand", "outcome": "failed", "reason": "on purpose"}
    data["tests"]["tests/test_n.py::test_kept"] = hand
    data["tests"]["tests/test_n.py::test_gone"] = {**hand, "note": "gone soon"}
    base.write_text(json.dumps(data))
    (tree / "tests" / "test_n.py").write_text(
        "def test_kept():\n    pass\ndef test_plain():\n    pass\n"
    )
    out = run()
    tests = json.loads(base.read_text())["tests"]
    assert tests == {
        "tests/test_n.py::test_kept": hand,
        "tests/test_n.py::test_plain": {"outcome": "passed"},
    }
    assert json.loads(base.read_text())["meta"]["counts"]["failed"] == 1
    assert (
        "kept the note of tests/test_n.py::test_kept and its entry (failed; this "
        "run: passed): set by hand" in out
    )
    assert (
        "DROPPED the note of tests/test_n.py::test_gone: its test is gone: gone soon"
        in out
    )


def test_the_baselines_hand_set_entries_carry_notes() -> None:
    """What a re-record keeps is marked: every entry of the checked-in
    baseline whose reason says it was set on purpose has a note."""
    tests = ut.load_baseline(Path(ut.__file__).parents[1] / "upstream-baseline.json")
    on_purpose = {
        k for k, v in tests.tests.items() if "on purpose" in v.get("reason", "")
    }
    assert (
        on_purpose == {k for k, v in tests.tests.items() if "note" in v} and on_purpose
    )


def test_the_not_run_list_is_the_baseline_rendered() -> None:
    """docs/upstream-not-run-on-cpu.md is what `report` renders from the
    committed baseline: a re-recorded baseline fails here until the list is
    rendered again."""
    root = Path(__file__).resolve().parents[1]
    baseline = ut.load_baseline(root / "ci" / "upstream-baseline.json")
    doc = root / "docs" / "upstream-not-run-on-cpu.md"
    assert doc.read_text() == ut.render_report(baseline), (
        "render it: PYTHONPATH=ci python3 -m overlay_harness.upstream_tests "
        f"report --baseline ci/upstream-baseline.json --out {doc.relative_to(root)}"
    )
