"""The reference KV-event consumer as a distribution of its own.

``vllm/distributed/kv_events_consumer.py`` (an overlay file) runs inside the
engine as ``python -m vllm.distributed.kv_events_consumer``, but importing
``vllm`` imports torch. A router is a small service, so the main target's
build also writes ``vllm-kv-events-consumer``: a pure-Python wheel with

- ``vllm_kv_events_consumer/kv_events_consumer.py``: the overlay file, byte
  for byte. Inside this package (``__package__``) it imports its schema from
  the module beside it; inside vLLM, from the engine.
- ``vllm_kv_events_consumer/kv_events_schema.py``: generated here from the
  patched tree. Every definition the consumer imports from it, and every
  definition those need, is the engine's own source text (``ast`` finds
  them in ``vllm/distributed/kv_events.py`` and the ``vllm`` modules it
  imports them from), so the two decode and encode the same bytes.
- a console script, ``vllm-kv-events-consumer``, and ``python -m
  vllm_kv_events_consumer``.

It depends on pyzmq and msgspec with the engine wheel's own requirement
lines, and carries the engine's version. Every timestamp is the build's
``SOURCE_DATE_EPOCH``: two builds of one tree are byte-identical.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import io
import sys
import time
import zipfile
from dataclasses import dataclass
from email.parser import BytesHeaderParser
from pathlib import Path

from vllm_overlay.errors import OverlayError

DISTRIBUTION = "vllm-kv-events-consumer"
PACKAGE = "vllm_kv_events_consumer"
SCRIPT = "vllm-kv-events-consumer"
CONSUMER = "vllm/distributed/kv_events_consumer.py"
SCHEMA_SOURCE = "vllm/distributed/kv_events.py"
SCHEMA_MODULE = "kv_events_schema"
# What the consumer may import besides the standard library and its schema.
THIRD_PARTY = ("msgspec", "zmq")
REQUIREMENTS = ("pyzmq", "msgspec")
# Schema names that are a class attribute of the engine, not a module name.
CLASS_CONSTANTS = {"ZMQ_END_SEQ": ("ZmqEventPublisher", "END_SEQ")}
_FILE_ATTR = 0o100644 << 16


@dataclass(frozen=True)
class _Definition:
    source: str  # the tree path it comes from
    lineno: int
    text: str


def _fail(what: str) -> OverlayError:
    return OverlayError(
        f"cannot build the {DISTRIBUTION} wheel: {what}",
        f"keep {CONSUMER} importing only the standard library, "
        f"{', '.join(THIRD_PARTY)} and, when `__package__ == {PACKAGE!r}`, "
        f"`from .{SCHEMA_MODULE} import ...` of names defined in {SCHEMA_SOURCE} "
        "(docs/build.md, the consumer wheel)",
    )


def _is_standalone_branch(node: ast.stmt) -> bool:
    """``if __package__ == "vllm_kv_events_consumer":``"""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    test = node.test
    return (
        isinstance(test.left, ast.Name)
        and test.left.id == "__package__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == PACKAGE
    )


def schema_names(consumer: str) -> list[str]:
    """The names the consumer imports from its schema in this package, after
    checking that nothing else it imports needs vLLM."""
    module = ast.parse(consumer)
    branches = [n for n in module.body if _is_standalone_branch(n)]
    if len(branches) != 1:
        raise _fail(f"{CONSUMER} has {len(branches)} `__package__` branches, not one")
    branch = branches[0]
    assert isinstance(branch, ast.If)
    engine_only = {id(n) for s in branch.orelse for n in ast.walk(s)}
    names: list[str] = []
    for node in ast.walk(module):
        if id(node) in engine_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level != 1 or node.module != SCHEMA_MODULE:
                raise _fail(f"line {node.lineno} imports from .{node.module}")
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom | ast.Import):
            modules = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [alias.name for alias in node.names]
            )
            for name in modules:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in THIRD_PARTY:
                    raise _fail(f"line {node.lineno} imports {name}")
    if not names:
        raise _fail(f"{CONSUMER} imports nothing from .{SCHEMA_MODULE}")
    return names


class _Module:
    """One module of the tree: its top-level definitions and imports."""

    def __init__(self, tree: Path, path: str) -> None:
        self.path = path
        file = tree / path
        if not file.is_file():
            raise _fail(f"{file} does not exist")
        self.text = file.read_text()
        self.lines = self.text.splitlines()
        self.ast = ast.parse(self.text)
        self.defs: dict[str, ast.stmt] = {}
        self.imports: dict[str, tuple[str, str | None]] = {}
        for node in self.ast.body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef):
                self.defs[node.name] = node
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.defs[target.id] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                self.defs[node.target.id] = node
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    bound = alias.asname or alias.name.split(".")[0]
                    self.imports[bound] = (alias.name, None)

    def text_of(self, node: ast.stmt) -> str:
        """The node's lines, with the comment lines right above it."""
        assert node.end_lineno is not None
        start = node.lineno - 1
        while start > 0 and self.lines[start - 1].startswith("#"):
            start -= 1
        return "\n".join(self.lines[start : node.end_lineno])


