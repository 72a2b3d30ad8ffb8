"""The contract of a tool: a name, a JSON schema of its arguments, a call that returns text.

A tool never raises into the rollout: `run_tool` turns a bad argument, an exception or a
timeout into the observation text the model then reads (docs/multi_turn.md).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, runtime_checkable

DEFAULT_TIMEOUT_S = 10.0


@runtime_checkable
class Tool(Protocol):
    """Built as `cls(config: dict, tool_schema: dict)` (verl's `BaseTool` signature): `config`
    the tool's own settings from the tool config, `tool_schema` the OpenAI function schema
    ({"type": "function", "function": {"name", "description", "parameters"}})."""

    name: str  # what the model writes to call it (tool_schema.function.name)
    parameters: dict  # JSON schema (type object) of the arguments
    timeout_s: float  # a call that runs longer answers with an error observation

    def __call__(self, args: dict[str, Any]) -> str:
        """The observation text for `args`. Deterministic given `args` (a retried rollout
        must see the same text); may raise: the error becomes the observation."""
        ...


class ToolError(Exception):
    """A tool's own refusal (a bad expression, a limit hit): its message is the observation."""


@dataclass(frozen=True)
class ToolOutcome:
    text: str  # what the model reads
    error: bool  # the call failed (bad arguments, an exception, a timeout)


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def check_arguments(parameters: Mapping[str, Any], args: Any) -> str | None:
    """Why `args` does not fit the JSON schema `parameters` (required keys, unknown keys,
    the types of the top-level properties), or None. A small subset of JSON schema: what
    a function-calling model's arguments are checked against."""
    if not isinstance(args, dict):
        return f"arguments must be a JSON object, got {type(args).__name__}"
    props = parameters.get("properties") or {}
    missing = [k for k in parameters.get("required") or [] if k not in args]
    if missing:
        return f"missing argument(s) {', '.join(missing)}"
    unknown = [k for k in args if k not in props]
    if unknown and props:
        return f"unknown argument(s) {', '.join(unknown)}; this tool takes {', '.join(props)}"
    for key, value in args.items():
        kind = (props.get(key) or {}).get("type")
        allowed = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        is_bool_as_number = kind in ("integer", "number") and isinstance(value, bool)
        if allowed is not None and (not isinstance(value, allowed) or is_bool_as_number):
            return f"argument {key} must be {kind}, got {type(value).__name__}"
    return None


def run_tool(tool: Tool, args: Any) -> ToolOutcome:
    """Call `tool` in a thread of its own, at most `tool.timeout_s`: whatever happens, an
    observation. A timed-out Python tool's thread cannot be stopped and is left to finish
    (daemon); the code runner kills its own process at its limit."""
    problem = check_arguments(tool.parameters, args)
    if problem is not None:
        return ToolOutcome(f"error: {problem}", True)
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["text"] = str(tool(args))
        except ToolError as e:
            box["error"] = str(e)
        except Exception as e:  # noqa: BLE001 - any failure of a tool is the model's observation
            box["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=call, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(tool.timeout_s)
    if thread.is_alive():
        return ToolOutcome(f"error: tool {tool.name} timed out after {tool.timeout_s:g} s", True)
    if "error" in box:
        return ToolOutcome(f"error: {box['error']}", True)
    return ToolOutcome(box.get("text", ""), False)


def take_config(config: Mapping[str, Any] | None, defaults: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`config` over `defaults`, refusing keys a tool does not know (a typo would otherwise
    silently keep the default limit) and values of the wrong type."""
    config = dict(config or {})
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; this tool's keys: {', '.join(sorted(defaults))}")
    out = dict(defaults)
    for key, value in config.items():
        default = defaults[key]
        if isinstance(default, bool) != isinstance(value, bool) or (
            default is not None and not isinstance(value, (int, float) if isinstance(default, (int, float)) else type(default))
        ):
            raise ValueError(f"{where}.{key}: expected {type(default).__name__}, got {value!r}")
        if isinstance(default, (int, float)) and not isinstance(default, bool) and value <= 0:
            raise ValueError(f"{where}.{key}: must be > 0, got {value!r}")
        out[key] = value
    return out


def schema_name(tool_schema: Mapping[str, Any]) -> str:
    return str(((tool_schema or {}).get("function") or {}).get("name", ""))


def schema_parameters(tool_schema: Mapping[str, Any]) -> dict:
    return dict(((tool_schema or {}).get("function") or {}).get("parameters") or {"type": "object", "properties": {}})
