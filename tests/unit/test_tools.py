"""The tools of multi-turn rollouts (src/ratchet/tools/): the calculator (no eval), the code
runner's limits, the call formats, verl's tool-config and data layout with errors naming
the field. No Ray, no torch."""

from __future__ import annotations

import json
import textwrap
import time

import pytest

from ratchet.tools.base import ToolError, check_arguments, run_tool
from ratchet.tools.calculator import Calculator, evaluate, format_number
from ratchet.tools.code_runner import CodeRunner
from ratchet.tools.config import build_tools, load_tools_file, parse_tools, parse_tools_kwargs
from ratchet.tools.parsing import HermesFormat, WordsFormat, call_format

# -- calculator ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, value",
    [("23 + 58", 81), ("(2 + 3) * 4 - 1", 19), ("7 / 2", 3.5), ("7 // 2", 3), ("-2 ** 3", -8), ("2 ** 10 % 1000", 24),
     ("sqrt(16) + abs(-3) + max(1, 5) + min(2, 9) + round(2.6)", 17.0), ("34+58", 92)],
)  # fmt: skip
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression, why",
    [
        ("__import__('os')", "calling __import__ is not allowed"),
        ("__import__('os').system('echo hi')", "Call is not allowed"),
        ("eval('1')", "calling eval is not allowed"),
        ("open('/etc/passwd').read()", "Call is not allowed"),
        ("(1).__class__", "Attribute is not allowed"),
        ("x + 1", "the name 'x' is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("'a' * 3", "Constant is not allowed"),
        ("1 / 0", "division by zero"),
        ("9 ** 9999", "exponent larger than 1000"),
        ("10 ** 999 * 10 ** 999", "more than 100 digits"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 300, "longer than 200 characters"),
    ],
)
def test_calculator_refuses_anything_but_arithmetic(expression, why):
    with pytest.raises(ToolError, match=why):
        evaluate(expression)


def test_calculator_tool_formats_and_reports_errors_as_observations():
    calc = Calculator()
    assert calc.name == "calculator" and calc.parameters["required"] == ["expression"]
    assert run_tool(calc, {"expression": "34 + 58"}).text == "92"
    assert format_number(0.1 + 0.2) == "0.3" and format_number(92.0) == "92"
    bad = run_tool(calc, {"expression": "__import__('os')"})
    assert bad.error and bad.text.startswith("error: calling __import__ is not allowed")
    assert run_tool(calc, {"expr": "1"}).text == "error: missing argument(s) expression"
    assert run_tool(calc, {"expression": 3}).text == "error: argument expression must be string, got int"
    assert run_tool(calc, ["1+1"]).text == "error: arguments must be a JSON object, got list"


def test_a_tool_that_raises_or_hangs_becomes_an_observation():
    class Boom:
        name, parameters, timeout_s = "boom", {"type": "object", "properties": {}}, 0.2

        def __call__(self, args):
            raise KeyError("inside")

    class Hang(Boom):
        name = "hang"

        def __call__(self, args):
            time.sleep(5)

    assert run_tool(Boom(), {}).text == "error: KeyError: 'inside'"
    out = run_tool(Hang(), {})
    assert out.error and out.text == "error: tool hang timed out after 0.2 s"


def test_check_arguments_subset_of_json_schema():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "flag": {"type": "boolean"}}, "required": ["n"]}
    assert check_arguments(schema, {"n": 3, "flag": True}) is None
    assert check_arguments(schema, {"n": True}) == "argument n must be integer, got bool"
    assert check_arguments(schema, {"n": 1, "m": 2}) == "unknown argument(s) m; this tool takes n, flag"


# -- code runner --------------------------------------------------------------------------


def _runner(**config) -> CodeRunner:
    return CodeRunner({"timeout_s": 5.0, "cpu_s": 2, "memory_mb": 256, "max_output_chars": 200, **config})


def test_code_runner_runs_python_in_a_private_folder(monkeypatch):
    monkeypatch.setenv("RATCHET_TEST_SECRET", "s3cr3t-in-the-worker")
    runner = _runner()
    out = runner({"code": "import os\nprint(6 * 7)\nprint(sorted(os.listdir('.')))"})
    assert out.splitlines() == ["42", "['main.py']"]
    assert "ZeroDivisionError" in runner({"code": "1/0"}) and runner({"code": "1/0"}).endswith("[exit code 1]")
    # No inherited secrets: the environment is PATH and a locale only, and the worker's own
    # environment is out of reach (tests/security/test_code_sandbox.py tries the rest).
    assert runner({"code": "import os; print(sorted(os.environ))"}).strip() == "['HOME', 'LANG', 'PATH', 'TMPDIR']"
    parent = runner(
        {"code": "import os\ntry:\n    print(open(f'/proc/{os.getppid()}/environ').read())\nexcept OSError as e:\n    print(e)"}
    )
    assert "s3cr3t-in-the-worker" not in parent


