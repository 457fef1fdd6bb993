"""The maintainer's workspace: the series as git commits, and back.

``make_workspace`` lays the pinned tree in a workspace directory as a git
repository: one base commit, then one commit per patch whose message is the
patch's file name, a blank line and its DEP-3 header. Maintainers edit those
commits with ordinary git (amend, ``rebase -i``, new commits); ``export``
writes every commit after the base back to the series directory and rewrites
``series`` in commit order. The export format is fixed (no ``index`` lines,
three lines of context, ``a/`` and ``b/`` prefixes), so importing and
exporting an unchanged series gives the same bytes on any machine.

The workspace keeps its own state in ``.git/overlay/``: copies of the
patches not applied yet (after ``--upto`` or a conflict), the patch it
stopped at, the patches the maintainer chose to drop, and where ``export``
writes. So ``--continue`` needs nothing but the workspace, and ``export``
refuses to write a series shorter than the one it came from unless told.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay import apply, gitrun
from vllm_overlay.errors import OverlayError
from vllm_overlay.series import Patch, header_text, load_series, read_series

BASE_MESSAGE = "upstream"
_ENV = {
    "GIT_AUTHOR_NAME": "vllm-overlay",
    "GIT_AUTHOR_EMAIL": "vllm-overlay@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_NAME": "vllm-overlay",
    "GIT_COMMITTER_EMAIL": "vllm-overlay@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}
# DEP-3, as `ci/overlay lint` checks it (series.header_problems).
HEADER_TEMPLATE = """\
Description: <one-line summary>
 <why the change, and the design choice; each line indented by one space>
Author: <name and address>
Forwarded: <upstream URL, no (say why above) or not-needed (never upstream)>
Bug: <bug URL; delete this line if there is none>
Last-Update: <YYYY-MM-DD, the day of the last change>
---
"""
# Given to every git command in a workspace, whatever the repository's config.
_WORKSPACE_OPTIONS = ("-c", "core.autocrlf=false", "-c", "gc.auto=0")
# patch -p1 fits the workspace cannot apply by itself: a human edits the tree.
_STOPS = {apply.Fit.CONFLICT, apply.Fit.TARGET_GONE, apply.Fit.ALREADY_UPSTREAM}


# Set in the workspace repository's own config, so that a maintainer's git
# command there (`commit --amend`) never starts a background gc or
# maintenance run that a later `workspace --force` would race; diff3 markers
# show the old release's lines between the two sides of a rebase conflict.
_CONFIG = {
    "gc.auto": "0",
    "gc.autoDetach": "false",
    "maintenance.auto": "false",
    "core.autocrlf": "false",
    "merge.conflictStyle": "diff3",
}


def git(
    repo: Path, *args: str, input: str | None = None, env: dict[str, str] | None = None
) -> str:
    """``gitrun.git`` in a workspace: its identity and config."""
    return gitrun.git(
        repo,
        *_WORKSPACE_OPTIONS,
        *args,
        input=input,
        env={**_ENV, "GIT_EDITOR": "true", **(env or {})},
        next_step="fix the workspace with git, then run the command again",
    )


def _git_run(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``gitrun.run`` in a workspace, whatever its exit status."""
    return gitrun.run(
        repo, *_WORKSPACE_OPTIONS, *args, env={**_ENV, "GIT_EDITOR": "true"}
    )


def init_repo(repo: Path) -> None:
    """``git init`` with the workspace's own config (``_CONFIG``)."""
    git(repo, "init", "-q", "-b", "workspace")
    for key, value in _CONFIG.items():
        git(repo, "config", key, value)
    # What GNU patch leaves beside a file it could not patch cleanly is no
    # part of any patch: never uncommitted work, never committed by `new`.
    (repo / ".git" / "info").mkdir(exist_ok=True)
    with (repo / ".git" / "info" / "exclude").open("a") as exclude:
        exclude.write("*.orig\n*.rej\n")


