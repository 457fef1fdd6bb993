"""Import vLLM's compiled modules and say what each registers.

Run by the extension venv's python (CUDA torch), not the harness's, so it
needs nothing but the standard library, torch and the vllm package that
``sys.path`` finds. Prints one JSON object:

- ``ops``: for each module, the ops it added to torch's dispatcher, as
  ``{"namespace::name": schema}``, in import order (``import vllm`` first,
  so torch's own lazily registered ops are not counted);
- ``errors``: the modules that did not import, with the error;
- ``references``: the ``torch.ops.NS.NAME`` the package's Python refers to;
- ``vllm``, ``torch``, ``cuda``: where vllm came from, torch's version and
  its CUDA version.

    python extension_probe.py MODULE...
"""

from __future__ import annotations

import ast
import importlib
import json
import sys
from pathlib import Path

import torch
import vllm


def _all_ops() -> set[str]:
    return set(torch._C._dispatch_get_all_op_names())


def _schema(op: str) -> str:
    return "; ".join(sorted(str(s) for s in torch._C._jit_get_schemas_for_operator(op)))


def _references(root: Path) -> dict[str, list[str]]:
    """``torch.ops.NS.NAME`` attribute chains in every module of the package."""
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
            match node:
                case ast.Attribute(
                    attr=name,
                    value=ast.Attribute(
                        attr=namespace,
                        value=ast.Attribute(attr="ops", value=ast.Name(id="torch")),
                    ),
                ):
                    found.setdefault(namespace, set()).add(name)
    return {ns: sorted(names) for ns, names in sorted(found.items())}


def main(modules: list[str]) -> None:
    ops: dict[str, dict[str, str]] = {}
    errors: dict[str, str] = {}
    for module in modules:
        before = _all_ops()
        try:
            importlib.import_module(f"vllm.{module}")
        except Exception as e:  # every failure is reported, not just the first
            errors[module] = f"{type(e).__name__}: {e}"
            continue
        ops[module] = {op: _schema(op) for op in sorted(_all_ops() - before)}
    root = Path(vllm.__file__).parent
    json.dump(
        {
            "ops": ops,
            "errors": errors,
            "references": _references(root),
            "vllm": str(root),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
