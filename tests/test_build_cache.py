"""build/tree laid from the verified pristine cache (pristine.py): links only
where nothing writes, every change to the cache detected, and the same tree
as an unpack of the sdist every time."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from conftest import make_patch, write_series
from vllm_overlay import apply, manifest, notice, overlay, pristine, series, source
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout
from vllm_overlay.pin import Pin, PinnedFile, load_pin

FILES = {
    "vllm/x.py": "x = 1\n",
    "vllm/unpatched.py": "y = 'upstream'\n",
    "tests/test_y.py": "def test_y():\n    pass\n",
    "setup.py": "# setup\n",
}
PATCHED = {"vllm/x.py"}


def _sdist(path: Path) -> str:
    """A vLLM-shaped sdist (one top folder) of FILES; its sha256."""
    with tarfile.open(path, "w:gz") as archive:
        for rel, text in FILES.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-0.33.0/{rel}")
            info.size = len(data)
            info.mode = 0o644
            archive.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def pin(checkout: Layout) -> Pin:
    base = load_pin(checkout.pin)
    checkout.downloads.mkdir(parents=True)
    sha = _sdist(checkout.downloads / base.sdist.filename)
    return dataclasses.replace(base, sdist=PinnedFile(base.sdist.filename, sha))


def _lay(checkout: Layout, pin: Pin, patched: set[str] = PATCHED) -> Path:
    source.lay_build_tree(
        checkout.root,
        pin,
        checkout.cache,
        checkout.downloads,
        checkout.tree,
        checkout.partial_tree,
        patched,
    )
    return checkout.partial_tree


def _finish(checkout: Layout) -> Path:
    """What the build does after the series: partial becomes build/tree."""
    checkout.partial_tree.rename(checkout.tree)
    return checkout.tree


def _contents(tree: Path) -> dict[str, str]:
    return {
        p.relative_to(tree).as_posix(): p.read_text()
        for p in sorted(tree.rglob("*"))
        if p.is_file()
    }


def _cached(checkout: Layout, pin: Pin) -> Path:
    return pristine.cache_entry(checkout.cache, pin) / "tree"


def test_tree_links_unpatched_files_and_copies_patched_ones(
    checkout: Layout, pin: Pin
) -> None:
    tree = _lay(checkout, pin)
    assert _contents(tree) == FILES
    cached = _cached(checkout, pin)
    for rel in FILES:
        shared = os.stat(tree / rel).st_ino == os.stat(cached / rel).st_ino
        assert shared == (rel not in PATCHED), rel
    # The record was retaken after the links moved the cached files' ctime.
    assert pristine.intact_entries(cached.parent, pin.sdist.sha256) is not None


def test_patch_replaces_a_linked_file_instead_of_writing_through(
    checkout: Layout, pin: Pin
) -> None:
    """GNU patch writes a new file and renames it over the old one, so even a
    patched file that was linked (a series target the lay did not know of)
    never changes the cache."""
    write_series(
        checkout,
        {
            "0001-u.patch": make_patch(
                FILES["vllm/unpatched.py"], "y = 'patched'\n", "vllm/unpatched.py"
            )
        },
    )
    tree = _lay(checkout, pin)
    apply.apply_series(tree, series.load_series(checkout.patches))
    assert (tree / "vllm/unpatched.py").read_text() == "y = 'patched'\n"
    cached = _cached(checkout, pin)
    assert (cached / "vllm/unpatched.py").read_text() == FILES["vllm/unpatched.py"]


def test_relay_reuses_links_and_drops_everything_else(
    checkout: Layout, pin: Pin
) -> None:
    tree = _lay(checkout, pin)
    (tree / "vllm/x.py").write_text("x = 2  # the series\n")
    (tree / "tests/new_overlay_test.py").write_text("pass\n")
    # Two unwanted folders whose names sort between a folder and its files.
    for extra in ("vllm/extra/x.pyc", "vllm/extra-2/y.pyc", "vllm/extra/z/w.pyc"):
        (tree / extra).parent.mkdir(parents=True, exist_ok=True)
        (tree / extra).write_bytes(b"\0")
    tree = _finish(checkout)
    kept = os.stat(tree / "vllm/unpatched.py").st_ino

    again = _lay(checkout, pin)
    assert not checkout.tree.exists()  # never a half-laid build/tree
    assert _contents(again) == FILES
    assert os.stat(again / "vllm/unpatched.py").st_ino == kept
    assert (
        os.stat(again / "setup.py").st_ino
        == os.stat(_cached(checkout, pin) / "setup.py").st_ino
    )


@pytest.mark.parametrize("how", ["append", "same size, mtime put back", "chmod"])
def test_write_through_build_tree_is_detected(
    checkout: Layout, pin: Pin, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An in-place write into a linked file of build/tree changes the cached
    file too; the next lay notices and unpacks the sdist again."""
    _lay(checkout, pin)
    tree = _finish(checkout)
    target = tree / "vllm/unpatched.py"
    before = os.stat(target)
    if how == "append":
        with target.open("a") as f:
            f.write("tampered = True\n")
    elif how == "chmod":
        target.chmod(0o600)
    else:
        with target.open("r+") as f:
            f.write("Y")
        os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert os.stat(target).st_mtime_ns == before.st_mtime_ns
    cached = _cached(checkout, pin)
    assert pristine.intact_entries(cached.parent, pin.sdist.sha256) is None

    again = _lay(checkout, pin)
    assert "unpacking the sdist again" in capsys.readouterr().err
    assert _contents(again) == FILES
    assert (os.stat(again / "vllm/unpatched.py").st_mode & 0o777) == 0o644
    assert pristine.intact_entries(cached.parent, pin.sdist.sha256) is not None