def _names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def schema_module(tree: Path, names: list[str], version: str) -> str:
    """The text of ``kv_events_schema.py``: the definitions of ``names`` in
    the patched tree, and of everything they use, in source order."""
    modules: dict[str, _Module] = {}

    def module(path: str) -> _Module:
        if path not in modules:
            modules[path] = _Module(tree, path)
        return modules[path]

    definitions: dict[tuple[str, str], _Definition] = {}
    imports: set[tuple[str, str | None, str]] = set()
    constants: list[str] = []
    pending: list[tuple[str, str]] = []
    for name in names:
        if name in CLASS_CONSTANTS:
            cls_name, attr = CLASS_CONSTANTS[name]
            value = _class_constant(module(SCHEMA_SOURCE), cls_name, attr)
            constants.append(
                f"# {SCHEMA_SOURCE}, {cls_name}.{attr}\n"
                f"{name} = {ast.get_source_segment(module(SCHEMA_SOURCE).text, value)}"
            )
            pending += [(SCHEMA_SOURCE, n) for n in _names_in(value)]
        else:
            pending.append((SCHEMA_SOURCE, name))
    wanted = set(names)
    while pending:
        path, name = pending.pop()
        mod = module(path)
        if (path, name) in definitions:
            continue
        if name in mod.defs:
            node = mod.defs[name]
            definitions[(path, name)] = _Definition(
                path, node.lineno, mod.text_of(node)
            )
            pending += [(path, n) for n in _names_in(node)]
        elif name in mod.imports:
            source, original = mod.imports[name]
            top = source.split(".")[0]
            if top == "vllm" and original is not None:
                pending.append((source.replace(".", "/") + ".py", original))
            elif top in sys.stdlib_module_names or top in THIRD_PARTY:
                imports.add((source, original, name))
            else:
                raise _fail(f"{path} takes {name} from {source}")
        elif name in wanted and path == SCHEMA_SOURCE:
            raise _fail(f"{SCHEMA_SOURCE} defines no {name}")
        # else a local name (an argument, ``self``) or a builtin
    engine = [d for d in definitions.values() if d.source != SCHEMA_SOURCE]
    own = [d for d in definitions.values() if d.source == SCHEMA_SOURCE]
    out = [
        "# SPDX-License-Identifier: Apache-2.0",
        "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project",
        f'"""The KV-event wire schema of vLLM {version}, for the reference consumer.',
        "",
        "Generated by vllm-overlay's build (ci/vllm_overlay/consumer_dist.py) from",
        "the patched tree: each definition below is the engine's own text, from",
        "the file its comment names. Do not edit; change the engine instead.",
        '"""',
        "",
    ]
    std = sorted(i for i in imports if i[0].split(".")[0] not in THIRD_PARTY)
    third = sorted(i for i in imports if i[0].split(".")[0] in THIRD_PARTY)
    for group in (std, third):
        out += [_import_line(*i) for i in _merge(group)]
        if group:
            out.append("")
    for definition in [
        *sorted(engine, key=lambda d: (d.source, d.lineno)),
        *sorted(own, key=lambda d: d.lineno),
    ]:
        out += ["", f"# {definition.source}", definition.text, ""]
    for constant in constants:
        out += ["", constant, ""]
    text = "\n".join(out).rstrip("\n") + "\n"
    compile(text, f"{PACKAGE}/{SCHEMA_MODULE}.py", "exec")
    return text