def _commit(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(
        repo,
        "commit",
        "-q",
        "--allow-empty",
        "--cleanup=verbatim",
        "-F",
        "-",
        input=message,
    )


@dataclass
class State:
    """What a workspace still has to do, kept in ``.git/overlay/state.json``."""

    export_to: str
    pending: list[str] = field(default_factory=list)  # not applied yet, in order
    stopped: str | None = None  # the patch a human is resolving (pending[0])
    dropped: list[str] = field(default_factory=list)  # skipped with --skip
    # A rebase workspace (``rebase_workspace``): git's rebase holds what is
    # still to do, and the finished tree is checked before export.
    rebase: bool = False
    target: str = ""  # whose series it is: hints name ``--target`` for it
    release: str = ""  # the upstream tree of the base commit (``remake``)
    stop_tree: str = ""  # git tree of the workspace as the stop left it
    # sha256 of each file of the series directory as the workspace last
    # read or wrote it (None: made by an older ci/overlay, not checked).
    made_from: dict[str, str] | None = None

    @staticmethod
    def dir(ws: Path) -> Path:
        return ws / ".git" / "overlay"

    @classmethod
    def load(cls, ws: Path) -> State | None:
        path = cls.dir(ws) / "state.json"
        return cls(**json.loads(path.read_text())) if path.is_file() else None

    def save(self, ws: Path) -> None:
        path = self.dir(ws) / "state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.__dict__, indent=2) + "\n")
        tmp.replace(path)


def _pending_patch(ws: Path, name: str) -> Patch:
    return next(p for p in load_series(State.dir(ws) / "patches") if p.name == name)


def continue_hint(ws: Path) -> str:
    state = State.load(ws)
    target = f" --target {state.target}" if state and state.target else ""
    return f"ci/overlay{target} workspace --continue --dir {ws}"


def make_workspace(
    tree: Path,
    patches: list[Patch],
    upto: str | None,
    export_to: Path,
    release: str = "",
) -> None:
    """Turn the fresh upstream ``tree`` into the workspace repository and
    apply ``patches`` (up to ``upto``); see ``advance``. ``release`` names
    the upstream tree, so that ``remake`` can reuse it."""
    _check_upto(patches, upto)
    _start(tree, patches, export_to, release)
    advance(tree, upto)


def _check_upto(patches: list[Patch], upto: str | None) -> None:
    if upto is not None and upto not in [p.name for p in patches]:
        raise OverlayError(
            f"--upto {upto}: not in the series", "name a patch listed in patches/series"
        )


def busy(ws: Path) -> list[Path]:
    """Lock files of a git process working in ``ws`` (or one that died
    holding them): removing the workspace under it fails half-way."""
    gitdir = ws / ".git"
    if not gitdir.is_dir():
        return []
    found = [*gitdir.glob("*.lock"), *gitdir.glob("refs/**/*.lock")]
    found += [
        p
        for p in (gitdir / "gc.pid", gitdir / "objects" / "maintenance.lock")
        if p.exists()
    ]
    return sorted(found)


def remake(ws: Path, patches: list[Patch], upto: str | None, release: str) -> bool:
    """Make ``ws`` again in place when it holds the same upstream
    ``release``: its base commit checked out afresh (git restores only what
    differs), everything else removed, the series applied again; seconds,
    where unpacking and committing the release took a minute. False when it
    cannot be reused (another release, a git operation in progress)."""
    state = State.load(ws) if (ws / ".git").is_dir() else None
    if (
        state is None
        or not release
        or state.release != release
        or state.rebase
        or any((ws / ".git" / x).exists() for x in _IN_PROGRESS)
    ):
        return False
    _check_upto(patches, upto)
    base = git(ws, "rev-list", "--max-parents=0", "HEAD").split()
    if len(base) != 1 or git(ws, "log", "-1", "--format=%B", base[0]) != (
        BASE_MESSAGE + "\n\n"
    ):
        return False
    git(ws, "checkout", "-q", "-f", "-B", "workspace", base[0])
    git(ws, "clean", "-q", "-f", "-d", "-x")
    shutil.rmtree(State.dir(ws))
    (ws / ".git" / "PENDING_HEADER").unlink(missing_ok=True)
    _store(ws, patches, Path(state.export_to), release)
    advance(ws, upto)
    return True


# What git leaves in .git while an operation it started waits for a human.
_IN_PROGRESS = ("rebase-merge", "rebase-apply", "MERGE_HEAD", "CHERRY_PICK_HEAD")


def _start(
    tree: Path, patches: list[Patch], export_to: Path, release: str = ""
) -> State:
    """The upstream ``tree`` as the base commit of a new repository, every
    patch pending."""
    init_repo(tree)
    _commit(tree, BASE_MESSAGE + "\n")
    return _store(tree, patches, export_to, release)


def _store(tree: Path, patches: list[Patch], export_to: Path, release: str) -> State:
    # The patches travel with the workspace, so --continue and export need
    # nothing else (a rebase workspace is not the checkout's series).
    store = State.dir(tree) / "patches"
    store.mkdir(parents=True)
    for patch in patches:
        shutil.copyfile(patch.path, store / patch.name)
    (store / "series").write_text("".join(f"{p.name}\n" for p in patches))
    state = State(str(export_to.absolute()), [p.name for p in patches])
    state.made_from = series_files(export_to)
    state.release = release
    state.save(tree)
    return state


def series_files(patches_dir: Path) -> dict[str, str]:
    """sha256 of each file of a series directory that export writes (a
    folder in it is another target's series, not this one's)."""
    if not patches_dir.is_dir():
        return {}
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(patches_dir.iterdir())
        if p.is_file() and (p.suffix == ".patch" or p.name == "series")
    }


