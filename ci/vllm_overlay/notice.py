"""The notice that names every file this project changes or adds to vLLM.

vLLM is Apache-2.0; section 4(b) asks whoever redistributes modified files
to make them carry prominent notices that they were changed. The wheel
carries this notice beside vLLM's own LICENSE, in the dist-info's
``licenses/`` folder and named by a ``License-File`` field, as vLLM's wheel
names its LICENSE (PEP 639), so licence tools list both. It is rendered
from the series, overlay/ and the generated manifest, never written by
hand, and the wheel check reads its list back (``listed_files``) and
compares it with the files the build changed.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from vllm_overlay.errors import OverlayError
from vllm_overlay.manifest import MODULE as MANIFEST_MODULE
from vllm_overlay.pin import Pin
from vllm_overlay.series import Patch

NAME = "NOTICE.vllm-overlay"
# One listed file: two spaces, its upstream-relative path, ": ", how.
_ENTRY = re.compile(r"^  (\S+): ", re.M)
_NEW_FILE = re.compile(r"^--- /dev/null\n\+\+\+ (?:b/)?(\S+)", re.M)
_INTRO = """\
vllm-overlay: the files it changed or added in vLLM

This wheel is vLLM {tag} ({repository}),
as released in {wheel},
with files changed or added by the vllm-overlay project. vLLM is licensed
under the Apache License, Version 2.0: its licence is the LICENSE file
beside this one, and vllm-overlay's changes are under the same licence.
As section 4(b) of that licence asks, the list below names every file
vllm-overlay changed or added, by its path in vLLM's source tree; files
outside vllm/ are not part of the wheel. Every other file is the official
wheel's, but for the version this build sets in the metadata.
"""


def render(pin: Pin, patches: list[Patch], overlay_files: list[str]) -> str:
    """The notice for ``pin`` built with ``patches`` and ``overlay_files``."""
    by_file: dict[str, list[tuple[str, str]]] = {}
    for patch in patches:
        added = set(_NEW_FILE.findall(patch.path.read_text()))
        for target in dict.fromkeys(patch.targets):
            verb = "added by" if target in added else "changed by"
            by_file.setdefault(target, []).append((verb, patch.name))
    intro = _INTRO.format(
        wheel=pin.wheel.filename, tag=pin.tag, repository=pin.repository
    )
    lines = [intro]
    lines.append("Changed or added by the patch series (by the patches, in order):")
    for path, steps in sorted(by_file.items()):
        how = "; ".join(
            f"{verb} {', '.join(name for _, name in group)}"
            for verb, group in itertools.groupby(steps, key=lambda s: s[0])
        )
        lines.append(f"  {path}: {how}")
    if overlay_files:
        lines += ["", "Added from the overlay:"]
        lines += [f"  {path}: added" for path in overlay_files]
    lines += [
        "",
        "Added by the build:",
        f"  {MANIFEST_MODULE}: the provenance manifest "
        f"(python -m {MANIFEST_MODULE.removesuffix('.py').replace('/', '.')})",
    ]
    return "\n".join(lines) + "\n"


def listed_files(text: str) -> list[str]:
    """The paths the notice names, in its order, repeats kept."""
    return _ENTRY.findall(text)


def write_notice(tree: Path, text: str) -> Path:
    """Put the notice at the tree's root, where pyproject.toml's
    license-files patterns are relative to (``declare_in_pyproject``)."""
    target = tree / NAME
    target.write_text(text)
    return target


def declare_in_pyproject(tree: Path) -> None:
    """Add the notice to the tree's ``license-files``, so vLLM's own build
    (the setup.py routes, whose tree is all copies) ships it where the
    assemble route puts it. The file is replaced whole, never half written."""
    pyproject = tree / "pyproject.toml"
    text = pyproject.read_text()
    field = re.compile(r'^license-files = \[((?:"[^"]*"(?:, )?)*)\]$', re.M)
    match = field.search(text)
    if match is None:
        raise OverlayError(
            f"{pyproject} has no one-line license-files = [...] field",
            "vLLM changed how it declares its licence: update "
            "notice.declare_in_pyproject, or build with the default route",
        )
    if f'"{NAME}"' in match.group(1):
        return
    entries = f'{match.group(1)}, "{NAME}"' if match.group(1) else f'"{NAME}"'
    replacement = tree / "pyproject.toml.partial"
    replacement.write_text(
        text[: match.start()] + f"license-files = [{entries}]" + text[match.end() :]
    )
    replacement.replace(pyproject)