def _merge(
    imports: list[tuple[str, str | None, str]],
) -> list[tuple[str, list[str] | None]]:
    merged: dict[str, list[str]] = {}
    plain: list[tuple[str, list[str] | None]] = []
    for source, original, _ in imports:
        if original is None:
            plain.append((source, None))
        else:
            merged.setdefault(source, []).append(original)
    return [*plain, *((s, sorted(n)) for s, n in merged.items())]


def _import_line(source: str, names: list[str] | None) -> str:
    if names is None:
        return f"import {source}"
    return f"from {source} import {', '.join(names)}"


def _class_constant(mod: _Module, cls_name: str, attr: str) -> ast.expr:
    node = mod.defs.get(cls_name)
    if isinstance(node, ast.ClassDef):
        for item in node.body:
            if (
                isinstance(item, ast.Assign)
                and len(item.targets) == 1
                and isinstance(item.targets[0], ast.Name)
                and item.targets[0].id == attr
            ):
                return item.value
    raise _fail(f"{mod.path} has no {cls_name}.{attr}")


def engine_metadata(engine_wheel: Path) -> tuple[str, str, list[str], bytes]:
    """From the engine wheel: its version, Requires-Python, the requirement
    lines of what the consumer uses, and vLLM's LICENSE."""
    with zipfile.ZipFile(engine_wheel) as archive:
        members = archive.namelist()
        infos = [m for m in members if m.endswith(".dist-info/METADATA")]
        licences = [m for m in members if m.endswith(".dist-info/licenses/LICENSE")]
        if len(infos) != 1 or len(licences) != 1:
            raise OverlayError(
                f"{engine_wheel} has {len(infos)} METADATA and {len(licences)} "
                "licenses/LICENSE, not one each",
                "build the engine wheel again (./build.sh)",
            )
        metadata = BytesHeaderParser().parsebytes(archive.read(infos[0]))
        licence = archive.read(licences[0])
    requires = []
    for wanted in REQUIREMENTS:
        lines = [
            line
            for line in metadata.get_all("Requires-Dist", [])
            if _requirement_name(line) == wanted
        ]
        if len(lines) != 1:
            raise OverlayError(
                f"{engine_wheel} requires {wanted} {len(lines)} times, not once",
                f"give {DISTRIBUTION} its requirement by hand in "
                "ci/vllm_overlay/consumer_dist.py",
            )
        requires += lines
    return metadata["Version"], metadata["Requires-Python"], requires, licence


