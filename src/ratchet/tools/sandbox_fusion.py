"""verl's `SandboxFusionTool`: the model's code goes to a SandboxFusion server over HTTP.

The way verl users run code remotely: a SandboxFusion service (or anything that answers its
`run_code` API) at `config.sandbox_fusion_url`. A request is

    POST <url>  (…/run_code; appended when the URL does not end with it)
    {"code", "language", "run_timeout", "compile_timeout", "memory_limit_MB", "stdin", "files", "fetch_files"}

and the answer `{"status": "Success" | "Failed" | "SandboxError", "message",
"run_result": {"status": "Finished" | "TimeLimitExceeded" | ..., "return_code", "stdout",
"stderr"}}`. The model reads stdout then stderr, cut at `max_output_chars`, with a last line
when the run did not finish cleanly. No URL: refused when built, saying what runs instead.

The client is the standard library's: one request per call, a deadline on the whole
exchange, no redirects, no proxies, a cap on the bytes read.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from .base import ToolError, schema_name, schema_parameters, take_config
from .code_runner import DEFAULT_SCHEMA

VERL_CLASS = "verl.tools.sandbox_fusion_tools.SandboxFusionTool"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} refused", headers, fp)


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def run_code_url(url: str, where: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{where}.sandbox_fusion_url: expected an http(s) URL of a SandboxFusion server, got {url!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/run_code"):
        path += "/run_code"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


class SandboxFusionTool:
    """verl layout: `class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool`; verl's
    config keys sandbox_fusion_url, default_timeout (run seconds), memory_limit_mb,
    default_language, rate_limit (concurrent requests from this process), num_workers and
    enable_global_rate_limit (verl's Ray pool; accepted, not used); ratchet's
    max_output_chars and max_response_bytes."""

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        where = "tools.sandbox_fusion.config"
        config = dict(config or {})
        if not config.get("sandbox_fusion_url"):
            raise ValueError(
                f"{where}.sandbox_fusion_url is not set: {VERL_CLASS} sends the code to a SandboxFusion server "
                "at that URL (e.g. http://127.0.0.1:8080/run_code); nothing would run it. Set the URL, or use "
                "class_name: code_runner to run the code on the worker in ratchet's local sandbox (bubblewrap)"
            )
        self.config = take_config(
            config,
            {"sandbox_fusion_url": "", "default_timeout": 30, "memory_limit_mb": 1024, "default_language": "python",
             "rate_limit": 10, "num_workers": 10, "enable_global_rate_limit": True, "max_output_chars": 2000,
             "max_response_bytes": 1 << 20},
            where,
        )  # fmt: skip
        self.url = run_code_url(self.config["sandbox_fusion_url"], where)
        tool_schema = tool_schema or DEFAULT_SCHEMA
        self.name = schema_name(tool_schema) or "code_interpreter"
        self.parameters = schema_parameters(tool_schema)
        run_s = float(self.config["default_timeout"])
        self.deadline_s = run_s + 10.0  # the whole exchange: the server's run plus its own overhead
        self.timeout_s = self.deadline_s + 5.0  # run_tool's
        required = self.parameters.get("required") or []
        self.argument = "code" if "code" in (self.parameters.get("properties") or {}) else (required or ["code"])[0]
        self._slots = threading.BoundedSemaphore(int(self.config["rate_limit"]))

    def __call__(self, args: dict[str, Any]) -> str:
        code = args.get(self.argument)
        if not isinstance(code, str):
            raise ToolError(f"argument {self.argument} must be a string")
        c = self.config
        body = json.dumps({
            "code": code, "language": c["default_language"], "run_timeout": c["default_timeout"], "compile_timeout": 10,
            "memory_limit_MB": c["memory_limit_mb"], "stdin": "", "files": {}, "fetch_files": [],
        }).encode()  # fmt: skip
        with self._slots:
            answer = self._post(body)
        return self._observation(answer)

    def _post(self, body: bytes) -> dict:
        cap = int(self.config["max_response_bytes"])
        deadline = time.monotonic() + self.deadline_s
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})  # fmt: skip
        try:
            with _OPENER.open(request, timeout=self.deadline_s) as response:
                chunks, size = [], 0
                while size <= cap:  # one byte past the cap is enough to refuse
                    if time.monotonic() > deadline:
                        raise ToolError(f"the sandbox at {self.url} did not answer within {self.deadline_s:g} s")
                    chunk = response.read1(min(65536, cap + 1 - size))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
        except urllib.error.HTTPError as e:
            raise ToolError(f"the sandbox at {self.url} answered HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ToolError(f"the sandbox at {self.url} cannot be reached: {reason}") from None
        if size > cap:
            raise ToolError(f"the sandbox at {self.url} answered more than {cap} bytes")
        try:
            answer = json.loads(b"".join(chunks))
        except ValueError:
            raise ToolError(f"the sandbox at {self.url} did not answer JSON") from None
        if not isinstance(answer, dict):
            raise ToolError(f"the sandbox at {self.url} answered {type(answer).__name__}, not a JSON object")
        return answer

    def _observation(self, answer: dict) -> str:
        status = answer.get("status")
        run = answer.get("run_result") if isinstance(answer.get("run_result"), dict) else None
        if status == "SandboxError" or run is None:
            raise ToolError(f"the sandbox failed: {str(answer.get('message') or status)[:200]}")
        max_chars = int(self.config["max_output_chars"])
        text = f"{run.get('stdout') or ''}{run.get('stderr') or ''}"
        cut = len(text) > max_chars
        text = text[:max_chars] + (f"\n[output cut at {max_chars} characters]" if cut else "")
        run_status, rc = run.get("status"), run.get("return_code")
        why = None
        if run_status == "TimeLimitExceeded":
            why = f"time limit of {self.config['default_timeout']:g} s exceeded"
        elif run_status not in (None, "Finished"):
            why = str(run_status)[:100]
        elif isinstance(rc, int) and rc != 0 and not cut:
            why = f"exit code {rc}"
        return text if why is None else f"{text}\n[{why}]" if text else f"[{why}]"
