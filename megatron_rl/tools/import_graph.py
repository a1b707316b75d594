"""The package's import graph, read from the source: which top-level packages import which, the
cycles among them, and the imports that run up out of ``config/`` (the bottom layer).

    python -m megatron_rl.tools.import_graph          # counts, the cycles, the upward imports

Every ``import``/``from ... import`` counts, at module level or inside a function (a deferred import
is still a dependency), except under ``if TYPE_CHECKING:``.  Package = the first name below
``megatron_rl`` (a module at the top, ``errors.py``, counts as its own package).
"""

from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What config/ may import from the package: itself, and the error types it raises.
CONFIG_MAY_IMPORT = ("config", "errors")


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "megatron_rl" else None


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (type-only imports are no
    dependency at run time)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    return (n for n in ast.walk(tree) if id(n) not in skip)


def imports_of(path: str) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every import in the file (relative ones resolved)."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    here = _module_name(path).split(".")
    if not path.endswith("__init__.py"):
        here = here[:-1]
    out = []
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            out.append((node.lineno, base))
    return out


def source_files() -> list[str]:
    files = []
    for dirpath, dirs, names in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        files.extend(os.path.join(dirpath, n) for n in sorted(names) if n.endswith(".py"))
    return files


def _imported_modules(path: str, known: set[str]) -> set[str]:
    """The package's modules the file imports: ``from pkg import mod`` counts ``pkg.mod`` when that
    is a module, else ``pkg``."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    here = _module_name(path).split(".")
    if not path.endswith("__init__.py"):
        here = here[:-1]
    out = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
    return {m for m in out if m in known}


def module_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (itself excluded)."""
    files = {_module_name(p): p for p in source_files()}
    known = set(files)
    return {m: _imported_modules(p, known) - {m} for m, p in files.items()}


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path in source_files():
        src = _package_of(_module_name(path))
        if src is None:
            continue
        graph[src]
        for _, module in imports_of(path):
            dst = _package_of(module)
            if dst is not None and dst != src:
                graph[src].add(dst)
    return dict(graph)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def upward_from_config() -> list[str]:
    """``file:line -> module`` for each import in ``config/`` of a package above it."""
    out = []
    for path in source_files():
        if _package_of(_module_name(path)) != "config":
            continue
        for line, module in imports_of(path):
            dst = _package_of(module)
            if dst is not None and dst not in CONFIG_MAY_IMPORT:
                out.append(f"{os.path.relpath(path, os.path.dirname(ROOT))}:{line} -> {module}")
    return out


def main() -> int:
    graph = package_graph()
    found = cycles(graph)
    arrows = upward_from_config()
    print(f"packages: {len(graph)}; package-level import cycles: {len(found)}")
    for component in found:
        print(f"  cycle of {len(component)}: {', '.join(component)}")
    modules = cycles(module_graph())
    print(f"module-level import cycles: {len(modules)}")
    for component in modules:
        print(f"  cycle of {len(component)}: {', '.join(component)}")
    print(f"imports out of config/ into packages above it: {len(arrows)}")
    for arrow in arrows:
        print(f"  {arrow}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