def _message(patch: Patch) -> str:
    return f"{patch.name}\n\n{header_text(patch.path.read_text())}"


def rebase_workspace(
    tree: Path,
    patches: list[Patch],
    new_release: Path,
    export_to: Path,
    target: str,
    command: str,
) -> None:
    """Move ``patches`` from the release in ``tree`` (the one they apply to
    exactly) onto ``new_release`` the way git does: ``tree`` becomes a
    repository of the old release with one commit per patch, the new release
    becomes a second root commit, and ``git rebase --onto`` replays each
    patch commit by a 3-way merge whose base is the old release. A hunk
    whose context changed merges or stops with conflict markers; nothing is
    applied by line number. ``new_release`` is read, not changed."""
    state = _start(tree, patches, export_to)
    old_base = git(tree, "rev-parse", "HEAD").strip()
    for patch in patches:
        apply.apply_patch(tree, patch, command)
        _commit(tree, _message(patch))
    state.pending = []
    state.rebase = True
    state.target = target
    state.save(tree)
    # The new release's tree, committed through an index of its own so the
    # workspace's files stay as they are until the rebase checks it out.
    index = {"GIT_INDEX_FILE": str(State.dir(tree) / "release-index")}
    gitdir = f"--git-dir={(tree / '.git').absolute()}"
    git(new_release, gitdir, "--work-tree=.", "add", "-A", env=index)
    release_tree = git(new_release, gitdir, "write-tree", env=index).strip()
    (State.dir(tree) / "release-index").unlink()
    new_base = git(tree, "commit-tree", release_tree, input=BASE_MESSAGE + "\n")
    _rebase(tree, state, "--onto", new_base.strip(), old_base)


def rebasing(ws: Path) -> bool:
    """Whether git's rebase stopped in ``ws`` and waits for a human."""
    return (ws / ".git" / "rebase-merge").is_dir()


