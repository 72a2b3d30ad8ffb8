"""A calculator tool that evaluates arithmetic by walking Python's AST, never `eval`.

Only numbers, + - * / // % **, unary signs, parentheses and a few functions (abs, min,
max, round, sqrt) are accepted; a name, an attribute, a call to anything else
(`__import__`, `open`) is refused before anything runs.

Every step's cost is bounded before it runs, not after: the evaluation holds the
interpreter lock, so a step that runs long freezes every thread of the rollout actor and
the tool's timeout cannot fire. The expression's length bounds the number of steps; every
value has at most `max_digits` digits (checked after each step); and the two operations
whose cost grows with an argument's value are checked before they run: `**` (the result's
size, estimated from the operands' bit lengths) and `round(x, ndigits)` (|ndigits| at most
`max_digits`: rounding an integer to -10**99 digits would compute 10**10**99). The
configurable bounds are themselves capped.
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


# Caps on the config's bounds: a step on numbers of these sizes takes microseconds, and
# str() of such an integer stays under Python's 4300-digit conversion limit.
MAX_LENGTH_CAP = 10_000
MAX_DIGITS_CAP = 4_000
MAX_EXPONENT_CAP = 100_000
_LOG10_2 = math.log10(2)


def _check_pow(left: int | float, right: int | float, max_exponent: int, max_digits: int) -> None:
    """Refuse a power whose exponent or integer result is too large, before computing it."""
    if abs(right) > max_exponent:
        raise ToolError(f"exponent larger than {max_exponent}")
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if (abs(left).bit_length() - 1) * right * _LOG10_2 >= max_digits:  # a lower bound of the result's digits
            raise ToolError(f"result has more than {max_digits} digits")


def _check_call(name: str, args: list[int | float], max_digits: int) -> None:
    """Refuse a function argument whose cost grows with its value, before the call."""
    if name == "round" and len(args) == 2:
        ndigits = args[1]
        if isinstance(ndigits, int) and abs(ndigits) > max_digits:
            raise ToolError(f"round: ndigits must be between -{max_digits} and {max_digits}")


def evaluate(expression: str, *, max_length: int = 200, max_exponent: int = 1000, max_digits: int = 100) -> int | float:
    """The value of an arithmetic `expression`; ToolError for anything else."""
    if not (0 < max_length <= MAX_LENGTH_CAP and 0 < max_digits <= MAX_DIGITS_CAP and 0 < max_exponent <= MAX_EXPONENT_CAP):
        raise ToolError(f"bounds must be at most max_length {MAX_LENGTH_CAP}, max_digits {MAX_DIGITS_CAP}, max_exponent {MAX_EXPONENT_CAP}")
    limit = 10**max_digits
    if len(expression) > max_length:
        raise ToolError(f"expression longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"not an arithmetic expression: {e.msg}") from None

    def number(value: Any) -> int | float:
        if not isinstance(value, (int, float)):  # (-8) ** 0.5 is complex
            raise ToolError("result is not a real number")
        if isinstance(value, int) and abs(value) >= limit:
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
            if isinstance(node.op, ast.Pow):
                _check_pow(left, right, max_exponent, max_digits)
            try:
                return number(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("result too large") from None
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return number(_UNARY[type(node.op)](walk(node.operand)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS and not node.keywords:
            args = [walk(a) for a in node.args]
            _check_call(node.func.id, args, max_digits)
            try:
                return number(_FUNCTIONS[node.func.id](*args))
            except (TypeError, ValueError, OverflowError) as e:
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
        for key, cap in (("max_length", MAX_LENGTH_CAP), ("max_digits", MAX_DIGITS_CAP), ("max_exponent", MAX_EXPONENT_CAP)):
            if self.config[key] > cap:
                raise ValueError(f"{where}.{key}: at most {cap} (a larger bound lets one step run for minutes), got {self.config[key]!r}")
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
