"""Pick the pinned upstream source and lay a fresh scratch copy of it.

``upstream/`` (the git submodule) is used when it is a populated checkout at
the pinned commit and clean; otherwise the pinned sdist, which holds the
whole repository tree. ``upstream/`` itself is never written to.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay import gitrun, pristine
from vllm_overlay.errors import OverlayError
from vllm_overlay.fetch import fetch
from vllm_overlay.files import locked
from vllm_overlay.pin import Pin


@dataclass(frozen=True)
class UpstreamSource:
    kind: str  # "submodule" or "sdist"
    description: str


def _git(checkout: Path, *args: str) -> str:
    return gitrun.git(
        checkout,
        *args,
        next_step="check upstream/ with git (`git submodule update upstream`)",
    ).strip()


def is_populated_checkout(checkout: Path) -> bool:
    return (checkout / ".git").exists()


def check_checkout(checkout: Path, pin: Pin) -> str:
    """Return HEAD of ``checkout`` after checking it is the pin and clean."""
    head = _git(checkout, "rev-parse", "HEAD")
    if not pin.commit_matches(head):
        wanted = pin.commit or f"{pin.commit_short}..."
        raise OverlayError(
            f"{checkout} is at {head}, pin.toml wants {wanted} ({pin.tag})",
            f"run `git -C {checkout} checkout {pin.commit or pin.tag}` "
            "(or `git submodule update upstream`)",
        )
    dirty = _git(checkout, "status", "--porcelain", "--untracked-files=all")
    if dirty:
        first = dirty.splitlines()[0]
        raise OverlayError(
            f"{checkout} has local changes ({first.strip()}, ...)",
            # Only a hint that keeps the edits: they may be a patch in the
            # making.
            f"patches live in patches/, not in {checkout}: put the edits "
            f"aside with `git -C {checkout} stash -u`",
        )
    return head


def extract_sdist(sdist: Path, dest: Path) -> None:
    """Unpack a vLLM sdist's single top directory as ``dest``."""
    with tarfile.open(sdist) as archive:
        members = archive.getmembers()
        top = {m.name.split("/", 1)[0] for m in members}
        if len(top) != 1:
            raise OverlayError(
                f"{sdist}: expected one top-level directory, found {sorted(top)}",
                "check pin.toml: this is not a vLLM sdist",
            )
        prefix = top.pop() + "/"
        dest.mkdir(parents=True)
        for member in members:
            if not member.name.startswith(prefix):
                continue
            member.name = member.name[len(prefix) :]
            archive.extract(member, dest, filter="data")


def lay_scratch_tree(
    repo_root: Path, pin: Pin, cache_dir: Path, dest: Path
) -> UpstreamSource:
    """Fill ``dest`` (which must not exist) with the pinned upstream tree."""
    checkout = repo_root / "upstream"
    if is_populated_checkout(checkout):
        head = check_checkout(checkout, pin)
        dest.mkdir(parents=True)
        archive = subprocess.Popen(
            ["git", "-C", str(checkout), "archive", "--format=tar", "HEAD"],
            stdout=subprocess.PIPE,
        )
        subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise OverlayError(f"git archive of {checkout} failed", "run again")
        return UpstreamSource("submodule", f"upstream/ checkout at {head}")

    sdist = fetch(pin.sdist, cache_dir)
    extract_sdist(sdist, dest)
    return UpstreamSource(
        "sdist", f"{pin.sdist.filename} (sha256 {pin.sdist.sha256[:12]}...)"
    )


def lay_build_tree(
    repo_root: Path,
    pin: Pin,
    cache_dir: Path,
    downloads: Path,
    tree: Path,
    partial: Path,
    patched: set[str] | None,
) -> UpstreamSource:
    """Lay a fresh pinned upstream tree at ``partial``, where the series and
    overlay go in before it becomes ``tree``; the earlier ``tree`` is gone.

    From the sdist, ``partial`` is laid from the verified cached tree
    (pristine.py), reusing the earlier tree's files that still are the
    cached ones; ``patched`` (the series' targets; None: every file) are
    copied, every other file hard-linked. The cache is checked before
    anything is removed (that moves the cached files' ctime) and its record
    retaken after the lay."""
    if is_populated_checkout(repo_root / "upstream"):
        fresh_dir(tree)
        fresh_dir(partial)
        return lay_scratch_tree(repo_root, pin, downloads, partial)
    locks = cache_dir / "pristine"
    locks.mkdir(parents=True, exist_ok=True)
    # Another checkout sharing the cache may be unpacking or laying it.
    with locked(locks):
        cached, entries = pristine.ensure(pin, cache_dir, downloads, extract_sdist)
        if tree.is_dir() and not tree.is_symlink():
            fresh_dir(partial)
            tree.rename(partial)  # from here on never passed off as built
        fresh_dir(tree)
        if not partial.is_dir() or partial.is_symlink():
            fresh_dir(partial)
        pristine.lay(cached, entries, partial, patched)
        pristine.write_record(cached.parent, pin.sdist.sha256)
    return UpstreamSource(
        "sdist",
        f"{pin.sdist.filename} (sha256 {pin.sdist.sha256[:12]}..., unpacked "
        "once into .cache/pristine)",
    )


def fresh_dir(path: Path) -> None:
    """Remove what an earlier (maybe interrupted) run left at ``path``."""
    if path.exists() or path.is_symlink():
        print(f"  removing stale {path}", file=sys.stderr)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def submodule_branches(root: Path) -> list[str]:
    """The ``branch`` lines of ``root``'s ``.gitmodules``."""
    return [
        line.split("=", 1)[1].strip()
        for line in (root / ".gitmodules").read_text().splitlines()
        if line.strip().startswith("branch")
    ]


def track_tag(root: Path, tag: str) -> None:
    """Point the ``upstream`` submodule's ``branch`` at ``tag``: adopt moves
    it with the main pin (``ci/overlay lint`` checks they agree)."""
    gitmodules = root / ".gitmodules"
    text = re.sub(r"(?m)^(\s*branch\s*=\s*).*$", rf"\g<1>{tag}", gitmodules.read_text())
    partial = gitmodules.with_name(".gitmodules.partial")
    partial.write_text(text)
    partial.replace(gitmodules)