def _rebase(ws: Path, state: State, *args: str) -> None:
    """Run ``git rebase ARGS``; on a conflict, record the patch and raise
    with the files that hold markers and what to run next."""
    result = _git_run(ws, "rebase", *args)
    if result.returncode == 0 and not rebasing(ws):
        state.stopped = None
        state.save(ws)
        return
    if not rebasing(ws):
        raise OverlayError(
            f"git rebase {' '.join(args[:1])} in {ws} failed: "
            f"{(result.stdout + result.stderr).strip()}",
            "fix the workspace with git, then run the command again",
        )
    name = git(ws, "log", "-1", "--format=%s", "REBASE_HEAD").strip()
    state.stopped = name
    state.save(ws)
    todo = (ws / ".git" / "rebase-merge" / "git-rebase-todo").read_text()
    later = [x for x in todo.splitlines() if x.strip() and not x.startswith("#")]
    marked = git(ws, "diff", "--name-only", "--diff-filter=U").split()
    raise OverlayError(
        f"{name} does not apply to {ws} (conflict: git's 3-way merge, with the "
        f"release the series was made for as the merge base); conflict markers "
        f"in {', '.join(marked)}; {len(later)} later patches wait",
        f"resolve it in {ws} (or leave it out with `{continue_hint(ws)} --skip`), "
        f"then `{continue_hint(ws)}`",
    )


_MARKER = re.compile(r"^(<<<<<<<|\|\|\|\|\|\|\||>>>>>>>)( |$)", re.M)


def _continue_rebase(ws: Path, state: State, skip: bool) -> None:
    name = state.stopped
    if skip:
        state.dropped.append(str(name))
        print(f"  left out {name}", file=sys.stderr)
        _rebase(ws, state, "--skip")
        return
    changed = git(ws, "diff", "--name-only", "HEAD").split()
    marked = [
        f for f in changed if (ws / f).is_file() and _MARKER.search(_text(ws / f))
    ]
    if marked:
        raise OverlayError(
            f"{ws} still has conflict markers in {', '.join(marked)}",
            f"resolve them, then `{continue_hint(ws)}`",
        )
    git(ws, "add", "-A")
    if not git(ws, "diff", "--cached", "--name-only", "HEAD"):
        raise OverlayError(
            f"{ws} has no changes for {name}",
            f"resolve it first, or leave it out with `{continue_hint(ws)} --skip`",
        )
    print(f"  committed {name} (resolved)", file=sys.stderr)
    _rebase(ws, state, "--continue")


def _text(path: Path) -> str:
    return path.read_bytes().decode(errors="replace")


def advance(ws: Path, upto: str | None = None) -> None:
    """Commit pending patches in order; stop at one that needs a human (its
    changes merged with conflict markers where patch can) or after ``upto``."""
    state = _state(ws)
    while state.pending:
        patch = _pending_patch(ws, state.pending[0])
        report = apply.classify(ws, patch)
        if report.fit in _STOPS:
            _stop(ws, state, patch, report)
        apply.apply_loosely(ws, patch)
        _commit(ws, _message(patch))
        state.pending.pop(0)
        state.save(ws)
        note = "" if report.fit is apply.Fit.CLEAN else f" ({report.fit.value})"
        print(f"  committed {patch.name}{note}", file=sys.stderr)
        if patch.name == upto and state.pending:
            print(
                f"  stopped after {upto}; {len(state.pending)} later patches wait: "
                f"edit, `git -C {ws} commit -a --amend`, then `{continue_hint(ws)}`",
                file=sys.stderr,
            )
            return


