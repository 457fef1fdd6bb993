"""Rebase: how the series fits other upstream releases, and moving it.

The dry run tries each patch alone on a fresh tree of the target release and
in sequence (a patch that fits with offset or fuzz, at most quilt's 2, is
applied so the next ones see it; a conflicting one is left out). Only the
files the series touches are laid, since a patch reads nothing else. The
result is a matrix of ``apply.Fit`` classes, with the file, hunk header and
next command of every conflict, printed for people and written as JSON for
machines. It only reports: nothing is moved by line number.

With ``--write`` the series is moved the way git moves commits
(``workspace.rebase_workspace``): ``build/rebase/VERSION/workspace`` holds
the pinned release, one commit per patch and the new release, and ``git
rebase --onto`` replays each patch by a 3-way merge whose base is the
pinned release; a conflict stops with markers for a human (``ci/overlay
workspace --continue``). The finished tree is then checked by running code
(``check_rebased``: compile, ruff with upstream's config and F821), each
problem named by its patch; ``export`` writes ``rebased/patches`` next to
the release's ``pin.toml`` and a copy of the overlay; ``ci/overlay
rebase-test VERSION`` (gate.py) builds that with the release's wheel and
runs the overlay's tests on it, and ``ci/overlay adopt VERSION`` (adopt.py)
checks again, requires those tests' pass, and puts them in place. Nothing is
ever deleted there: a second ``--write`` refuses while earlier work would
be lost.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay import apply, rebase_state, workspace
from vllm_overlay.errors import OverlayError
from vllm_overlay.fetch import cache_local, default_index_url, fetch, list_files
from vllm_overlay.paths import Layout
from vllm_overlay.pin import Pin, PinnedFile, load_pin, release_files
from vllm_overlay.series import Patch, load_series
from vllm_overlay.source import extract_sdist, lay_scratch_tree
from vllm_overlay.venv import tool_venv

_NEEDS_HUMAN = {apply.Fit.CONFLICT, apply.Fit.TARGET_GONE}
_VERSION_FILE = "vllm/_version.py"
_FAILED_HUNK = re.compile(r"^Hunk #(\d+) FAILED", re.M)

# What the static check says when it finds nothing.
CHECKED = "rebased series checked (compiles, ruff clean)"


@dataclass(frozen=True)
class Release:
    version: str
    sdist: PinnedFile
    wheel: PinnedFile | None


@dataclass(frozen=True)
class PatchFit:
    alone: apply.FitReport
    in_sequence: apply.FitReport
    # (file, hunk header) of each hunk that fails, where the patch conflicts
    failed_hunks: tuple[tuple[str, str], ...] = field(default=())


def find_release(
    version: str,
    wheel_tag: str,
    index_url: str | None = None,
    project: str = "vllm",
) -> Release:
    """Name and sha256 of a release's files, as the index lists them: the
    sdist of vllm, the wheel of ``project`` (the pin's wheel project)."""
    index_url = index_url or default_index_url()
    entries = {e["filename"]: e for e in list_files(index_url, "vllm")}
    if project != "vllm":
        entries.update((e["filename"], e) for e in list_files(index_url, project))

    def pinned(filename: str) -> PinnedFile | None:
        entry = entries.get(filename)
        if entry is None or "sha256" not in entry.get("hashes", {}):
            return None
        return PinnedFile(filename, entry["hashes"]["sha256"])

    sdist_name, wheel_name = release_files(version, wheel_tag, project)
    sdist = pinned(sdist_name)
    if sdist is None:
        raise OverlayError(
            f"the package index has no sdist for vllm {version}",
            "check the version number",
        )
    return Release(version, sdist, pinned(wheel_name))


def _indexed_release(
    version: str, wheel_tag: str, project: str, command: str, downloads: Path
) -> Release:
    """``find_release``, whose failure to reach the index says how to give
    the release's files instead: put in the download cache under their
    release names, where the command it prints finds them."""
    try:
        return find_release(version, wheel_tag, project=project)
    except OverlayError as e:
        sdist, wheel = (
            downloads / name for name in release_files(version, wheel_tag, project)
        )
        given = shlex.join(["--sdist", str(sdist), "--wheel", str(wheel)])
        raise OverlayError(
            e.what,
            "check network access to the package index, or put the release's "
            f"sdist and wheel in {downloads} and run "
            f"`{command} rebase-check {version} {given}`",
        ) from None


def local_release(
    version: str,
    wheel_tag: str,
    project: str,
    sdist: Path,
    wheel: Path | None,
    downloads: Path,
) -> Release:
    """A release from files on disk instead of the index (``cache_local``):
    vLLM's sdist and, for ``--write``, the pin's wheel project's wheel."""
    sdist_name, wheel_name = release_files(version, wheel_tag, project)
    return Release(
        version,
        cache_local(sdist, sdist_name, downloads),
        None if wheel is None else cache_local(wheel, wheel_name, downloads),
    )


def extract_files(sdist: Path, files: set[str], dest: Path) -> None:
    """Only ``files`` (tree-relative) of an sdist, as ``dest``."""
    dest.mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        for member in archive:
            rel = member.name.partition("/")[2]
            if rel in files and member.isfile():
                member.name = rel
                archive.extract(member, dest, filter="data")


def failed_hunks(tree: Path, patch: Patch) -> tuple[tuple[str, str], ...]:
    """The file and ``@@`` header of every hunk of ``patch`` that fails on
    ``tree`` even with fuzz (patch numbers hunks per file, so each file's
    part of the diff is tried on its own)."""
    failed = []
    for target, section in apply.file_sections(patch.path.read_text()):
        result = subprocess.run(
            [
                "patch",
                "-p1",
                "--batch",
                "--forward",
                "--dry-run",
                f"--fuzz={apply.MAX_FUZZ}",
                "-d",
                str(tree),
            ],
            input=section,
            capture_output=True,
            text=True,
        )
        headers = [line for line in section.splitlines() if line.startswith("@@")]
        for number in _FAILED_HUNK.findall(result.stdout + result.stderr):
            failed.append((target, headers[int(number) - 1]))
    return tuple(failed)


def fit_series(
    pristine: Path, patches: list[Patch], scratch: Path
) -> dict[str, PatchFit]:
    """Classify every patch alone and in sequence on copies of ``pristine``."""
    sequence = scratch / "sequence"
    shutil.copytree(pristine, sequence, symlinks=True)
    fits: dict[str, PatchFit] = {}
    for patch in patches:
        alone_tree = scratch / "alone"
        shutil.copytree(pristine, alone_tree, symlinks=True)
        alone = apply.classify(alone_tree, patch)
        in_sequence = apply.classify(sequence, patch)
        hunks: tuple[tuple[str, str], ...] = ()
        if in_sequence.fit is apply.Fit.CONFLICT:
            hunks = failed_hunks(sequence, patch)
        elif alone.fit is apply.Fit.CONFLICT:
            hunks = failed_hunks(alone_tree, patch)
        shutil.rmtree(alone_tree)
        if in_sequence.fit not in _NEEDS_HUMAN | {apply.Fit.ALREADY_UPSTREAM}:
            apply.apply_loosely(sequence, patch)
        fits[patch.name] = PatchFit(alone, in_sequence, hunks)
    shutil.rmtree(sequence)
    return fits


def matrix(
    results: dict[str, dict[str, PatchFit]],
    names: list[str],
    next_command: dict[str, str] | None = None,
) -> str:
    """Patches x versions; a cell is 'alone / in sequence' when they differ.
    Below it, each conflict's file and hunk header and the command to run
    next (``next_command`` by version)."""
    versions = list(results)

    def cell(fit: PatchFit) -> str:
        a, s = fit.alone.fit.value, fit.in_sequence.fit.value
        return a if a == s else f"{a} / {s}"

    rows = [["patch", *versions]] + [
        [name, *(cell(results[v][name]) for v in versions)] for name in names
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for version in versions:
        for name in names:
            fit = results[version][name]
            if fit.failed_hunks:
                lines.append(f"{version} {name}: conflict")
                lines += [f"  {file}  {header}" for file, header in fit.failed_hunks]
            elif fit.in_sequence.fit is apply.Fit.TARGET_GONE:
                lines.append(
                    f"{version} {name}: target file gone: {fit.in_sequence.detail}"
                )
            else:
                continue
            if next_command and version in next_command:
                lines.append(f"  next: {next_command[version]}")
    return "\n".join(lines)


def report(
    releases: dict[str, Release], results: dict[str, dict[str, PatchFit]]
) -> dict[str, object]:
    def fit_json(r: apply.FitReport) -> dict[str, str]:
        return {"fit": r.fit.value, "detail": r.detail}

    return {
        version: {
            "sdist": {
                "filename": releases[version].sdist.filename,
                "sha256": releases[version].sdist.sha256,
            },
            "patches": {
                name: {
                    "alone": fit_json(f.alone),
                    "in_sequence": fit_json(f.in_sequence),
                    "failed_hunks": [
                        {"file": file, "header": header}
                        for file, header in f.failed_hunks
                    ],
                }
                for name, f in fits.items()
            },
        }
        for version, fits in results.items()
    }


def _commit_short(tree: Path) -> str:
    text = (tree / "vllm" / "_version.py").read_text()
    match = re.search(r"commit_id = '?g?([0-9a-f]+)", text)
    return match.group(1) if match else ""


def _minor(version: str) -> tuple[str, ...]:
    """A torch version's major.minor (``2.14.1+cpu`` -> ("2", "14"))."""
    return tuple(re.findall(r"\d+", version)[:2])


def rebased_pin(
    pin: Pin, release: Release, tree: Path, today: dt.date
) -> tuple[str, list[str]]:
    """pin.toml's text for ``release`` (its unpacked sdist at ``tree``): the
    same file with the new tag, version, files and sha256, ``source_date``
    ``today`` (the day the pin changes), the old version and commit renamed
    in comments too, and the torch pins: the official wheel's from the
    release's own requirement file; the build venv's kept, with its comment,
    while it is the same minor release as the release's build requirement
    (any CUDA build of that minor builds the wheel, and the checkout's
    choice has its reasons), else the release's. With one note per torch
    pin saying where it came from, and one listing the comments renamed,
    for the maintainer to read."""
    assert release.wheel is not None
    text = pin.path.read_text()
    new_commit_short = _commit_short(tree)
    for old, new in (
        (f'tag = "{pin.tag}"', f'tag = "v{release.version}"'),
        (f'commit = "{pin.commit}"', 'commit = ""'),
        (
            f'commit_short = "{pin.commit_short}"',
            f'commit_short = "{new_commit_short}"',
        ),
        (
            f'source_date = "{pin.source_date}"',
            f'source_date = "{today.isoformat()}"',
        ),
        (pin.sdist.filename, release.sdist.filename),
        (pin.sdist.sha256, release.sdist.sha256),
        (pin.wheel.filename, release.wheel.filename),
        (pin.wheel.sha256, release.wheel.sha256),
    ):
        text = text.replace(old, new)
    # The official wheel's torch is its platform's runtime requirement; the
    # build venv's is what vLLM's setup.py builds the CUDA wheel with.
    device = "cpu" if pin.wheel_project.endswith("-cpu") else "cuda"
    sources = {
        "upstream.wheel": f"requirements/{device}.txt",
        "build": "requirements/build/cuda.txt",
    }
    machine = pin.wheel_tag.split("_", 3)[-1]
    pins = {
        table: (_torch_requirement(tree / rel, machine), rel)
        for table, rel in sources.items()
    }
    build_value, build_rel = pins["build"]
    keep_build = _minor(pin.build_torch) == _minor(build_value)
    if keep_build:
        del pins["build"]
    lines: list[str] = []
    table = ""
    for line in text.splitlines():
        if header := re.match(r"^\[(.+)\]\s*$", line):
            table = header.group(1)
        elif table in pins and re.match(r"^torch\s*=", line):
            while lines and lines[-1].startswith("#"):
                lines.pop()  # the old release's reasons
            value, rel = pins[table]
            lines.append(
                f"# requirements of vllm {release.version}: {rel} "
                "(written by rebase-check --write)"
            )
            line = f'torch = "{value}"'
        lines.append(line)
    # What is left of the old release, once the torch pins' old comments are
    # gone: `version = "..."` and the comments that name it or its commit
    # ("the release's vllm/_version.py records").
    renamed: list[str] = []
    for i, line in enumerate(lines):
        new_line = line.replace(pin.version, release.version)
        if pin.commit_short:
            new_line = new_line.replace(pin.commit_short, new_commit_short)
        if new_line != line and line.lstrip().startswith("#"):
            renamed.append(new_line.strip())
        lines[i] = new_line
    notes = [
        f"[{table}] torch = {value!r}, from {rel} of {release.sdist.filename}"
        for table, (value, rel) in pins.items()
    ]
    build = f"{build_rel} of {release.sdist.filename} asks {build_value!r}"
    if keep_build:
        notes.append(
            f"[build] torch = {pin.build_torch!r} kept, with its comment: "
            f"{build}, the same minor release"
        )
    else:
        notes[-1] += (
            f": the minor release differs from the checkout's "
            f"{pin.build_torch!r}, whose comment was replaced"
        )
    if renamed:
        notes.append(
            f"{len(renamed)} comment line(s) named {pin.version} or its commit "
            "and now name the new release; read that each still holds: "
            + " | ".join(renamed)
        )
    return "\n".join(lines) + "\n", notes


def _torch_requirement(requirements: Path, machine: str) -> str:
    """The ``torch==X`` of a requirements file that holds on ``machine``."""
    for line in requirements.read_text().splitlines():
        if match := re.match(r"^torch==(\S+?)\s*(?:;(.*))?$", line.strip()):
            marker = match.group(2) or ""
            if not marker or f'platform_machine == "{machine}"' in marker:
                return match.group(1)
    raise OverlayError(
        f"{requirements}: no torch==VERSION line for {machine}",
        f"set both torch pins of the rebased pin.toml by hand from {requirements}",
    )


def write_rebased(
    layout: Layout, release: Release, sdist: Path, patches: list[Patch]
) -> str | None:
    """The series moved onto the release by ``git rebase`` in a workspace,
    with the release's pin and a copy of the target's overlay beside it.
    Returns why it stopped (None: rebased and checked; export is next)."""
    pin = load_pin(layout.pin)
    version_dir = rebase_state.version_dir(layout, release.version)
    ws = rebase_state.workspace_dir(layout, release.version)
    rebased = rebase_state.rebased_dir(layout, release.version)
    if ws.exists():  # refuse_to_overwrite found nothing unsaved in it
        shutil.rmtree(ws)
    (rebased / "patches").mkdir(parents=True)
    # export keeps a series file's comments: the checkout's go along.
    (rebased / "patches" / "series").write_text(
        "".join(
            line
            for line in (layout.patches / "series").read_text().splitlines(True)
            if line.startswith("#")
        )
    )
    if layout.overlay.is_dir():
        shutil.copytree(layout.overlay, rebased / "overlay", symlinks=True)
    rebase_state.record_source(layout, release.version)
    lay_scratch_tree(layout.root, pin, layout.downloads, ws)
    with tempfile.TemporaryDirectory(dir=version_dir, prefix=".release-") as tmp:
        new_tree = Path(tmp) / "tree"
        extract_sdist(sdist, new_tree)
        text, notes = rebased_pin(
            pin, release, new_tree, dt.datetime.now(dt.UTC).date()
        )
        (rebased / "pin.toml").write_text(text)
        for note in notes:
            print(f"  {rebased / 'pin.toml'}: {note}", file=sys.stderr)
        try:
            workspace.rebase_workspace(
                ws,
                patches,
                new_tree,
                rebased / "patches",
                layout.target,
                layout.command,
            )
        except OverlayError as e:
            return f"{e.what}\n  next: {e.next_step}"
    try:
        check(layout, ws, None)
    except OverlayError as e:
        return f"{e.what}\n  next: {e.next_step}"
    rebase_state.record_check(layout, release.version)
    return None


PRE_COMMIT_CONFIG = ".pre-commit-config.yaml"
_RUFF_HOOKS = "astral-sh/ruff-pre-commit"
_VERSION = re.compile(r"v?(\d+(?:\.\d+)+)")


def pinned_ruff(tree: Path) -> str:
    """The ruff version an upstream tree pins for its own checks: the
    ``rev:`` of the astral-sh/ruff-pre-commit entry of its
    .pre-commit-config.yaml, a tag (``v0.14.0``) or a commit frozen with
    its tag in a comment (``rev: SHA  # frozen: v0.17.2``)."""
    config = tree / PRE_COMMIT_CONFIG
    hint = (
        "pass --python with a python whose ruff is the version upstream uses "
        "(`PY -m ruff --version`)"
    )
    try:
        lines = config.read_text().splitlines()
    except OSError as e:
        raise OverlayError(
            f"{config}: cannot read it ({e.strerror}), so which ruff upstream "
            "checks its code with is unknown",
            hint,
        ) from e
    for i, line in enumerate(lines):
        if re.match(r"^\s*-?\s*repo:", line) and _RUFF_HOOKS in line:
            for entry in lines[i + 1 :]:
                if re.match(r"^\s*-?\s*repo:", entry):
                    break
                if rev := re.match(r"^\s*rev:\s*(.*)$", entry):
                    value, _, comment = rev.group(1).partition("#")
                    frozen = re.match(r"\s*frozen:\s*(\S+)", comment)
                    for text in (value.strip().strip("'\""), frozen and frozen[1]):
                        if text and (version := _VERSION.fullmatch(text)):
                            return version.group(1)
                    raise OverlayError(
                        f"{config}: the {_RUFF_HOOKS} entry's {entry.strip()!r} "
                        "names no ruff version (vX.Y.Z, or a commit with "
                        "'# frozen: vX.Y.Z')",
                        hint,
                    )
            break
    raise OverlayError(
        f"{config}: no {_RUFF_HOOKS} entry with a rev:, so which ruff upstream "
        "checks its code with is unknown",
        hint,
    )


def ruff_python(layout: Layout, tree: Path) -> Path:
    """The python of a small cached venv that holds only the ruff ``tree``
    pins (``.cache/ruff-env-*``): upstream's checks, without a test venv."""
    version = pinned_ruff(tree)
    return tool_venv(
        layout.cache, "ruff-env", f"ruff=={version}", layout.logs / "ruff-env.log"
    )


def checker_python(layout: Layout, given: Path | None, tree: Path) -> Path:
    """The python that checks a rebased ``tree``: ``given``, or one with the
    ruff the tree's .pre-commit-config.yaml pins (``ruff_python``)."""
    return given if given is not None else ruff_python(layout, tree)


_COMPILE = """\
import sys
for name in sys.argv[1:]:
    try:
        compile(open(name, "rb").read(), name, "exec", dont_inherit=True)
    except SyntaxError as e:
        print(f"{name}:{e.lineno}:{e.offset}: SyntaxError: {e.msg}")
"""
_FINDING = re.compile(r"^(?P<file>[^:\s]+\.py):(?P<line>\d+):(?:\d+:)? (?P<what>.+)$")


def static_findings(root: Path, files: list[str], python: Path) -> list[str]:
    """What the static check prints for ``files`` (relative to ``root``), a
    line per finding: each must compile (``python``'s compiler), and pass
    ``python -m ruff check`` with the configuration ruff finds from ``root``
    (upstream's pyproject.toml), undefined names (F821) selected whatever
    it says. The mutation suite's merge set runs exactly this
    (ci/bench/mutation.py)."""
    findings = []
    for command in (
        [str(python), "-c", _COMPILE],
        [str(python), "-m", "ruff", "check", "--no-cache", "--extend-select=F821"]
        + ["--quiet", "--output-format=concise"],
    ):
        result = subprocess.run(
            [*command, *files], cwd=root, capture_output=True, text=True
        )
        findings += [
            line.strip()
            for line in (result.stdout + result.stderr).splitlines()
            if line.strip()
        ]
    return findings


def check_rebased(ws: Path, python: Path) -> list[tuple[str, str]]:
    """(patch, problem) for each problem of the rebased code, the patch
    being the one that wrote the line ("" where none can be named): every
    Python file the series changes must compile and pass ruff with
    upstream's configuration (the tree's own pyproject.toml), undefined
    names (F821) selected whatever that configuration says, and ruff's
    format check, as ``lint-upstream`` runs them. A finding on a line the
    series did not write is upstream's own and not counted."""
    base = workspace.git(ws, "rev-list", "--max-parents=0", "HEAD").split()[0]
    files = [
        f
        for f in workspace.git(ws, "diff", "--name-only", base, "HEAD").split()
        if f.endswith(".py") and (ws / f).is_file()
    ]
    if not files:
        return []
    ruff = [str(python), "-m", "ruff"]
    problems = []
    for line in static_findings(ws, files, python):
        if match := _FINDING.match(line):
            patch = _blame(ws, match["file"], int(match["line"]), base)
            if patch is not None:
                problems.append((patch, line))
        else:
            problems.append(("", line))
    result = subprocess.run(
        [*ruff, "format", "--no-cache", "--check", *files],
        cwd=ws,
        capture_output=True,
        text=True,
    )
    for line in (result.stdout + result.stderr).splitlines():
        if line.startswith("Would reformat: "):
            rel = line.removeprefix("Would reformat: ").strip()
            problems.append(
                (
                    ", ".join(_patches_of(ws, rel, base)),
                    f"{rel}: not as ruff formats it (upstream's config)",
                )
            )
    return problems


def _blame(ws: Path, rel: str, line: int, base: str) -> str | None:
    """The patch (commit subject) that wrote ``line`` of ``rel``; None for
    a line of the release itself."""
    porcelain = workspace.git(
        ws, "blame", "--porcelain", "-L", f"{line},{line}", "HEAD", "--", rel
    )
    commit = porcelain.split(" ", 1)[0]
    if commit == base:
        return None
    return workspace.git(ws, "log", "-1", "--format=%s", commit).strip()


def _patches_of(ws: Path, rel: str, base: str) -> list[str]:
    return workspace.git(
        ws, "log", "--reverse", "--format=%s", f"{base}..HEAD", "--", rel
    ).split()


def next_steps(layout: Layout, version: str) -> str:
    """The commands that come next for the rebase of ``version``, in the
    state it is in: export while its workspace holds commits that
    ``rebased/patches`` lacks, the overlay's tests until they passed on
    exactly that ``rebased/``, then adopt."""
    ws = rebase_state.workspace_dir(layout, version)
    test = f"`{layout.command} rebase-test {version}`"
    adopt_it = f"`{layout.command} adopt {version}`"
    if missing := rebase_state.unexported(layout, version):
        return (
            f"`{layout.command} export --dir {ws}` (not yet in rebased/patches: "
            f"{', '.join(missing)}), then the overlay's tests on it: {test}, "
            f"then {adopt_it}"
        )
    if not rebase_state.passed(layout, version):
        return f"the overlay's tests on the exported series: {test}, then {adopt_it}"
    return f"{adopt_it} (the overlay's tests passed on exactly this rebase)"


def finish(layout: Layout, ws: Path, version: str, python: Path | None) -> str:
    """Check the finished rebase in ``ws`` by running code; raise naming
    each problem and its patch, else say so and what comes next."""
    checked = check(layout, ws, python)
    rebase_state.record_check(layout, version)
    return f"{checked}; next: {next_steps(layout, version)}"


def check_once(layout: Layout, version: str, python: Path | None) -> str:
    """The static check of the exported rebase of ``version``, unless it
    already passed on its workspace as it is: once per cycle, whether
    rebase-test or adopt comes first."""
    ws = rebase_state.check_exported(layout, version)
    if rebase_state.checked(layout, version):
        return f"{CHECKED}\n  (recorded: they passed on {ws} as it is)"
    checked = check(layout, ws, python)
    rebase_state.record_check(layout, version)
    return checked


def check(layout: Layout, ws: Path, python: Path | None) -> str:
    """Check the finished rebase in ``ws`` by running code; raise naming
    each problem and its patch, else say that it passed."""
    checker = checker_python(layout, python, ws)
    if problems := check_rebased(ws, checker):
        base = workspace.git(ws, "rev-list", "--max-parents=0", "HEAD").split()[0]
        first = next((p.split(", ")[-1] for p, _ in problems if p), "")
        fold = (
            f"fold each fix into the patch it names, e.g. for {first}: `git -C {ws} "
            f"commit -a --fixup=:/^{first} && GIT_SEQUENCE_EDITOR=true git -C {ws} "
            f"rebase -q -i --autosquash {base}`, then "
            if first
            else ""
        )
        raise OverlayError(
            f"the series rebased in {ws} fails its checks ({checker} -m ruff, "
            "upstream's config, F821 selected):\n  "
            + "\n  ".join(f"{p}: {what}" if p else what for p, what in problems),
            f"fix them in {ws}; {fold}`{workspace.continue_hint(ws)}`",
        )
    return CHECKED


def dry_run(
    layout: Layout,
    versions: list[str],
    json_out: Path,
    write: bool,
    local: tuple[Path, Path | None] | None = None,
) -> int:
    """``rebase-check``: each release from the index, or the one release of
    ``versions`` from ``local`` (its sdist and wheel on disk)."""
    pin = load_pin(layout.pin)
    patches = load_series(layout.patches)
    work = layout.build / "rebase"
    command = layout.command
    releases: dict[str, Release] = {}
    results: dict[str, dict[str, PatchFit]] = {}
    stops: dict[str, str | None] = {}
    next_command: dict[str, str] = {}
    touched = {t for p in patches for t in p.targets} | {_VERSION_FILE}
    if write:  # before any download: what would be lost
        for version in versions:
            rebase_state.refuse_to_overwrite(layout, version)
    if local is not None and len(versions) != 1:
        raise OverlayError(
            f"--sdist names one release's files, and {len(versions)} versions "
            "were given",
            "run rebase-check once per release given by files",
        )
    for version in versions:
        release = (
            local_release(
                version, pin.wheel_tag, pin.wheel_project, *local, layout.downloads
            )
            if local is not None
            else _indexed_release(
                version, pin.wheel_tag, pin.wheel_project, command, layout.downloads
            )
        )
        if write and release.wheel is None:
            raise OverlayError(
                f"no {pin.wheel_tag} wheel of {pin.wheel_project} {version} on "
                "the package index" + (" or given (--wheel)" if local else ""),
                "pick a release with a wheel, give its file with --wheel, or run "
                "without --write",
            )
        releases[version] = release
        sdist = fetch(release.sdist, layout.downloads)
        print(
            f"  {version}: {release.sdist.filename} sha256 {release.sdist.sha256}",
            file=sys.stderr,
        )
        work.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=work, prefix=f".{version}-") as tmp:
            pristine = Path(tmp) / "pristine"
            extract_files(sdist, touched, pristine)
            results[version] = fit_series(pristine, patches, Path(tmp))
        ws = rebase_state.workspace_dir(layout, version)
        if write:
            stops[version] = write_rebased(layout, release, sdist, patches)
            next_command[version] = (
                workspace.continue_hint(ws)
                if stops[version]
                else f"{command} export --dir {ws}"
            )
        else:
            next_command[version] = f"{command} rebase-check {version} --write"
    print(matrix(results, [p.name for p in patches], next_command))
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(
        json.dumps(report(releases, results), indent=2, sort_keys=True) + "\n"
    )
    for version, stop in stops.items():
        rebased = rebase_state.rebased_dir(layout, version)
        ws = rebase_state.workspace_dir(layout, version)
        if stop is None:
            print(
                f"{version}: series rebased and checked in {ws}\n  next: "
                f"`{command} export --dir {ws}` writes {rebased / 'patches'}",
                file=sys.stderr,
            )
        else:
            print(
                f"{version}: {ws} stopped: {stop}\n  then: `{command} export "
                f"--dir {ws}` writes {rebased / 'patches'}",
                file=sys.stderr,
            )
        print(
            f"{version}: {rebased / 'pin.toml'} takes the official wheel's torch "
            "pin from the release's requirement files (the build checks the "
            "wheel's own Requires-Dist) and [build] torch as said above; once "
            "exported, test it with the release's wheel: "
            f"`{command} rebase-test {version}`, then adopt it: `{command} adopt "
            f"{version}`",
            file=sys.stderr,
        )
    return 0
