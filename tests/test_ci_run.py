"""The CI-time report (``overlay_harness.ci_run``): steps as ``ci/test.sh``
writes them, and the JUnit XML of a real pytest run."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from overlay_harness import ci_run

STARTED = 1_000_000.0


def _steps(tmp_path: Path, *lines: tuple[float, str, str]) -> Path:
    path = tmp_path / "steps.tsv"
    path.write_text(
        "".join(f"{STARTED + t:.0f}\t{lane}\t{s}\n" for t, lane, s in lines)
    )
    return path


def test_a_step_lasts_until_the_next_of_its_lane(tmp_path: Path) -> None:
    rows = ci_run.read_rows(
        _steps(
            tmp_path,
            (60, "main", "build"),
            (300, "main", "project tests"),
            (310, "background", "upstream tests"),
            (1000, "background", "smoke"),
            (1200, "background", "end"),
            (2000, "main", "log"),
            (2001, "main", "end"),
        )
    )
    steps = ci_run.timed_steps(rows, STARTED)
    assert [(s["lane"], s["step"], s["start_s"], s["duration_s"]) for s in steps] == [
        ("main", "build", 60, 240),
        ("main", "project tests", 300, 1700),
        ("background", "upstream tests", 310, 690),
        ("background", "smoke", 1000, 200),
        ("main", "log", 2000, 1),
    ]


def test_a_lane_cut_short_lasts_until_the_last_line(tmp_path: Path) -> None:
    """A background lane stopped by an error writes no ``end``."""
    rows = ci_run.read_rows(
        _steps(
            tmp_path,
            (0, "main", "project tests"),
            (5, "background", "upstream tests"),
            (90, "main", "end"),
        )
    )
    assert ci_run.timed_steps(rows, STARTED)[1]["duration_s"] == 85


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "names no step"),
        ("12\tmain\n", ":1: '12\\tmain' is not 'SECONDS<TAB>LANE<TAB>STEP'"),
        ("10\tmain\tbuild\nsoon\tmain\tend\n", ":2: 'soon' is not a time"),
    ],
)
def test_a_bad_steps_file_names_file_and_line(
    tmp_path: Path, text: str, error: str
) -> None:
    path = tmp_path / "steps.tsv"
    path.write_text(text)
    with pytest.raises(ci_run.ReportError, match=str(path)) as e:
        ci_run.read_rows(path)
    assert error in str(e.value)


def test_record_ranks_the_modules_of_a_real_pytest_run(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_slow.py").write_text(
        textwrap.dedent(
            """
            import time

            def test_one():
                time.sleep(0.3)

            def test_two():
                time.sleep(0.3)
            """
        )
    )
    (tests / "test_quick.py").write_text("def test_quick():\n    pass\n")
    # One JUnit file per lane's pytest run; a lane that stopped before its
    # run wrote none.
    junits = [tmp_path / "main.xml", tmp_path / "background.xml"]
    for junit, module in zip(junits, ["test_slow.py", "test_quick.py"], strict=True):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                str(tests / module),
                "--junitxml",
                str(junit),
                "--rootdir",
                str(tmp_path),
            ],
            check=True,
            capture_output=True,
            cwd=tmp_path,
        )
    junits.append(tmp_path / "never-written.xml")
    steps = _steps(tmp_path, (3, "main", "project tests"), (40, "main", "end"))
    disk = tmp_path / "disk.tsv"
    gib = 2**20  # KiB
    disk.write_text(f"1\t{10 * gib}\n2\t{13 * gib}\n3\t{12 * gib}\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "wheel").write_bytes(b"\1" * 2**20)
    (cache / "same-wheel").hardlink_to(cache / "wheel")
    out = tmp_path / "ci-run.json"
    args = ["--steps", str(steps), "--disk", str(disk)]
    args += [arg for junit in junits for arg in ("--junit", str(junit))]
    args += ["--cache", str(cache), "--started", str(STARTED), "--cold", "yes"]
    assert ci_run.main(["record", *args, "--status", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["total_s"] == 40
    assert report["cold"] and report["passed"]
    modules = report["slowest_test_modules"]
    assert [m["module"] for m in modules] == [
        "tests/test_slow.py",
        "tests/test_quick.py",
    ]
    assert modules[0]["duration_s"] >= 0.6
    assert "took 0.7 minutes" in ci_run.headline(report)
    assert "within the 45-minute budget" in ci_run.headline(report)
    assert report["disk"] == {
        "samples": 3,
        "used_at_start_gib": 10.0,
        "peak_growth_gib": 3.0,
        "cache_gib": 0.0,  # 1 MiB, the hard link counted once
    }
    assert "up to 3.0 GiB of disk beyond the 10.0 GiB" in ci_run.disk_use(report)


def test_the_cache_is_measured_as_du_measures_it(tmp_path: Path) -> None:
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / "torch.so").write_bytes(b"\1" * 2**29)
    (tmp_path / "torch-again.so").hardlink_to(tmp_path / "venv" / "torch.so")
    (tmp_path / "link").symlink_to(tmp_path / "venv")
    assert ci_run.tree_gib(tmp_path) == 0.5


def test_a_bad_disk_file_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "disk.tsv"
    path.write_text("1\t100\n2\t\n")
    with pytest.raises(ci_run.ReportError, match="disk.tsv:2: '2\\\\t' is not"):
        ci_run.read_disk(path)
    path.write_text("")
    with pytest.raises(ci_run.ReportError, match="holds no sample"):
        ci_run.read_disk(path)


def test_record_of_a_bad_steps_file_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = tmp_path / "steps.tsv"
    steps.write_text("later\tmain\tbuild\n")
    out = tmp_path / "ci-run.json"
    args = ["record", "--steps", str(steps), "--disk", str(tmp_path / "disk.tsv")]
    args += ["--cache", str(tmp_path), "--started", "0", "--cold", "no"]
    assert ci_run.main([*args, "--status", "1", "--out", str(out)]) == 1
    assert "is not a time" in capsys.readouterr().err
    assert not out.exists() and not out.with_suffix(".tmp").exists()


def test_show_of_a_report_without_a_field_names_file_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "old.json"
    report.write_text(json.dumps({"commit": "abc", "total_s": 60.0}))
    assert ci_run.main(["show", str(report)]) == 1
    assert f"{report} has no field 'cores'" in capsys.readouterr().err