def test_tampered_cache_file_or_record_forces_an_unpack(
    checkout: Layout, pin: Pin
) -> None:
    _lay(checkout, pin)
    entry = _cached(checkout, pin).parent
    (entry / "tree" / "vllm/extra.py").write_text("added to the cache\n")
    assert pristine.intact_entries(entry, pin.sdist.sha256) is None
    again = _lay(checkout, pin)
    assert _contents(again) == FILES

    (entry / "record").write_text("0" * 64 + "\n")
    old = os.stat(entry / "tree" / "setup.py").st_ino
    _lay(checkout, pin)
    assert os.stat(entry / "tree" / "setup.py").st_ino != old  # unpacked anew


def test_cache_is_keyed_by_the_pinned_sha256(checkout: Layout, pin: Pin) -> None:
    """A cache made from another sdist is never used: the folder is named
    by the pin's sha256 and the record covers it."""
    _lay(checkout, pin)
    entry = _cached(checkout, pin).parent
    other = dataclasses.replace(pin.sdist, sha256="1" * 64)
    elsewhere = pristine.cache_entry(
        checkout.cache, dataclasses.replace(pin, sdist=other)
    )
    elsewhere.parent.mkdir(parents=True, exist_ok=True)
    os.rename(entry, elsewhere)
    assert pristine.intact_entries(elsewhere, other.sha256) is None


def test_unpack_still_checks_the_sdist_sha256(checkout: Layout, pin: Pin) -> None:
    sdist = checkout.downloads / pin.sdist.filename
    sdist.write_bytes(sdist.read_bytes() + b"\0")
    with pytest.raises(OverlayError, match="does not match pin.toml"):
        _lay(checkout, pin)
    assert not checkout.tree.exists()
    assert not pristine.cache_entry(checkout.cache, pin).exists()


def test_interrupted_unpack_is_not_used(checkout: Layout, pin: Pin) -> None:
    entry = pristine.cache_entry(checkout.cache, pin)
    staging = entry.with_name(entry.name + ".partial")
    (staging / "tree" / "vllm").mkdir(parents=True)
    (staging / "tree" / "vllm" / "x.py").write_text("half\n")
    assert _contents(_lay(checkout, pin)) == FILES
    assert not staging.exists()


def test_workspace_and_pristine_trees_share_nothing_with_the_cache(
    checkout: Layout, pin: Pin
) -> None:
    """build/workspace (git checkouts, edited by hand) and build/pristine are
    unpacked from the sdist, never linked."""
    _lay(checkout, pin)
    for dest in (checkout.workspace, checkout.pristine_tree):
        source.lay_scratch_tree(checkout.root, pin, checkout.downloads, dest)
        assert _contents(dest) == FILES
        assert {os.stat(p).st_nlink for p in dest.rglob("*") if p.is_file()} == {1}


def test_the_build_steps_leave_the_cache_intact(checkout: Layout, pin: Pin) -> None:
    """Every writer of the build (the series, overlay/, the manifest and the
    notice) adds or replaces files: afterwards the cache still passes its
    check, so nothing wrote into or unlinked a cached file."""
    write_series(
        checkout,
        {
            "0001-x.patch": make_patch(FILES["vllm/x.py"], "x = 2\n", "vllm/x.py"),
            "0002-u.patch": make_patch(
                FILES["vllm/unpatched.py"], "y = 2\n", "vllm/unpatched.py"
            ),
        },
    )
    (checkout.overlay / "tests").mkdir()
    (checkout.overlay / "tests" / "test_new.py").write_text("pass\n")
    patches = series.load_series(checkout.patches)
    tree = _lay(checkout, pin, {t for p in patches for t in p.targets})
    apply.apply_series(tree, patches)
    overlay.copy_overlay(checkout.overlay, tree)
    manifest.write_manifest(_finish(checkout), {"build_mode": "assemble"})
    notice.write_notice(checkout.tree, "notice\n")
    cached = _cached(checkout, pin)
    assert pristine.intact_entries(cached.parent, pin.sdist.sha256) is not None
    assert _contents(cached) == FILES


def test_other_modes_get_a_tree_of_copies(checkout: Layout, pin: Pin) -> None:
    """vLLM's setup.py (--python-only, --from-source) writes into the tree
    in place, so those modes' tree shares no file with the cache, even when
    it reuses a linked tree an assemble build left."""
    _lay(checkout, pin)
    _finish(checkout)
    tree = _lay(checkout, pin, None)
    assert _contents(tree) == FILES
    assert {os.stat(p).st_nlink for p in tree.rglob("*") if p.is_file()} == {1}
