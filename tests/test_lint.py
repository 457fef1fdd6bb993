"""`ci/overlay lint`, the first step of CI and the pre-commit hook: every
check that needs no build, run as a maintainer runs it, on this checkout and
on copies with one mistake each."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from vllm_overlay.paths import Layout, copy_checkout


def lint(checkout: Layout) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(checkout.root / "ci" / "overlay"), "lint"],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def checkout(tmp_path: Path) -> Layout:
    """A copy of this checkout's tracked files; its lint venv is the cache's."""
    return copy_checkout(REPO, tmp_path / "checkout", REPO.cache)


def test_this_checkout_is_clean() -> None:
    result = lint(REPO)
    assert result.returncode == 0, result.stderr
    assert "lint ok" in result.stdout


def test_a_link_to_a_missing_heading_is_named(checkout: Layout) -> None:
    guide = checkout.root / "docs" / "operators.md"
    guide.write_text(guide.read_text() + "\nSee [x](testing.md#no-such-heading).\n")
    result = lint(checkout)
    assert result.returncode == 1
    assert (
        "docs/operators.md: link to testing.md#no-such-heading: no such heading"
        in result.stderr
    )


def test_each_tool_reports_its_finding(checkout: Layout) -> None:
    """ruff, mypy (on the build line) and shellcheck each fail the run and
    name the file; none hides another."""
    (checkout.root / "ci" / "vllm_overlay" / "mistakes.py").write_text(
        'import os\n\n\ndef count() -> int:\n    return "one"\n'
    )
    (checkout.root / "ci" / "mistake.sh").write_text("#!/bin/sh\necho $1\n")
    result = lint(checkout)
    assert result.returncode == 1
    err = result.stderr
    assert "F401" in err and "ci/vllm_overlay/mistakes.py" in err  # ruff
    assert "Would reformat" not in err  # the file is formatted
    assert 'Incompatible return value type (got "str", expected "int")' in err
    assert "SC2086" in err and "ci/mistake.sh" in err  # shellcheck