def _stop(ws: Path, state: State, patch: Patch, report: apply.FitReport) -> None:
    state.stopped = patch.name
    state.save(ws)
    (ws / ".git" / "PENDING_HEADER").write_text(_message(patch))
    where = ""
    if report.fit is apply.Fit.CONFLICT:
        # patch --merge leaves conflict markers where a hunk failed, so the
        # maintainer edits the result instead of retyping the patch.
        subprocess.run(
            [
                "patch",
                "-p1",
                "--batch",
                "--forward",
                "--merge",
                "--no-backup-if-mismatch",
                "-d",
                str(ws),
                "-i",
                str(patch.path),
            ],
            capture_output=True,
            text=True,
        )
        marked = sorted(
            set(
                re.findall(
                    r"^(.+?):\d+: leftover conflict marker", _diff_check(ws), re.M
                )
            )
        )
        where = f"; conflict markers in {', '.join(marked)}" if marked else ""
    # What the stop left in the tree: --skip may throw exactly this away.
    state.stop_tree = _worktree_tree(ws)
    state.save(ws)
    raise OverlayError(
        f"{patch.name} does not apply to {ws} ({report.fit.value}: "
        f"{report.detail}){where}; {len(state.pending) - 1} later patches wait",
        f"resolve it in {ws} (or leave it out with `{continue_hint(ws)} --skip`), "
        f"then `{continue_hint(ws)}`",
    )


def _worktree_tree(ws: Path) -> str:
    """The git tree of everything in ``ws`` now, through a copy of its index
    (so only changed files are read again)."""
    index = State.dir(ws) / "worktree-index"
    shutil.copyfile(ws / ".git" / "index", index)
    env = {"GIT_INDEX_FILE": str(index)}
    git(ws, "add", "-A", env=env)
    tree = git(ws, "write-tree", env=env).strip()
    index.unlink()
    return tree


def _diff_check(ws: Path) -> str:
    """``git diff --check``: it names leftover conflict markers by file and
    line (and exits non-zero when it finds any, which is no failure here)."""
    return subprocess.run(
        ["git", "-C", str(ws), "diff", "--check"], capture_output=True, text=True
    ).stdout


def _state(ws: Path) -> State:
    if not (ws / ".git").is_dir():
        raise OverlayError(
            f"{ws} is not a workspace", "make one with `ci/overlay workspace`"
        )
    state = State.load(ws)
    if state is None:
        raise OverlayError(
            f"{ws} has no workspace state (made by an older ci/overlay)",
            "export it with the old tool, or make it again with "
            "`ci/overlay workspace --force`",
        )
    return state


def continue_workspace(ws: Path, skip: bool) -> None:
    """Commit the resolution of the stopped patch (or drop it), then apply
    the rest."""
    state = _state(ws)
    if rebasing(ws):
        _continue_rebase(ws, state, skip)
        return
    if state.rebase:  # git's rebase is done (a human may have run it on)
        state.stopped = None
    dirty = git(ws, "status", "--porcelain")
    if state.stopped is not None:
        name = state.stopped
        if skip:
            if dirty and _worktree_tree(ws) != state.stop_tree:
                raise OverlayError(
                    f"--skip would throw away edits made in {ws} since it stopped "
                    f"at {name}: {_first_lines(dirty)}",
                    f"`git -C {ws} reset -q --hard && git -C {ws} clean -fdq` to "
                    f"throw them away, then `{continue_hint(ws)} --skip`; or resolve "
                    f"and `{continue_hint(ws)}`",
                )
            if dirty:  # only what the stop left (conflict markers): gone
                git(ws, "reset", "-q", "--hard")
                git(ws, "clean", "-q", "-f", "-d")
            state.dropped.append(name)
            print(f"  left out {name}", file=sys.stderr)
        elif dirty:
            markers = _diff_check(ws)
            if "conflict marker" in markers:
                raise OverlayError(
                    f"{ws} still has conflict markers: {_first_lines(markers)}",
                    f"resolve them, then `{continue_hint(ws)}`",
                )
            _commit(ws, (ws / ".git" / "PENDING_HEADER").read_text())
            print(f"  committed {name} (resolved)", file=sys.stderr)
        elif _commit_names(ws)[-1:] != [name]:
            raise OverlayError(
                f"{ws} has no changes for {name}",
                f"resolve it first, or leave it out with `{continue_hint(ws)} --skip`",
            )
        state.pending.pop(0)
        state.stopped = None
        state.save(ws)
    elif skip:
        raise OverlayError(f"{ws} is not stopped at a patch", "run without --skip")
    elif dirty:
        raise OverlayError(
            f"{ws} has uncommitted edits: {_first_lines(dirty)}",
            f"commit them (`git -C {ws} add -A && git -C {ws} commit -q --amend "
            f"--no-edit`), then `{continue_hint(ws)}`",
        )
    advance(ws)


