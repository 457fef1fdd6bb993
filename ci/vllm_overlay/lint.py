"""``ci/overlay lint``: every check that needs no build, in well under a
minute, so that CI (``.ci/run``) and pre-commit fail on a typo before
forty minutes of builds and tests.

In order: each target's series and DEP-3 headers, the tracked files that
name a release other than the pin's, links between the docs, then the
tools (ruff on ci/ and tests/, mypy on the build line, shellcheck). The
harness and benchmarks are type-checked later in the test run, against the
engine they drive (docs/testing.md).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from vllm_overlay import series, source
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout, target_layout
from vllm_overlay.pin import load_pin
from vllm_overlay.venv import ensure_venv

# Written by a command, or records of what a run showed at the time.
NOT_HAND_WRITTEN = frozenset(
    {"CHANGELOG.md", "docs/mutation.md", "docs/upstream-not-run-on-cpu.md"}
)
SHELL_SCRIPTS = ("build.sh", "ci/*.sh", "ci/overlay", "ci/bench/*.sh", ".ci/run")


def target_names(root: Path) -> list[str]:
    """The main target ("") and each ``targets/NAME/pin.toml``."""
    return ["", *sorted(p.parent.name for p in (root / "targets").glob("*/pin.toml"))]


def series_problems(root: Path) -> list[str]:
    """Every target's series against its files, and each patch's header."""
    return [
        f"{patch.path}: {problem}"
        for target in target_names(root)
        for patch in series.load_series(target_layout(root, target).patches)
        for problem in series.header_problems(patch) + series.diff_problems(patch)
    ]


def stale_version_problems(root: Path) -> list[str]:
    """``.gitmodules`` must track the release pin.toml pins: a rebase that
    forgot it leaves the submodule on the release before."""
    tag = load_pin(root / "pin.toml").tag
    branches = source.submodule_branches(root)
    if branches == [tag]:
        return []
    return [
        f"{root / '.gitmodules'} tracks {branches}, pin.toml pins {tag}: set "
        f'`branch = {tag}` under [submodule "upstream"]'
    ]


def hand_written_docs(root: Path) -> dict[str, str]:
    """The docs people write (not docs/benchmarks/, rendered from reports),
    by path relative to ``root``."""
    docs = [root / "README.md", root / "SECURITY.md", *(root / "docs").rglob("*.md")]
    return {
        rel: p.read_text()
        for p in docs
        if (rel := p.relative_to(root).as_posix()) not in NOT_HAND_WRITTEN
        and not rel.startswith("docs/benchmarks/")
    }


def heading_anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def broken_links(root: Path) -> list[str]:
    """Relative links in the docs (and CHANGELOG.md) to a file or heading
    that does not exist."""
    docs = hand_written_docs(root)
    docs["CHANGELOG.md"] = (root / "CHANGELOG.md").read_text()
    broken = []
    for rel, text in docs.items():
        here = (root / rel).parent
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (here / path).resolve() if path else root / rel
            if not file.exists():
                broken.append(f"{rel}: link to {target}: no such file")
            elif anchor and file.suffix == ".md":
                titles = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
                if anchor not in {heading_anchor(t) for t in titles}:
                    broken.append(f"{rel}: link to {target}: no such heading")
    return broken


def tool_runs(layout: Layout) -> list[list[str]]:
    """The linters' command lines, run from the checkout's root: ruff and
    mypy from a small cached venv (``ci/requirements-lint.txt``)."""
    python = str(
        ensure_venv(
            layout.cache,
            "lint-env",
            [],
            layout.lint_requirements,
            layout.logs / "lint-env.log",
        )
    )
    scripts = sorted(
        p.relative_to(layout.root).as_posix()
        for pattern in SHELL_SCRIPTS
        for p in layout.root.glob(pattern)
    )
    return [
        [python, "-m", "ruff", "check", "ci", "tests"],
        [python, "-m", "ruff", "format", "--check", "ci", "tests"],
        [python, "-m", "mypy", "ci/vllm_overlay"],
        ["shellcheck", "-x", *scripts],
    ]


def lint(layout: Layout) -> str:
    """Run every check; raise with all that failed."""
    root = layout.root
    problems = series_problems(root) + stale_version_problems(root)
    problems += broken_links(root)
    if problems:
        raise OverlayError(
            "\n".join(problems),
            "fix each as it says; a patch in `ci/overlay workspace`, then "
            "`ci/overlay export` (docs/maintainers.md, recipe 2)",
        )
    if shutil.which("shellcheck") is None:
        raise OverlayError(
            "shellcheck is not installed", "install it: apt-get install shellcheck"
        )
    failed = []
    for cmd in tool_runs(layout):
        result = subprocess.run(
            cmd, cwd=root, capture_output=True, text=True, check=False
        )
        if result.returncode:
            failed.append(
                f"$ {' '.join(cmd[2:] if cmd[1] == '-m' else cmd)}\n"
                f"{result.stdout}{result.stderr}".rstrip()
            )
    if failed:
        raise OverlayError(
            "\n".join(failed),
            "fix the findings above (`ruff format ci tests` rewrites the "
            "format), then run `ci/overlay lint` again",
        )
    return "lint ok: series, versions, doc links, ruff, mypy, shellcheck"
