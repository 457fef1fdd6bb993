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
import shlex
import shutil
import subprocess
from pathlib import Path

from vllm_overlay import series, source
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout, target_layout, target_names
from vllm_overlay.pin import load_pin
from vllm_overlay.venv import ensure_venv

# Written by a command, or records of what a run showed at the time.
NOT_HAND_WRITTEN = frozenset(
    {"CHANGELOG.md", "docs/mutation.md", "docs/upstream-not-run-on-cpu.md"}
)
SHELL_SCRIPTS = ("build.sh", "ci/*.sh", "ci/overlay", "ci/bench/*.sh", ".ci/run")


def series_problems(root: Path) -> dict[str, list[str]]:
    """Per target with any, what is wrong with its series against its files
    and with each patch's header."""
    problems = {}
    for target in target_names(root):
        found = [
            f"{patch.path}: {problem}"
            for patch in series.load_series(target_layout(root, target).patches)
            for problem in series.header_problems(patch) + series.diff_problems(patch)
        ]
        if found:
            problems[target] = found
    return problems


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


def tool_runs(layout: Layout, python: str) -> list[list[str]]:
    """The linters' command lines, run from the checkout's root: ruff and
    mypy of ``python``, shellcheck."""
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
    per_target = series_problems(root)
    problems = [p for found in per_target.values() for p in found]
    problems += stale_version_problems(root) + broken_links(root)
    if problems:
        # A patch is mended in its target's workspace (maintainers.md,
        # recipe 2); every other problem says its own fix.
        commands = [Layout(root, target).command for target in per_target]
        raise OverlayError(
            "\n".join(problems),
            "fix each as it says"
            + "".join(
                f"; a patch of {command}'s series in `{command} workspace`, then "
                f"`{command} export`"
                for command in commands
            )
            + "; then `ci/overlay lint` again",
        )
    if shutil.which("shellcheck") is None:
        raise OverlayError(
            "shellcheck is not installed", "install it: apt-get install shellcheck"
        )
    python = str(
        ensure_venv(
            layout.cache,
            "lint-env",
            [],
            layout.lint_requirements,
            layout.logs / "lint-env.log",
        )
    )
    failed = []
    for cmd in tool_runs(layout, python):
        result = subprocess.run(
            cmd, cwd=root, capture_output=True, text=True, check=False
        )
        if result.returncode:
            failed.append(
                f"$ {shlex.join(cmd)}\n{result.stdout}{result.stderr}".rstrip()
            )
    if failed:
        raise OverlayError(
            "\n".join(failed),
            "fix the findings above (`"
            + shlex.join([python, "-m", "ruff", "format", "ci", "tests"])
            + "` rewrites the format), then `ci/overlay lint` again",
        )
    return "lint ok: series, versions, doc links, ruff, mypy, shellcheck"