def _first_lines(text: str, n: int = 5) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    more = f" (and {len(lines) - n} more)" if len(lines) > n else ""
    return "; ".join(lines[:n]) + more


def new_patch(workspace: Path, name: str) -> None:
    """Commit the workspace's changes as a new patch with a header template."""
    if not name.endswith(".patch") or "/" in name:
        raise OverlayError(
            f"{name!r} is not a patch file name", "use NNNN-short-name.patch"
        )
    state = _state(workspace)
    taken = set(_commit_names(workspace)) | set(state.pending)
    series_file = Path(state.export_to) / "series"
    if series_file.is_file():
        taken |= set(read_series(Path(state.export_to)))
    if name in taken:
        raise OverlayError(
            f"{name} is taken (the series already has a patch of that name)",
            "pick a new name, e.g. "
            f"`ci/overlay new {_next_free(taken, name)} --dir {workspace}`",
        )
    if not git(workspace, "status", "--porcelain"):
        raise OverlayError(
            f"{workspace} has no changes to put in {name}", "edit the files first"
        )
    _commit(workspace, f"{name}\n\n{HEADER_TEMPLATE}")


def _next_free(taken: set[str], name: str) -> str:
    numbers = [int(n[:4]) for n in taken if n[:4].isdigit()]
    stem = name[5:] if name[:4].isdigit() and name[4:5] == "-" else name
    return f"{max(numbers, default=0) + 1:04d}-{stem}"


def _diff(repo: Path, commit: str) -> str:
    raw = git(
        repo,
        "diff",
        "--no-color",
        "--no-ext-diff",
        "--no-renames",
        "--src-prefix=a/",
        "--dst-prefix=b/",
        "-U3",
        f"{commit}^",
        commit,
    )
    return "".join(
        line for line in raw.splitlines(keepends=True) if not line.startswith("index ")
    )


def _commit_names(ws: Path) -> list[str]:
    commits = git(ws, "rev-list", "--reverse", "HEAD").split()[1:]
    return [
        git(ws, "log", "-1", "--format=%B", c).partition("\n")[0].strip()
        for c in commits
    ]


def exported_texts(workspace: Path) -> dict[str, str]:
    """Each patch commit's export, by name, in commit order."""
    commits = git(workspace, "rev-list", "--reverse", "HEAD").split()
    base, *patch_commits = commits
    if git(workspace, "log", "-1", "--format=%B", base) != BASE_MESSAGE + "\n\n":
        raise OverlayError(
            f"{workspace}: first commit is not the upstream base",
            "make the workspace again with `ci/overlay workspace --force`",
        )
    texts: dict[str, str] = {}
    for commit in patch_commits:
        # %B prints the message verbatim plus one newline of git log's own.
        message = git(workspace, "log", "-1", "--format=%B", commit)[:-1]
        name, _, header = message.partition("\n\n")
        name = name.strip()
        if not name.endswith(".patch") or "/" in name or name in texts:
            raise OverlayError(
                f"commit {commit[:12]}: first line {name!r} is not a new patch "
                "file name",
                "reword the commit: first line NNNN-short-name.patch, blank line, "
                "DEP-3 header",
            )
        texts[name] = header + _diff(workspace, commit)
    return texts


def unsaved_work(ws: Path) -> list[str]:
    """What making ``ws`` again would lose: uncommitted edits, and commits
    whose patch differs from the one last imported or exported (what the
    series directory holds now does not matter: it may have moved on)."""
    if not (ws / ".git").is_dir():
        return []
    lost = [
        f"uncommitted: {line.strip()}"
        for line in git(ws, "status", "--porcelain").splitlines()
    ]
    store = State.dir(ws) / "patches"
    try:
        texts = exported_texts(ws)
    except OverlayError as e:
        return [*lost, f"commits git cannot read back: {e.what}"]
    for name, text in texts.items():
        saved = store / name
        if not saved.is_file() or saved.read_text() != text:
            lost.append(f"unexported commit: {name}")
    return lost


