"""How a model writes a tool call, and how the answer is shown to it: the call formats.

- `hermes` (verl's and Qwen's default): `<tool_call>{"name": "calculator", "arguments":
  {"expression": "23 + 58"}}</tool_call>`; every complete call of a turn runs, in order;
  the turn is kept as generated. Observation: `<tool_response>\\n{result}\\n</tool_response>\\n`.
- `words`: for vocabularies without tags or JSON (the tiny digit model): `NAME : ARGS =`,
  NAME a configured tool's name, ARGS the text up to the next `=`, or to the end of the turn
  when the turn ends first; ARGS goes to the tool's one required string argument. One call
  per turn: the turn is cut right after the call's `=` (a stop string), and the
  observation is the result text itself.

In both, the text parsed for a conversation's first turn is the decoded prompt followed
by the turn, and a call counts only if it ends inside the turn: a call the prompt opens
(the prompt ends with `add :`, or with `<tool_call>{"name": ...`) is completed by the
model; a complete call inside the prompt (an example) is not run again.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: Any  # the JSON arguments; None when the call is malformed
    end: int  # offset just past the call in the parsed text
    error: str | None = None  # a malformed call: what the model reads instead of a result


class CallFormat:
    name = ""
    stop_after_call = False  # cut the turn right after its first call
    observation_template = "{result}"

    def find_calls(self, text: str, start: int, tools: Mapping[str, Any]) -> list[ParsedCall]:
        raise NotImplementedError


class HermesFormat(CallFormat):
    name = "hermes"
    observation_template = "<tool_response>\n{result}\n</tool_response>\n"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def find_calls(self, text: str, start: int, tools: Mapping[str, Any]) -> list[ParsedCall]:
        calls = []
        for m in self._CALL.finditer(text):
            if m.end() <= start:
                continue
            try:
                body = json.loads(m.group(1))
                name, args = body["name"], body.get("arguments", {})
                if isinstance(args, str):  # some models write the arguments as a JSON string
                    args = json.loads(args)
                if not isinstance(name, str):
                    raise TypeError("name is not a string")
            except (ValueError, KeyError, TypeError) as e:
                calls.append(ParsedCall("", None, m.end(), f"malformed tool call ({type(e).__name__}: {e}); write "
                                        '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'))  # fmt: skip
                continue
            calls.append(ParsedCall(name, args, m.end()))
        return calls


class WordsFormat(CallFormat):
    name = "words"
    stop_after_call = True

    def find_calls(self, text: str, start: int, tools: Mapping[str, Any]) -> list[ParsedCall]:
        if not tools:
            return []
        names = "|".join(re.escape(n) for n in sorted(tools, key=len, reverse=True))
        pattern = re.compile(rf"(?<![A-Za-z0-9_])({names})\s*:\s*([^=]*?)\s*(=|\Z)", re.DOTALL)
        for m in pattern.finditer(text):
            closed_by_end = m.group(3) == ""
            if m.end() <= start and not (closed_by_end and m.end() == len(text)):
                continue
            tool = tools[m.group(1)]
            argument = single_string_argument(tool.parameters)
            if argument is None:
                why = f"tool {m.group(1)} takes no single text argument; use format hermes"
                return [ParsedCall(m.group(1), None, m.end(), why)]
            return [ParsedCall(m.group(1), {argument: m.group(2)}, m.end())]
        return []


def single_string_argument(parameters: Mapping[str, Any]) -> str | None:
    """The argument a `words` call's text goes to: the one required argument (or the one
    argument) of type string."""
    props = parameters.get("properties") or {}
    required = parameters.get("required") or list(props)
    strings = [k for k in required if (props.get(k) or {}).get("type", "string") == "string"]
    return strings[0] if len(strings) == 1 else None


FORMATS: dict[str, type[CallFormat]] = {"hermes": HermesFormat, "words": WordsFormat}


def call_format(name: str) -> CallFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown tool call format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]()
