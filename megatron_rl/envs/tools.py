"""Tools the built-in tool-calling environment dispatches to, and their bounded execution.

A tool is a module-level function taking keyword arguments and returning something ``str()`` can
show.  Each call runs in a worker process of :mod:`megatron_rl.rewards.bounded` (one per calling
thread, so the calls of many trajectories run at once), bounded by ``timeout_s``: a call that
overruns is killed with its process and answered with an error observation.  The workers run
sandboxed (:func:`megatron_rl.rewards.worker.enter_sandbox`): in a scratch directory of their own,
without network.
"""

from __future__ import annotations

import ast
import operator
import tempfile
import threading
from typing import Optional

from megatron_rl.rewards.bounded import Worker, grader_spec

# Built-in tools: name -> "module:function".
TOOLS = {
    "calculator": "megatron_rl.envs.tools:calculator",
}

MAX_DIGITS = 1000  # results and operands past this many digits are refused (no unbounded arithmetic)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _bounded(value):
    if isinstance(value, int) and abs(value).bit_length() > MAX_DIGITS * 3.33:
        raise ValueError("result too large")
    return value


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression: {ast.unparse(node)}")


def calculator(expression: str) -> str:
    """Arithmetic on numbers: + - * / // % ** and parentheses.  ``"12*(3+4)"`` -> ``"84"``."""
    if not isinstance(expression, str) or len(expression) > 200:
        raise ValueError("expression must be a string of at most 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    value = _eval(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def tool_spec(name: str, target) -> str:
    """``module:function`` of a tool given by built-in name, spec string or function."""
    if callable(target):
        return grader_spec(target)
    target = TOOLS.get(target, target) if isinstance(target, str) else target
    if not isinstance(target, str) or ":" not in target:
        raise ValueError(f"tool {name!r}: {target!r} is not a built-in tool ({', '.join(TOOLS)}) or 'module:function'")
    return target


_LOCAL = threading.local()


def _worker() -> Worker:
    worker = getattr(_LOCAL, "worker", None)
    if worker is None:
        worker = _LOCAL.worker = Worker(sandbox=tempfile.mkdtemp(prefix="megatron_rl_tool_"))
    return worker


class ToolTimeout(Exception):
    """A tool call ran past its time bound (its worker was killed)."""


def call_tool(spec: str, arguments: dict, timeout_s: Optional[float]) -> str:
    """``function(**arguments)`` as a string, in this thread's sandboxed worker, bounded by
    ``timeout_s`` (None: in this process, unbounded; for tests and debugging).  Raises
    :class:`ToolTimeout`, or the worker's error (a ``GraderError`` naming the exception)."""
    if timeout_s is None:
        from megatron_rl.rewards.locations import import_spec

        return str(import_spec(spec)(**arguments))
    values, late = _worker().grade(spec, [()], arguments, timeout_s, result="text")
    if late:
        raise ToolTimeout(f"timed out after {timeout_s:g} s")
    return values[0]


def resolve_tools(tools) -> dict[str, str]:
    """``{name: "module:function"}`` from a list of built-in names and/or a ``{name: spec}`` dict."""
    if isinstance(tools, dict):
        return {name: tool_spec(name, target) for name, target in tools.items()}
    return {name: tool_spec(name, name) for name in tools}
