"""verl's SandboxFusionTool speaks to a SandboxFusion server; without a URL it is refused.

Before: `class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool` silently built the
local code runner, so a user who meant to run model code on a remote sandbox ran it on the
worker. Now it is an HTTP client of the `run_code` API (tried here against a small real
server on 127.0.0.1 that answers as SandboxFusion does), and a config without
`sandbox_fusion_url` is refused at build (so at submit) with what runs instead.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ratchet.tools.base import run_tool
from ratchet.tools.config import build_tools, parse_tools, tool_issues
from ratchet.tools.sandbox_fusion import VERL_CLASS

SCHEMA = {"type": "function", "function": {"name": "code_interpreter", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}  # fmt: skip


class FakeSandboxFusion(BaseHTTPRequestHandler):
    """Answers `POST /run_code` as SandboxFusion does, from a few canned programs."""

    requests: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append((self.path, body))
        code = body["code"]
        if self.path != "/run_code":
            return self._send(404, b'{"detail": "Not Found"}')
        if code == "redirect":
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:1/elsewhere")
            self.end_headers()
            return None
        if code == "flood":
            return self._send(200, b'{"status": "Success", "run_result": {"stdout": "' + b"x" * (2 << 20) + b'"}}')
        if code == "broken":
            return self._send(200, json.dumps({"status": "SandboxError", "message": "no runner available"}).encode())
        run = {"status": "Finished", "execution_time": 0.01, "return_code": 0, "stdout": "2\n", "stderr": ""}
        if code == "1/0":
            run.update(return_code=1, stdout="", stderr="ZeroDivisionError: division by zero\n")
        elif code == "while True: pass":
            run.update(status="TimeLimitExceeded", return_code=None, stdout="")
        status = "Success" if run["status"] == "Finished" and run["return_code"] == 0 else "Failed"
        return self._send(200, json.dumps({"status": status, "message": "", "compile_result": None, "run_result": run}).encode())

    def _send(self, code: int, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeSandboxFusion)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def tool(config: dict):
    spec = {"class_name": VERL_CLASS, "config": {"type": "native", **config}, "tool_schema": SCHEMA}
    return build_tools(parse_tools({"tools": [spec]}))["code_interpreter"]


def test_the_code_goes_to_the_sandbox_fusion_server(server):
    FakeSandboxFusion.requests.clear()
    code = tool({"sandbox_fusion_url": server, "default_timeout": 7, "memory_limit_mb": 256})
    assert run_tool(code, {"code": "print(1 + 1)"}).text == "2\n"
    [(path, body)] = FakeSandboxFusion.requests
    assert path == "/run_code"  # appended to a bare URL; kept when given (verl's users give the full URL)
    assert body["code"] == "print(1 + 1)" and body["language"] == "python"
    assert body["run_timeout"] == 7 and body["memory_limit_MB"] == 256
    assert tool({"sandbox_fusion_url": f"{server}/run_code"}).url == f"{server}/run_code"
    assert run_tool(code, {"code": "1/0"}).text == "ZeroDivisionError: division by zero\n\n[exit code 1]"
    assert run_tool(code, {"code": "while True: pass"}).text == "[time limit of 7 s exceeded]"


def test_server_failures_are_observations_not_crashes(server):
    code = tool({"sandbox_fusion_url": server, "max_response_bytes": 1 << 20})
    assert run_tool(code, {"code": "broken"}).text == "error: the sandbox failed: no runner available"
    flood = run_tool(code, {"code": "flood"})  # a 2 MiB answer: read up to the cap, then refused
    assert flood.error and flood.text.endswith(f"answered more than {1 << 20} bytes")
    redirect = run_tool(code, {"code": "redirect"})  # never followed elsewhere
    assert redirect.error and "HTTP 302" in redirect.text
    wrong_path = tool({"sandbox_fusion_url": f"{server}/v2"})  # -> /v2/run_code, which this server does not serve
    assert run_tool(wrong_path, {"code": "x"}).text.endswith("answered HTTP 404 Not Found")
    # A closed port: refused at once, not hung.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    gone = run_tool(tool({"sandbox_fusion_url": f"http://127.0.0.1:{closed}"}), {"code": "x"})
    assert gone.error and "cannot be reached" in gone.text


def test_without_a_url_it_is_refused_saying_what_runs_instead():
    [(field, message)] = tool_issues([{"class_name": VERL_CLASS, "config": {"type": "native"}, "tool_schema": SCHEMA}])
    assert field == "rollout.multi_turn.tools[0].config"
    assert "sandbox_fusion_url is not set" in message and "class_name: code_runner" in message
    [(field, message)] = tool_issues([{"class_name": VERL_CLASS, "config": {"sandbox_fusion_url": "file:///etc/passwd"}}])
    assert "expected an http(s) URL" in message
