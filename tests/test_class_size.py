"""The size rules: no function of ``ray_hsdp`` over 80 lines; no class over 300 lines, counting the
``ray_hsdp`` classes it inherits from (a mixin's lines are the class's: compose instead). The typed
configuration's field declarations are not counted: the flat YAML is the users' format."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ray_hsdp"
LIMIT = 300


def class_sizes() -> dict[str, int]:
    """Each class's lines by ``module.Class``, its ``ray_hsdp`` bases' added: a base is the class of
    that name in the module it is imported from (or a module under that package), else in its own."""
    own: dict[str, tuple[int, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        imported = {  # a name in this module -> the ray_hsdp module it is imported from
            alias.asname or alias.name: node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ray_hsdp")
            for alias in node.names
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if path.parent.name == "config":  # the typed configuration's fields
                    lines -= sum(s.end_lineno - s.lineno + 1 for s in node.body if isinstance(s, ast.AnnAssign))
                bases = [(imported.get(b.id, module), b.id) for b in node.bases if isinstance(b, ast.Name)]
                own[f"{module}.{node.name}"] = (lines, bases)

    def base_of(origin: str, name: str) -> str | None:
        found = [q for q in own if q.rsplit(".", 1) == [origin, name]]
        found = found or [q for q in own if q.startswith(f"{origin}.") and q.rsplit(".", 1)[1] == name]
        return found[0] if len(found) == 1 else None

    def size(name: str) -> int:
        lines, bases = own[name]
        return lines + sum(size(base) for base in (base_of(*b) for b in bases) if base is not None)

    return {name: size(name) for name in own}


def test_no_class_is_over_300_lines_with_its_bases():
    over = {name: n for name, n in class_sizes().items() if n > LIMIT}
    assert not over, f"over {LIMIT} lines with their ray_hsdp bases: {over}"


def test_no_function_is_over_80_lines():
    """The house's other rule: a function over 80 lines holds a concern that wants a room of its own."""
    over = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 80:
                over.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
    assert not over, f"functions over 80 lines: {over}"
