"""Tools a model can call: a registry of functions by name.

A tool is ``fn(**arguments) -> str`` (other results are written as JSON); raising means the
call failed, and the message becomes the observation the model sees. Built-ins:

- ``calculator(expression)``: arithmetic on numbers (``+ - * / // % **``, parentheses,
  ``sqrt``, ``abs``, ``round``, ``min``, ``max``...), parsed, never ``eval``-ed, with bounds on
  the sizes it will compute;
- ``python(code)``: the code run by :func:`megatron_gspo.toolbox.sandbox.run_python`: in a
  sandbox that sees nothing of the machine but an interpreter and a scratch directory (or on a
  remote code-execution service), with limits; its stdout (and stderr).

Users add theirs by name: ``package.module:function``.
"""

from __future__ import annotations

import ast
import logging
import math
import operator
import os
from collections.abc import Callable

from megatron_gspo.runtime.user_code import resolve
from megatron_gspo.toolbox.python_config import PythonToolConfig
from megatron_gspo.toolbox.sandbox import run_python

__all__ = ["TOOLS", "ToolError", "calculator", "make_python_tool", "resolve_tool"]

log = logging.getLogger(__name__)


class ToolError(ValueError):
    """A call a tool refuses (bad arguments, a result too large to compute)."""


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "floor": math.floor,
    "ceil": math.ceil,
    "log": math.log,
    "exp": math.exp,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}
# A bound on magnitudes and exponents: 10 ** 10 ** 10 would take the worker with it.
_LIMIT = 1e100


def _value(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 1000 or abs(left) > _LIMIT):
            raise ToolError("exponent too large")
        result = _BINARY[type(node.op)](left, right)
        if abs(result) > _LIMIT:
            raise ToolError("result too large")
        return result
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        return _FUNCTIONS[node.func.id](*[_value(a) for a in node.args])
    raise ToolError(f"not arithmetic: {ast.unparse(node)[:60]!r}")


def calculator(expression: str) -> str:
    """The value of an arithmetic expression, e.g. ``"(3 + 4) * 2"`` -> ``"14"``."""
    if not isinstance(expression, str) or len(expression) > 500:
        raise ToolError("expression must be a string of at most 500 characters")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"cannot parse {expression!r}: {e.msg}") from None
    try:
        value = _value(tree.body)
    except ToolError:
        raise
    except (ZeroDivisionError, OverflowError, ValueError, TypeError) as e:
        raise ToolError(f"{type(e).__name__}: {e}") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)


def make_python_tool(config: PythonToolConfig | dict | None = None) -> Callable[..., str]:
    """The ``python`` tool with the recipe's sandbox and limits
    (``rollout.multi_turn.env_kwargs.python``, :class:`~.python_config.PythonToolConfig`)."""
    if not isinstance(config, PythonToolConfig):
        config = PythonToolConfig.model_validate(config or {})
    if config.backend == "local" and config.sandbox == "unsafe_local":
        log.warning(
            "the python tool runs model code WITHOUT a sandbox (env_kwargs.python.sandbox: "
            "unsafe_local): it sees this machine's files and processes as %s",
            "root" if os.geteuid() == 0 else "this user",
        )

    def python(code: str) -> str:
        if not isinstance(code, str):
            raise ToolError("code must be a string")
        result = run_python(code, config)
        if not result.ok:
            raise ToolError(result.output.strip() or "failed with no output")
        return result.output.strip()

    return python


TOOLS: dict[str, Callable[..., str]] = {"calculator": calculator, "python": make_python_tool}


def resolve_tool(name: str, python: dict | None = None) -> Callable[..., str]:
    """The tool ``name``; ``python`` configures the python tool (its sandbox and limits)."""
    if name == "python":
        return make_python_tool(python)
    return resolve(name, TOOLS, key="rollout.multi_turn.env_kwargs.tools", what="tool")
