"""A code runner tool: model-written Python in a sandbox (sandbox.py), with limits.

The code runs under bubblewrap in namespaces of its own, with a read-only interpreter and
standard library, one private writable folder, no network, no shell, nothing of the
worker's files or secrets, and in a control group of its own that bounds the whole process
tree (processes, memory, CPU) and is killed on every way out. What it prints comes back
through a descriptor the worker opened, cut at `max_output_chars`.

Where that isolation cannot be had (no bubblewrap, no user namespaces, no writable
cgroups), the tool refuses to be built (so a run is refused at submit) with the missing
piece named, unless its config says `unsafe_local: true`: then the code runs in a plain
subprocess with per-process limits only, which is no boundary against hostile code; the
run's summary and the UI say so (workflows/search_attributes.py).
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from . import sandbox
from .base import ToolError, schema_name, schema_parameters, take_config

log = logging.getLogger(__name__)

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
    """verl layout: `class_name: code_runner`; config keys timeout_s (wall clock), cpu_s (CPU
    seconds of the whole process tree), memory_mb (the tree's memory), processes (the tree's
    processes and threads), max_output_chars, scratch_mb (its writable folder), python (an
    interpreter whose site-packages the code may import; default: the worker's interpreter
    with none), unsafe_local (run without isolation: see the module docstring)."""

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        self.config = take_config(
            config,
            {"timeout_s": 10.0, "cpu_s": 5, "memory_mb": 512, "max_output_chars": 2000, "python": "",
             "processes": 32, "scratch_mb": 16, "unsafe_local": False},
            "tools.code_runner.config",
        )  # fmt: skip
        tool_schema = tool_schema or DEFAULT_SCHEMA
        self.name = schema_name(tool_schema) or "code_interpreter"
        self.parameters = schema_parameters(tool_schema)
        # run_tool's own limit: the child's wall-clock limit plus time to start and clean up.
        self.timeout_s = float(self.config["timeout_s"]) + 5.0
        required = self.parameters.get("required") or []
        self.argument = "code" if "code" in (self.parameters.get("properties") or {}) else (required or ["code"])[0]
        self.unsafe_local = bool(self.config["unsafe_local"])
        self._interpreter: sandbox.Interpreter | None = None
        if self.unsafe_local:
            log.warning(
                "code runner %s: unsafe_local is set: model code runs WITHOUT isolation (it can read this "
                "worker's files and secrets, reach the network and outlive the call)",
                self.name,
            )
            return
        try:
            sandbox.check()
            self._interpreter = sandbox.interpreter(self.config["python"])
        except sandbox.SandboxUnavailable as e:
            raise ValueError(
                f"{e}. Fix that, or set unsafe_local: true in this tool's config to run model code without "
                "isolation (only for code you trust; the run is marked unsafe)"
            ) from None

    def __call__(self, args: dict[str, Any]) -> str:
        code = args.get(self.argument)
        if not isinstance(code, str):
            raise ToolError(f"argument {self.argument} must be a string")
        c = self.config
        if self._interpreter is None:
            return run_python(code, timeout_s=float(c["timeout_s"]), cpu_s=int(c["cpu_s"]), memory_mb=int(c["memory_mb"]),
                              max_output_chars=int(c["max_output_chars"]), python=c["python"] or sys.executable)  # fmt: skip
        max_chars = int(c["max_output_chars"])
        limits = sandbox.Limits(
            wall_s=float(c["timeout_s"]), cpu_s=int(c["cpu_s"]), memory_mb=int(c["memory_mb"]), processes=int(c["processes"]),
            output_bytes=_cap(max_chars), scratch_mb=int(c["scratch_mb"]),
        )  # fmt: skip
        done = sandbox.run(code.encode("utf-8", "surrogatepass"), self._interpreter, limits)
        why = {
            "wall": f"time limit of {limits.wall_s:g} s exceeded",
            "cpu": f"CPU time limit of {limits.cpu_s} s exceeded",
            "memory": f"memory limit of {limits.memory_mb} MB exceeded",
            "processes": f"process limit of {limits.processes} reached",
            None: None,
        }[done.reason]
        return _observation(done.output, done.returncode, why, max_chars, limits.cpu_s, limits.memory_mb, done.cpu_s)


def _cap(max_output_chars: int) -> int:
    return max_output_chars * 4 + 1  # bytes: up to 4 per character in UTF-8, +1 to see the cut


def _observation(raw: bytes, rc: int, why: str | None, max_chars: int, cpu_s: int, memory_mb: int, seconds: float) -> str:
    """What the model reads: the output (cut at `max_chars`) and a last line saying why the
    program stopped when it did not exit with 0 or hit a limit."""
    text = raw.decode("utf-8", errors="replace")
    cut = len(raw) >= _cap(max_chars) or len(text) > max_chars
    text = text[:max_chars]
    if why is None and rc != 0:
        why = _exit_reason(rc, cpu_s, memory_mb, seconds, text)
    if cut:
        text += f"\n[output cut at {max_chars} characters]"
        if why is None or why.startswith(("exit code", "killed by signal SIGXFSZ")):
            why = None  # the cut says it: Python ignores SIGXFSZ and fails writing past the cap
    return text if why is None else f"{text}\n[{why}]" if text else f"[{why}]"


def _limits(cpu_s: int, memory_bytes: int, output_bytes: int):
    def apply() -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (output_bytes, output_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_python(code: str, *, timeout_s: float, cpu_s: int, memory_mb: int, max_output_chars: int, python: str) -> str:
    """unsafe_local: `code` in a plain subprocess with per-process limits, in a private
    temporary folder. What it prints goes to a memfd the parent made and reads at most the
    cap of, never to a path the child could replace."""
    cap = _cap(max_output_chars)
    out_fd = os.memfd_create("ratchet-code-output", 0)
    try:
        with tempfile.TemporaryDirectory(prefix="ratchet-code-") as tmp:
            with open(os.path.join(tmp, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": tmp, "TMPDIR": tmp}
            started = time.monotonic()
            proc = subprocess.Popen(
                [python, "-I", "-X", "utf8", "main.py"],
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out_fd,
                stderr=out_fd,
                start_new_session=True,
                preexec_fn=_limits(cpu_s, memory_mb * 1024 * 1024, cap),
            )
            try:
                rc = proc.wait(timeout=timeout_s)
                why = None
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc, why = proc.wait(), f"time limit of {timeout_s:g} s exceeded"
        raw = os.pread(out_fd, cap, 0)
    finally:
        os.close(out_fd)
    return _observation(raw, rc, why, max_output_chars, cpu_s, memory_mb, time.monotonic() - started)


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
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"
