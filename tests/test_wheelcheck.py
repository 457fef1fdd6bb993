"""The wheel check on damaged copies of the real built wheel.

Each copy carries one kind of damage and, unless the damage is to RECORD
itself, a RECORD that matches its bytes, so only the check named by the case
can catch it: each case fails if that check is taken out of wheelcheck.py.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import REPO, built_wheel
from vllm_overlay import fetch, overlay, wheelcheck
from vllm_overlay.assemble import _RawZipWriter
from vllm_overlay.zipmember import raw_member

pytestmark = pytest.mark.real_release
PIN = overlay.labelled_pin(REPO)  # the version the build gives the wheel
INFO = f"vllm-{PIN.overlay_version}.dist-info/"

RECORD = INFO + "RECORD"
NOTICE = INFO + wheelcheck.NOTICE_MEMBER
# change(data) -> the member's new bytes, or None to drop it
Change = Callable[[bytes], bytes | None]


def _row(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return [name, f"sha256={digest.decode()}", str(len(data))]


def _damage(
    dest: Path, target: str, change: Change, add: dict[str, bytes], resign: bool
) -> Path:
    """A copy of the built wheel with ``change`` applied to member ``target``
    and the ``add`` members appended; with ``resign``, RECORD is rewritten to
    match the new bytes first (a change to RECORD applies after that).
    Unchanged members are copied raw, so a copy takes a second."""
    with zipfile.ZipFile(built_wheel()) as src:
        rows = list(csv.reader(io.StringIO(src.read(RECORD).decode())))
        writer = _RawZipWriter(dest, 315532800)
        changed: dict[str, bytes | None] = dict(add)
        for info in src.infolist():
            if info.filename == RECORD:
                continue
            if info.filename != target:
                writer.copy(info.filename, info, raw_member(src, info))
                continue
            new = changed[target] = change(src.read(info))
            if new is not None:
                writer.write(target, new, info.external_attr)
        for name, data in add.items():
            writer.write(name, data, 0o100644 << 16)
        if resign:
            kept = [r for r in rows if r[0] not in changed or changed[r[0]] is not None]
            rows = [
                _row(r[0], changed[r[0]]) if changed.get(r[0]) else r  # type: ignore[arg-type]
                for r in kept[:-1]
            ]
            rows += [_row(n, d) for n, d in add.items()] + kept[-1:]
        record = io.StringIO()
        csv.writer(record, lineterminator="\n").writerows(rows)
        data = record.getvalue().encode()
        if target == RECORD:
            data = change(data) or b""
        writer.write(RECORD, data, 0o100644 << 16)
        writer.close()
    return dest


def _problems(wheel: Path) -> list[str]:
    return wheelcheck.compare(
        wheel,
        fetch.fetch(PIN.wheel, REPO.downloads),
        REPO.tree,
        overlay.touched_files(REPO),
        PIN.overlay_version,
    ).problems(PIN.wheel_tag)


def _set_hash(record: bytes, member: str) -> bytes:
    lines = record.decode().splitlines(keepends=True)
    i = next(i for i, ln in enumerate(lines) if ln.startswith(member + ","))
    name, _, size = lines[i].rstrip("\n").split(",")
    lines[i] = f"{name},sha256={'A' * 43},{size}\n"
    return "".join(lines).encode()


def _drop_row(record: bytes, member: str) -> bytes:
    return b"".join(
        ln for ln in record.splitlines(True) if not ln.startswith(f"{member},".encode())
    )


def _drop_line(line: bytes) -> Change:
    def change(data: bytes) -> bytes:
        assert line in data.splitlines(keepends=True), line
        return data.replace(line, b"", 1)

    return change


def _set_header(field: bytes, value: bytes) -> Change:
    def change(data: bytes) -> bytes:
        head, sep, rest = data.partition(b"\n" + field + b": ")
        assert sep, field
        return head + sep + value + rest[rest.index(b"\n") :]

    return change


# id, member, change, members added, RECORD re-signed, the problem reported
CASES: list[tuple[str, str, Change, dict[str, bytes], bool, str]] = [
    # the damage the audit showed passing (issue 11, item 1)
    (
        "entry-points-emptied",
        INFO + "entry_points.txt",
        lambda d: b"",
        {},
        True,
        "entry_points.txt differs from the official one",
    ),
    (
        "record-hash-corrupted",
        RECORD,
        lambda d: _set_hash(d, "vllm/envs.py"),
        {},
        True,
        "RECORD row of vllm/envs.py is sha256=AAAA",
    ),
    (
        "version-file-9.9.9",
        "vllm/_version.py",
        lambda d: d.replace(PIN.overlay_version.encode(), b"9.9.9"),
        {},
        True,
        "vllm/_version.py: __version__ = '9.9.9'",
    ),
    (
        "extra-dist-info-file",
        "",
        lambda d: d,
        {INFO + "evil.txt": b"evil\n"},
        True,
        f"unexpected member {INFO}evil.txt",
    ),
    (
        "requires-python",
        INFO + "METADATA",
        _set_header(b"Requires-Python", b">=3.99"),
        {},
        True,
        "METADATA requires-python: ['>=3.99'] is not the official",
    ),
    (
        "metadata-version",
        INFO + "METADATA",
        _set_header(b"Version", b"0.0.1"),
        {},
        True,
        f"METADATA Version ['0.0.1'] is not {PIN.overlay_version}",
    ),
    # RECORD against the wheel's own bytes, both ways
    (
        "member-not-in-record",
        RECORD,
        lambda d: _drop_row(d, "vllm/envs.py"),
        {},
        True,
        "member not in RECORD: vllm/envs.py",
    ),
    (
        "record-lists-a-dropped-member",
        "vllm/envs.py",
        lambda d: None,
        {},
        False,
        "RECORD lists vllm/envs.py, which is not in the wheel",
    ),
    (
        "changed-member-not-resigned",
        "vllm/_version.py",
        lambda d: d + b"\n",
        {},
        False,
        "RECORD row of vllm/_version.py is",
    ),
    # the other fields of WHEEL, the body of METADATA
    (
        "wheel-generator",
        INFO + "WHEEL",
        _set_header(b"Generator", b"something else"),
        {},
        True,
        "WHEEL generator: ['something else'] is not the official",
    ),
    (
        "metadata-description",
        INFO + "METADATA",
        lambda d: d + b"\nmore text\n",
        {},
        True,
        "METADATA: body differs from the official one",
    ),
    # Apache-2.0 section 4: vLLM's licence, and the notice of changed files
    (
        "vllm-licence-dropped",
        INFO + "licenses/LICENSE",
        lambda d: None,
        {},
        True,
        f"vLLM's licence file {INFO}licenses/LICENSE is missing",
    ),
    (
        "notice-dropped",
        NOTICE,
        lambda d: None,
        {},
        True,
        f"no notice of the changed files: {NOTICE}",
    ),
    (
        "notice-omits-a-changed-file",
        NOTICE,
        lambda d: b"".join(
            ln
            for ln in d.splitlines(keepends=True)
            if not ln.startswith(b"  vllm/v1/core/block_pool.py: ")
        ),
        {},
        True,
        "does not name vllm/v1/core/block_pool.py, which the build changed",
    ),
    (
        "notice-names-an-unchanged-file",
        NOTICE,
        lambda d: d + b"  vllm/envs.py: changed by 0001-x.patch\n",
        {},
        True,
        "names vllm/envs.py, which the build did not change",
    ),
    (
        "notice-not-the-trees",
        NOTICE,
        lambda d: d.replace(b"Apache License", b"MIT License"),
        {},
        True,
        f"{wheelcheck.NOTICE_MEMBER} is not the patched tree's",
    ),
    (
        "notice-not-a-license-file",
        INFO + "METADATA",
        _drop_line(b"License-File: NOTICE.vllm-overlay\n"),
        {},
        True,
        "METADATA names NOTICE.vllm-overlay as a License-File 0 times, not once",
    ),
]


@pytest.mark.parametrize(
    ("target", "change", "add", "resign", "problem"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_wheel_check_catches_damage(
    tmp_path: Path,
    target: str,
    change: Change,
    add: dict[str, bytes],
    resign: bool,
    problem: str,
) -> None:
    bad = _damage(tmp_path / built_wheel().name, target, change, add, resign)
    problems = _problems(bad)
    assert any(problem in p for p in problems), problems


def test_wheel_check_catches_a_renamed_wheel(tmp_path: Path) -> None:
    renamed = tmp_path / built_wheel().name.replace(PIN.overlay_version, "0.0.1")
    renamed.symlink_to(built_wheel())
    assert _problems(renamed) == [
        f"wheel file name {renamed.name} is not {built_wheel().name}"
    ]


def test_an_undamaged_copy_passes(tmp_path: Path) -> None:
    """The damage helper alone changes nothing the check sees, so each case
    above is caught for its damage only."""
    copy = _damage(tmp_path / built_wheel().name, "", lambda d: d, {}, True)
    assert _problems(copy) == []
