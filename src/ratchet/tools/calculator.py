"""A calculator tool that evaluates arithmetic by walking Python's AST, never `eval`.

Only numbers, + - * / // % **, unary signs, parentheses and a few functions (abs, min,
max, round, sqrt) are accepted; a name, an attribute, a call to anything else
(`__import__`, `open`) is refused before anything runs. Sizes are bounded (expression
length, exponent, result digits) so a call cannot take the worker's memory or time.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

from .base import DEFAULT_TIMEOUT_S, ToolError, schema_name, schema_parameters, take_config

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {"abs": abs, "min": min, "max": max, "round": round, "sqrt": math.sqrt}

DEFAULT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+ - * / // % **, parentheses, abs, min, max, round, sqrt).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (23 + 58) * 2"}},
            "required": ["expression"],
        },
    },
}


def evaluate(expression: str, *, max_length: int = 200, max_exponent: int = 1000, max_digits: int = 100) -> int | float:
    """The value of an arithmetic `expression`; ToolError for anything else."""
    if len(expression) > max_length:
        raise ToolError(f"expression longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"not an arithmetic expression: {e.msg}") from None

    def number(value: Any) -> int | float:
        if isinstance(value, int) and abs(value) >= 10**max_digits:
            raise ToolError(f"result has more than {max_digits} digits")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("result is not a finite number")
        return value

    def walk(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return number(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > max_exponent:
                raise ToolError(f"exponent larger than {max_exponent}")
            try:
                return number(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("result too large") from None
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return number(_UNARY[type(node.op)](walk(node.operand)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS and not node.keywords:
            try:
                return number(_FUNCTIONS[node.func.id](*[walk(a) for a in node.args]))
            except (TypeError, ValueError) as e:
                raise ToolError(f"{node.func.id}: {e}") from None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            what = f"calling {node.func.id}"
        else:
            what = f"the name {node.id!r}" if isinstance(node, ast.Name) else type(node).__name__
        raise ToolError(f"{what} is not allowed; only numbers, + - * / // % **, parentheses and {', '.join(_FUNCTIONS)}")

    return walk(tree)


def format_number(value: int | float) -> str:
    """92, not 92.0; floats to 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


class Calculator:
    """verl layout: `class_name: calculator` (or ratchet.tools.calculator.Calculator); config
    keys timeout_s, max_length, max_exponent, max_digits. The argument is `expression`, or
    the tool's one required string argument under whatever name its schema gives it."""

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        where = "tools.calculator.config"
        self.config = take_config(
            config, {"timeout_s": DEFAULT_TIMEOUT_S, "max_length": 200, "max_exponent": 1000, "max_digits": 100}, where
        )
        tool_schema = tool_schema or DEFAULT_SCHEMA
        self.name = schema_name(tool_schema) or "calculator"
        self.parameters = schema_parameters(tool_schema)
        self.timeout_s = float(self.config["timeout_s"])
        required = self.parameters.get("required") or []
        props = self.parameters.get("properties") or {}
        self.argument = "expression" if "expression" in props else (required or ["expression"])[0]

    def __call__(self, args: dict[str, Any]) -> str:
        expression = args.get(self.argument)
        if not isinstance(expression, str):
            raise ToolError(f"argument {self.argument} must be a string")
        c = self.config
        value = evaluate(expression, max_length=c["max_length"], max_exponent=c["max_exponent"], max_digits=c["max_digits"])
        return format_number(value)