def test_code_runner_wall_clock_limit_kills_the_process():
    out = _runner(timeout_s=1.0, cpu_s=30)({"code": "import time\nprint('start', flush=True)\ntime.sleep(30)"})
    assert out == "start\n\n[time limit of 1 s exceeded]"


def test_code_runner_cpu_limit():
    out = _runner(timeout_s=30.0, cpu_s=1)({"code": "while True: pass"})
    assert out == "[CPU time limit of 1 s exceeded]"


def test_code_runner_memory_limit():
    out = _runner(memory_mb=128)({"code": "x = bytearray(512 * 1024 * 1024)\nprint('allocated')"})
    assert "MemoryError" in out and out.endswith("[memory limit of 128 MB exceeded]")
    assert "allocated" not in out


def test_code_runner_output_cap():
    out = _runner(max_output_chars=50)({"code": "while True: print('x' * 10)"})
    assert out.startswith("x" * 10) and out.endswith("[output cut at 50 characters]")
    assert len(out.split("\n[output cut")[0]) == 50


def test_code_runner_refuses_unknown_config():
    with pytest.raises(ValueError, match="unknown key\\(s\\) memory; this tool's keys: cpu_s, max_output_chars, memory_mb"):
        CodeRunner({"memory": 10})
    with pytest.raises(ValueError, match="cpu_s: must be > 0"):
        CodeRunner({"cpu_s": 0})


# -- call formats -------------------------------------------------------------------------

