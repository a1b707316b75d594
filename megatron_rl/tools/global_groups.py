"""Reads of megatron's global ``parallel_state``, counted from the source.

Process groups are built once, by the start-up's group builder, and handed on as a
``ProcessGroupCollection``; code elsewhere that asks megatron's module globals instead ties itself
to the one layout a process holds at a time.  This counts those reads so a test can hold them to a
ceiling:

    python -m megatron_rl.tools.global_groups         # the count, then each read

A read is an attribute of a name bound to ``megatron.core.parallel_state`` (``ps.get_...``) or a
name imported from it.  ``compat/`` (workarounds of megatron's internals) and the builder are exempt.
"""

from __future__ import annotations

import ast
import os
import sys

from megatron_rl.tools.import_graph import ROOT, _runtime_nodes, source_files

MODULE = "megatron.core.parallel_state"
# Where reading megatron's globals is the job: the group builder and the compat layer.
EXEMPT = ("compat" + os.sep, os.path.join("distributed", "runtime.py"), os.path.join("distributed", "startup.py"))


def _bound_names(nodes: list[ast.AST]) -> tuple[set[str], set[str]]:
    """(names bound to the module, names bound to something imported from it)."""
    modules, members = set(), set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module == "megatron.core":
            modules.update(a.asname or a.name for a in node.names if a.name == "parallel_state")
        elif isinstance(node, ast.ImportFrom) and node.module == MODULE:
            members.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.name == MODULE and a.asname)
    return modules, members


def reads_in(path: str) -> list[str]:
    """``file:line name`` for each read of megatron's global parallel_state in ``path``."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    nodes = list(_runtime_nodes(tree))
    modules, members = _bound_names(nodes)
    rel = os.path.relpath(path, os.path.dirname(ROOT))
    out = []
    for node in nodes:
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in members and isinstance(node.ctx, ast.Load):
            out.append((node.lineno, node.id))
    return [f"{rel}:{line} {name}" for line, name in sorted(out)]


def global_group_reads() -> list[str]:
    """Every read outside ``compat/`` and the group builder."""
    out = []
    for path in source_files():
        if os.path.relpath(path, ROOT).startswith(EXEMPT):
            continue
        out.extend(reads_in(path))
    return out


def main() -> int:
    reads = global_group_reads()
    print(f"reads of megatron's global parallel_state outside compat/ and the group builder: {len(reads)}")
    for read in reads:
        print(f"  {read}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