def _requirement_name(line: str) -> str:
    name = line
    for stop in "<>=!~;[ (":
        name = name.split(stop, 1)[0]
    return name.strip().lower().replace("_", "-")


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def wheel_members(tree: Path, engine_wheel: Path) -> dict[str, bytes]:
    """Every member of the consumer wheel but RECORD, by name."""
    version, requires_python, requires, licence = engine_metadata(engine_wheel)
    consumer = (tree / CONSUMER).read_bytes()
    schema = schema_module(tree, schema_names(consumer.decode()), version)
    info = f"{PACKAGE}-{version}.dist-info"
    summary = (
        "The reference consumer of vLLM's KV-cache event stream "
        "(vllm-overlay), without the engine"
    )
    metadata = "".join(
        f"{k}: {v}\n"
        for k, v in [
            ("Metadata-Version", "2.4"),
            ("Name", DISTRIBUTION),
            ("Version", version),
            ("Summary", summary),
            ("License-Expression", "Apache-2.0"),
            ("License-File", "LICENSE"),
            ("License-File", "NOTICE.vllm-overlay"),
            ("Requires-Python", requires_python),
            *(("Requires-Dist", line) for line in requires),
        ]
    )
    notice = (
        f"{DISTRIBUTION} {version} is part of vllm-overlay, a patched vLLM.\n\n"
        f"{PACKAGE}/kv_events_consumer.py is {CONSUMER} of the vllm {version}\n"
        "wheel, a file vllm-overlay adds to vLLM.\n"
        f"{PACKAGE}/{SCHEMA_MODULE}.py holds definitions taken unchanged from\n"
        f"{SCHEMA_SOURCE} (and the vllm modules it imports them from) of the\n"
        f"vllm {version} wheel, files that vllm-overlay's patch series may\n"
        "change: that wheel's licenses/NOTICE.vllm-overlay lists the changes.\n"
    )
    init = (
        f'"""The reference consumer of vLLM\'s KV-cache event stream, without\n'
        "the engine: ``vllm-kv-events-consumer --help``; the API is\n"
        f'``{PACKAGE}.kv_events_consumer`` (``Follower``, ``Mirror``)."""\n\n'
        f"__version__ = {version!r}\n"
    )
    main = (
        f'"""``python -m {PACKAGE}``: the reference consumer\'s command line."""\n\n'
        "import sys\n\n"
        f"from {PACKAGE}.kv_events_consumer import main\n\n"
        f'sys.exit(main(prog="python -m {PACKAGE}"))\n'
    )
    return {
        f"{PACKAGE}/__init__.py": init.encode(),
        f"{PACKAGE}/__main__.py": main.encode(),
        f"{PACKAGE}/kv_events_consumer.py": consumer,
        f"{PACKAGE}/{SCHEMA_MODULE}.py": schema.encode(),
        f"{info}/METADATA": metadata.encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\n"
            b"Generator: vllm-overlay (ci/vllm_overlay/consumer_dist.py)\n"
            b"Root-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
        f"{info}/entry_points.txt": (
            f"[console_scripts]\n{SCRIPT} = {PACKAGE}.kv_events_consumer:main\n"
        ).encode(),
        f"{info}/top_level.txt": f"{PACKAGE}\n".encode(),
        f"{info}/licenses/LICENSE": licence,
        f"{info}/licenses/NOTICE.vllm-overlay": notice.encode(),
    }


def wheel_name(version: str) -> str:
    """The consumer wheel's file name for the engine version ``version``."""
    return f"{PACKAGE}-{version}-py3-none-any.whl"


def build_consumer_wheel(
    tree: Path, engine_wheel: Path, out_dir: Path, epoch: int
) -> Path:
    """Write the consumer wheel of ``tree`` into ``out_dir`` (emptied first:
    dist/ may hold a hard link of the last one) and return it."""
    members = wheel_members(tree, engine_wheel)
    info = next(n.split("/")[0] for n in members if n.endswith("/METADATA"))
    version = info.removeprefix(f"{PACKAGE}-").removesuffix(".dist-info")
    record = io.StringIO()
    for name, data in members.items():
        record.write(f"{name},{_record_hash(data)},{len(data)}\n")
    record.write(f"{info}/RECORD,,\n")
    members[f"{info}/RECORD"] = record.getvalue().encode()
    if out_dir.exists():
        for old in out_dir.iterdir():
            old.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / wheel_name(version)
    stamp = time.gmtime(max(epoch, 315532800))[:6]  # zip dates start in 1980
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in members.items():
            member = zipfile.ZipInfo(name, date_time=stamp)
            member.compress_type = zipfile.ZIP_DEFLATED
            member.external_attr = _FILE_ATTR
            member.create_system = 3
            archive.writestr(member, data)
    return wheel