TOOLS = {"calculator": Calculator(), "add": Calculator(tool_schema={"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}})}  # fmt: skip


def test_hermes_calls_in_the_turn_only():
    fmt = HermesFormat()
    prompt = 'Example: <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call> now you.'
    turn = (
        'Sure. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"4\\"}"}</tool_call><tool_call>{oops</tool_call>'
    )
    calls = fmt.find_calls(prompt + turn, len(prompt), TOOLS)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("calculator", {"expression": "2+3"}), ("calculator", {"expression": "4"})]
    assert calls[2].arguments is None and calls[2].error.startswith("malformed tool call (JSONDecodeError")
    # A prompt that opens a call: the model completes it.
    opened = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
    (call,) = fmt.find_calls(opened + '6*7"}}</tool_call>', len(opened), TOOLS)
    assert call.arguments == {"expression": "6*7"}
    assert fmt.find_calls("no call here", 0, TOOLS) == []


def test_words_calls_close_at_equals_or_end_of_turn():
    fmt = WordsFormat()
    (call,) = fmt.find_calls("add:34+58" + "=12", len("add:34+58"), TOOLS)
    assert (call.name, call.arguments, call.end) == ("add", {"expression": "34+58"}, len("add:34+58="))
    (call,) = fmt.find_calls("add:34+58" + "92", len("add:34+58"), TOOLS)  # the turn ended inside the call
    assert call.arguments == {"expression": "34+5892"} and call.end == len("add:34+5892")
    (call,) = fmt.find_calls("add:34+58", len("add:34+58"), TOOLS)  # an empty turn ends it too
    assert call.arguments == {"expression": "34+58"}
    assert fmt.find_calls("add:1+2=" + "3", len("add:1+2="), TOOLS) == []  # closed in the prompt: not run again
    (call,) = fmt.find_calls("x" + "7 calculator : 2*3 = 9 add: 1 =", 1, TOOLS)
    assert (call.name, call.arguments) == ("calculator", {"expression": "2*3"})  # one call per turn
    assert fmt.find_calls("sort:1=", 0, TOOLS) == []  # not a tool name
    with pytest.raises(ValueError, match="unknown tool call format 'xml'; known: hermes, words"):
        call_format("xml")


# -- verl's layout --------------------------------------------------------------------------


def test_verl_tool_config_file_is_read(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        textwrap.dedent("""
        tools:
          - class_name: calculator
            config: {type: native, timeout_s: 3}
            tool_schema:
              type: function
              function:
                name: calc
                description: arithmetic
                parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
          - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool
            config: {type: native, sandbox_fusion_url: "http://127.0.0.1:8080", memory_limit_mb: 128}
            tool_schema:
              type: function
              function: {name: code_interpreter, parameters: {type: object, properties: {code: {type: string}}, required: [code]}}
    """)
    )
    specs = load_tools_file(path)
    assert [s.name for s in specs] == ["calc", "code_interpreter"] and specs[0].config == {"timeout_s": 3}
    tools = build_tools(specs)
    assert sorted(tools) == ["calc", "code_interpreter"] and tools["calc"].timeout_s == 3
    code = tools["code_interpreter"]
    assert type(code).__name__ == "SandboxFusionTool" and code.config["memory_limit_mb"] == 128
    assert code.url == "http://127.0.0.1:8080/run_code"


def test_a_tool_of_your_own_by_file_path(tmp_path):
    (tmp_path / "mytool.py").write_text(
        textwrap.dedent("""
        class Echo:
            def __init__(self, config, tool_schema):
                self.name, self.timeout_s = tool_schema["function"]["name"], 1.0
                self.parameters = tool_schema["function"]["parameters"]
            def __call__(self, args):
                return args["text"].upper()
    """)
    )
    schema = {
        "type": "function",
        "function": {"name": "echo", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}},
    }
    tools = build_tools(parse_tools({"tools": [{"class_name": f"{tmp_path}/mytool.py:Echo", "tool_schema": schema}]}))
    assert run_tool(tools["echo"], {"text": "hi"}).text == "HI"


@pytest.mark.parametrize(
    "data, message",
    [
        ({"tools": [{"class_name": "verl.tools.gsm8k_tool.Gsm8kTool"}]},
         "tools[0].class_name: unknown tool class 'verl.tools.gsm8k_tool.Gsm8kTool'; known: calculator, "),
        ({"tools": []}, "expected a non-empty list under tools:"),
        ({"tool": []}, "unknown top-level key(s) tool; expected only tools"),
        ({"tools": [{"class_name": "calculator", "schema": {}}]}, "tools[0]: unknown key(s) schema; expected class_name, config, tool_schema"),
        ({"tools": [{"class_name": "calculator", "config": {"type": "mcp"}}]}, "tools[0].config.type: only native tools run"),
        ({"tools": [{"class_name": "calculator", "tool_schema": {"type": "function", "function": {"name": ""}}}]},
         "tools[0].tool_schema.function.name: a non-empty string is required"),
        ({"tools": [{"class_name": "calculator", "tool_schema": {"function": {"name": "c", "parameters": {"type": "object",
          "properties": {"a": {}}, "required": ["b"]}}}}]}, "tools[0].tool_schema.function.parameters.required: names must be listed"),
        ({"tools": [{"class_name": "calculator", "tool_schema": {"function": {"name": "c"}}},
                    {"class_name": "code_runner", "tool_schema": {"function": {"name": "c"}}}]},
         "tools[1].tool_schema.function.name: 'c' is used by another tool"),
    ],
)  # fmt: skip
def test_bad_tool_config_names_the_field(data, message):
    with pytest.raises(ValueError) as err:
        parse_tools(data, "tools.yaml")
    assert message in str(err.value)


def test_bad_tool_settings_and_missing_file_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"rollout.multi_turn.tools\[0\].config: tools.calculator.config: unknown key\(s\) timeout"):
        build_tools(parse_tools({"tools": [{"class_name": "calculator", "config": {"timeout": 3}}]}))
    with pytest.raises(ValueError, match="rollout.multi_turn.tools_config: tool config file not found"):
        load_tools_file(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("tools: [unclosed")
    with pytest.raises(ValueError, match="rollout.multi_turn.tools_config: cannot read"):
        load_tools_file(tmp_path / "bad.yaml")
    with pytest.raises(ValueError, match="cannot import 'no_such_module_xyz': ModuleNotFoundError"):
        build_tools(parse_tools({"tools": [{"class_name": "no_such_module_xyz:Tool"}]}))


def test_tools_kwargs_in_the_data_are_checked():
    names = frozenset({"add"})
    extra = {"tools_kwargs": {"add": {"create_kwargs": {"ground_truth": "92"}}}, "interaction_kwargs": {"name": "x"}}
    assert parse_tools_kwargs(extra, names, "train.jsonl row 3") == {"add": {"create_kwargs": {"ground_truth": "92"}}}
    assert parse_tools_kwargs({"index": 1}, names, "r") == {}
    with pytest.raises(ValueError, match="train.jsonl row 3.extra_info.tools_kwargs.calc: no tool of that name is configured; tools: add"):
        parse_tools_kwargs({"tools_kwargs": {"calc": {}}}, names, "train.jsonl row 3")
    with pytest.raises(ValueError, match="row 3.extra_info.tools_kwargs.add: expected a mapping with keys among create_kwargs"):
        parse_tools_kwargs({"tools_kwargs": {"add": {"create": {}}}}, names, "row 3")
    with pytest.raises(ValueError, match="row 3.extra_info.tools_kwargs.add.create_kwargs: expected a mapping"):
        parse_tools_kwargs({"tools_kwargs": {"add": {"create_kwargs": [1]}}}, names, "row 3")
    assert json.dumps(extra)  # stays JSON (the batch's samples are stored as JSON)


def test_two_tools_of_one_name_are_refused_when_built():
    with pytest.raises(ValueError, match=r"rollout.multi_turn.tools\[1\]: a second tool named 'calculator'"):
        build_tools(parse_tools({"tools": [{"class_name": "calculator"}, {"class_name": "calculator"}]}))