def export(
    workspace: Path, drop: list[str] | None = None, force: bool = False
) -> list[str]:
    """Write the workspace's commits to its series directory; return the
    names. Refuses while patches wait, when the result would lose a patch
    of the old series that is not named in ``drop``, and (unless ``force``)
    when the series directory changed since the workspace was made or last
    exported: writing would revert that change."""
    state = _state(workspace)
    patches_dir = Path(state.export_to)
    if state.made_from is not None and not force:
        now = series_files(patches_dir)
        if changed := sorted(
            n
            for n in state.made_from.keys() | now.keys()
            if state.made_from.get(n) != now.get(n)
        ):
            raise OverlayError(
                f"{', '.join(str(patches_dir / n) for n in changed)} changed since "
                f"{workspace} was made from the series (or last exported to it); "
                "exporting would overwrite that",
                f"keep the change: commit or stash it, make the workspace again and "
                f"redo the edit there; or overwrite it: `ci/overlay export --dir "
                f"{workspace} --force`",
            )
    if state.pending or rebasing(workspace):
        waiting = (
            ", ".join(state.pending) or f"the rest of its rebase ({state.stopped})"
        )
        raise OverlayError(
            f"{workspace} has not applied {waiting} yet",
            f"`{continue_hint(workspace)}` first",
        )
    if dirty := git(workspace, "status", "--porcelain"):
        raise OverlayError(
            f"{workspace} has uncommitted changes: {_first_lines(dirty)}",
            f"commit them into a patch commit first (`git -C {workspace} "
            f"commit -a --amend`, or `ci/overlay new NAME --dir {workspace}`)",
        )
    texts = exported_texts(workspace)
    drop = list(drop or [])
    # The series the workspace was made from, and the one it writes over
    # (a rebase exports into an empty directory).
    old = read_series(State.dir(workspace) / "patches")
    if (patches_dir / "series").is_file():
        old += [n for n in read_series(patches_dir) if n not in old]
    missing = [
        n for n in old if n not in texts and n not in drop and n not in state.dropped
    ]
    if missing:
        raise OverlayError(
            f"exporting {workspace} would remove {', '.join(missing)} from "
            f"{patches_dir / 'series'}",
            "apply them (`ci/overlay workspace`), or say so: "
            f"`ci/overlay export --dir {workspace} "
            + " ".join(f"--drop {n}" for n in missing)
            + "`",
        )
    if unknown := [n for n in drop if n in texts]:
        raise OverlayError(
            f"--drop {', '.join(unknown)}: still a commit in {workspace}",
            f"remove the commit first (`git -C {workspace} rebase -i`)",
        )
    patches_dir.mkdir(parents=True, exist_ok=True)
    for stale in patches_dir.glob("*.patch"):
        if stale.name not in texts:
            stale.unlink()
    for name, text in texts.items():
        (patches_dir / name).write_text(text)
    series = patches_dir / "series"
    comments = (
        [line for line in series.read_text().splitlines() if line.startswith("#")]
        if series.exists()
        else []
    )
    series.write_text("\n".join([*comments, *texts]) + "\n")
    load_series(patches_dir)  # the result must be a valid series
    # What was saved, for unsaved_work.
    store = State.dir(workspace) / "patches"
    shutil.rmtree(store)
    store.mkdir()
    for name, text in texts.items():
        (store / name).write_text(text)
    (store / "series").write_text("".join(f"{n}\n" for n in texts))
    for name in [*drop, *state.dropped]:
        print(f"  dropped {name}", file=sys.stderr)
    state.dropped = []
    state.made_from = series_files(patches_dir)
    state.save(workspace)
    return list(texts)
