"""verl's multi-turn layout: the tool config file and the per-row tool arguments.

The tool config file (verl's `actor_rollout_ref.rollout.multi_turn.tool_config_path`,
ratchet's `rollout.multi_turn.tools_config`):

    tools:
      - class_name: calculator            # or verl.tools...., or my_pkg.tools:MyTool
        config: {type: native, timeout_s: 5}
        tool_schema:                      # OpenAI function schema; its name is what the model writes
          type: function
          function: {name: calculator, description: ..., parameters: {type: object, properties: ..., required: [...]}}

A data row's `extra_info` may carry verl's `tools_kwargs` ({tool name: {create_kwargs,
execute_kwargs, calc_reward_kwargs, release_kwargs}}) and `interaction_kwargs`; ratchet
checks the former names only configured tools, hands `create_kwargs` to a tool that has a
`bind(create_kwargs)` method, and keeps both in `extra_info` for the reward function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ratchet.catalog.tools import check_class_name, resolve_class

TOOLS_KWARGS_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")
# verl's generic per-tool config keys; `type: native` is the only kind ratchet runs.
_VERL_CONFIG_KEYS = ("type",)


@dataclass(frozen=True)
class ToolSpec:
    class_name: str
    config: dict = field(default_factory=dict)
    tool_schema: dict | None = None

    @property
    def name(self) -> str | None:
        return ((self.tool_schema or {}).get("function") or {}).get("name")

    def as_dict(self) -> dict:
        out: dict[str, Any] = {"class_name": self.class_name, "config": dict(self.config)}
        if self.tool_schema is not None:
            out["tool_schema"] = self.tool_schema
        return out


def parse_tools(data: Any, where: str = "tools_config") -> list[ToolSpec]:
    """The tool specs of a tool config (`{"tools": [...]}` or the list itself); ValueError
    naming the entry and field that is wrong."""
    entries = data.get("tools") if isinstance(data, Mapping) else data
    if isinstance(data, Mapping) and set(data) - {"tools"}:
        raise ValueError(f"{where}: unknown top-level key(s) {', '.join(sorted(set(data) - {'tools'}))}; expected only tools")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: expected a non-empty list under tools:, got {entries!r}")
    specs, names = [], set()
    for i, entry in enumerate(entries):
        at = f"{where}: tools[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{at}: expected a mapping with class_name, config, tool_schema; got {entry!r}")
        unknown = set(entry) - {"class_name", "config", "tool_schema"}
        if unknown:
            raise ValueError(f"{at}: unknown key(s) {', '.join(sorted(unknown))}; expected class_name, config, tool_schema")
        check_class_name(entry.get("class_name"), f"{at}.class_name")
        config = entry.get("config") or {}
        if not isinstance(config, Mapping):
            raise ValueError(f"{at}.config: expected a mapping, got {config!r}")
        kind = config.get("type", "native")
        if kind != "native":
            raise ValueError(f"{at}.config.type: only native tools run in ratchet, got {kind!r} (MCP tools are not supported)")
        schema = entry.get("tool_schema")
        if schema is not None:
            _check_schema(schema, f"{at}.tool_schema")
        spec = ToolSpec(entry["class_name"], {k: v for k, v in config.items() if k not in _VERL_CONFIG_KEYS}, schema)
        if spec.name is not None and spec.name in names:  # without a schema: the class's own name (build_tools checks)
            raise ValueError(f"{at}.tool_schema.function.name: {spec.name!r} is used by another tool; names must be unique")
        names.add(spec.name)
        specs.append(spec)
    return specs


def _check_schema(schema: Any, at: str) -> None:
    if not isinstance(schema, Mapping) or schema.get("type", "function") != "function":
        raise ValueError(f"{at}: expected an OpenAI function schema {{type: function, function: {{name, parameters}}}}, got {schema!r}")
    fn = schema.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
        raise ValueError(f"{at}.function.name: a non-empty string is required (the name the model calls the tool by)")
    params = fn.get("parameters", {"type": "object"})
    if not isinstance(params, Mapping) or params.get("type", "object") != "object":
        raise ValueError(f"{at}.function.parameters: expected a JSON schema of type object, got {params!r}")
    props = params.get("properties") or {}
    if not isinstance(props, Mapping):
        raise ValueError(f"{at}.function.parameters.properties: expected a mapping, got {props!r}")
    required = params.get("required") or []
    if not isinstance(required, list) or any(r not in props for r in required):
        raise ValueError(f"{at}.function.parameters.required: names must be listed in properties ({', '.join(props)}), got {required!r}")


def load_tools_file(path: str | Path, where: str = "rollout.multi_turn.tools_config") -> list[ToolSpec]:
    import yaml

    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"{where}: tool config file not found: {p.resolve()}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: cannot read {p}: {str(e).splitlines()[0]}") from None
    return parse_tools(data, f"{where} ({p})")


def build_tools(specs: list[ToolSpec], where: str = "rollout.multi_turn.tools") -> dict:
    """The tools by the name the model calls them, built from their classes now."""
    tools: dict = {}
    for i, spec in enumerate(specs):
        at = f"{where}[{i}]"
        cls = resolve_class(spec.class_name, f"{at}.class_name")
        try:
            tool = cls(config=dict(spec.config), tool_schema=spec.tool_schema)
        except ValueError as e:
            raise ValueError(f"{at}.config: {e}") from None
        for member in ("name", "parameters", "timeout_s"):
            if not hasattr(tool, member):
                raise ValueError(f"{at}.class_name: {spec.class_name} is not a tool: it has no {member!r} (ratchet.tools.base.Tool)")
        if tool.name in tools:
            raise ValueError(f"{at}: a second tool named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def parse_tools_kwargs(extra_info: Any, tool_names: set[str] | frozenset[str], where: str) -> dict[str, dict]:
    """The `tools_kwargs` of a row's extra_info ({} when absent), checked against the
    configured tool names; ValueError naming the row's field otherwise."""
    if not isinstance(extra_info, Mapping) or extra_info.get("tools_kwargs") is None:
        return {}
    kwargs = extra_info["tools_kwargs"]
    at = f"{where}.extra_info.tools_kwargs"
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"{at}: expected a mapping of tool name to {{create_kwargs, ...}}, got {kwargs!r}")
    out = {}
    for name, entry in kwargs.items():
        if name not in tool_names:
            raise ValueError(f"{at}.{name}: no tool of that name is configured; tools: {', '.join(sorted(tool_names))}")
        if not isinstance(entry, Mapping) or set(entry) - set(TOOLS_KWARGS_KEYS):
            raise ValueError(f"{at}.{name}: expected a mapping with keys among {', '.join(TOOLS_KWARGS_KEYS)}, got {entry!r}")
        for key, value in entry.items():
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"{at}.{name}.{key}: expected a mapping, got {value!r}")
        out[name] = {k: dict(v or {}) for k, v in entry.items()}
    return out


def tool_issues(tools: list[dict], where: str = "rollout.multi_turn.tools") -> list[tuple[str, str]]:
    """(field, problem) for a tool list that does not build on this machine (a class that
    does not import, a bad config value): the submit-time check, before any work starts."""
    try:
        build_tools(parse_tools({"tools": tools}, where), where)
    except ValueError as e:
        text = str(e)
        field, sep, message = text.partition(": ")
        return [(field, message) if sep and field.startswith(where) else (where, text)]
    return []


def absolute_class_paths(specs: list[ToolSpec]) -> list[ToolSpec]:
    """Specs whose 'path/to/file.py:Class' names are absolute: workers run in other folders."""
    out = []
    for spec in specs:
        target, sep, attr = spec.class_name.rpartition(":")
        if sep and target.endswith(".py"):
            spec = ToolSpec(f"{Path(target).expanduser().resolve()}:{attr}", spec.config, spec.tool_schema)
        out.append(spec)
    return out
