"""A code runner tool: Python code in a subprocess of its own, with limits.

The child runs `python -I` (isolated: no user site, no PYTHON* variables, no current
folder on the path) in a private temporary folder that is removed afterwards, in a
session of its own (a timeout kills the whole process group), with resource limits set
by `resource.setrlimit` before it starts: CPU seconds (RLIMIT_CPU), address space
(RLIMIT_AS: the memory limit), file size (RLIMIT_FSIZE: caps what it writes, its output
included), open files. Its stdout and stderr go to one file in that folder, so the
output cap is a file-size limit the kernel enforces, not a pipe someone must drain.

It needs no network and is given none to speak of: an empty environment besides PATH
and a locale. It is not a security boundary against hostile code (no namespaces or
seccomp); it keeps honest mistakes (an endless loop, a huge list, a flood of output) from
hurting the worker, and its output is deterministic for deterministic code.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .base import ToolError, schema_name, schema_parameters, take_config

DEFAULT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run a Python program and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python source to run."}},
            "required": ["code"],
        },
    },
}


class CodeRunner:
    """verl layout: `class_name: code_runner` (or verl's SandboxFusionTool, which it stands in
    for); config keys timeout_s (wall clock), cpu_s, memory_mb, max_output_chars."""

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        self.config = take_config(
            config,
            {"timeout_s": 10.0, "cpu_s": 5, "memory_mb": 512, "max_output_chars": 2000, "python": ""},
            "tools.code_runner.config",
        )
        tool_schema = tool_schema or DEFAULT_SCHEMA
        self.name = schema_name(tool_schema) or "code_interpreter"
        self.parameters = schema_parameters(tool_schema)
        # run_tool's own limit: the child's wall-clock limit plus time to start and clean up.
        self.timeout_s = float(self.config["timeout_s"]) + 5.0
        required = self.parameters.get("required") or []
        self.argument = "code" if "code" in (self.parameters.get("properties") or {}) else (required or ["code"])[0]

    def __call__(self, args: dict[str, Any]) -> str:
        code = args.get(self.argument)
        if not isinstance(code, str):
            raise ToolError(f"argument {self.argument} must be a string")
        return run_python(
            code,
            timeout_s=float(self.config["timeout_s"]),
            cpu_s=int(self.config["cpu_s"]),
            memory_mb=int(self.config["memory_mb"]),
            max_output_chars=int(self.config["max_output_chars"]),
            python=self.config["python"] or sys.executable,
        )


def _limits(cpu_s: int, memory_bytes: int, output_bytes: int):
    def apply() -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (output_bytes, output_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_python(code: str, *, timeout_s: float, cpu_s: int, memory_mb: int, max_output_chars: int, python: str) -> str:
    """What `code` prints (stdout and stderr interleaved, cut at `max_output_chars`), and a
    last line saying why it stopped when it did not exit with 0."""
    cap = max_output_chars * 4 + 1  # bytes: up to 4 per character in UTF-8, +1 to see the cut
    with tempfile.TemporaryDirectory(prefix="ratchet-code-") as tmp:
        folder = Path(tmp)
        (folder / "main.py").write_text(code, encoding="utf-8")
        out_path = folder / "output.txt"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": tmp, "TMPDIR": tmp}
        started = time.monotonic()
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                [python, "-I", "-X", "utf8", "main.py"],
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_limits(cpu_s, memory_mb * 1024 * 1024, cap),
            )
            try:
                rc = proc.wait(timeout=timeout_s)
                why = None
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc, why = proc.wait(), f"time limit of {timeout_s:g} s exceeded"
        raw = out_path.read_bytes()
        text = raw.decode("utf-8", errors="replace")
        cut = len(raw) >= cap or len(text) > max_output_chars
        text = text[:max_output_chars]
        if why is None and rc != 0:
            why = _exit_reason(rc, cpu_s, memory_mb, time.monotonic() - started, text)
        if cut:
            text += f"\n[output cut at {max_output_chars} characters]"
            if why is None or why.startswith(("exit code", "killed by signal SIGXFSZ")):
                why = None  # the cut says it: Python ignores SIGXFSZ and fails writing past the cap
        return text if why is None else f"{text}\n[{why}]" if text else f"[{why}]"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _exit_reason(rc: int, cpu_s: int, memory_mb: int, seconds: float, text: str) -> str:
    if rc == -signal.SIGXCPU or rc == -signal.SIGKILL and seconds >= cpu_s:
        return f"CPU time limit of {cpu_s} s exceeded"
    if "MemoryError" in text:
        return f"memory limit of {memory_mb} MB exceeded"
    if rc < 0:
        return f"killed by signal {signal.Signals(-rc).name}"
    return f"exit code {rc}"
