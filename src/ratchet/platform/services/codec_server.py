"""The Temporal UI's codec server: how the embedded UI shows sealed payloads readably.

ratchet seals every Temporal payload with its payload key (`platform/payload_codec.py`),
so the history the server keeps is ciphertext. The UI's page (JavaScript in the browser)
posts the payloads it shows to this server's `/decode`, which opens those sealed with the
key and hands back every other one unchanged (Temporal's remote codec protocol: a JSON
body `{"payloads": [{"metadata": {...}, "data": ...}]}`, bytes in base64). `up` starts it
with the dev server, which is started with `--ui-codec-endpoint` pointing here; it is
recorded inside Temporal's entry of services.json and stopped with it.

Who can reach it: it binds 127.0.0.1, like the UI; anyone who can open the UI can read the
decoded history through it, and nobody else. It only decodes: `/encode` is refused, since
sealing payloads for anyone who reaches the port would hand them the key's power (starting
a run from the UI is refused for the same reason; use the CLI). A browser request must come
from the UI's own origin (CORS allows exactly it, with `localhost` for `127.0.0.1`); a
request without an Origin (the `temporal` CLI's `--codec-endpoint`, curl) is served. The
port: RATCHET_CODEC_PORT, else a free one picked at start and kept while Temporal runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeGuard
from urllib.parse import urlsplit

from . import processes
from .ports import can_connect
from .settings import ServiceError, ServiceSettings, free_ports
from .state import now

logger = logging.getLogger(__name__)

__all__ = ["PORT_ENV", "describe", "healthy", "is_ours", "start", "stop", "url"]

PORT_ENV = "RATCHET_CODEC_PORT"
# The UI posts a page of payloads at a time, each at most Temporal's 2 MB limit.
MAX_BODY = 64 * 1024 * 1024


def url(rec: dict[str, Any]) -> str:
    return f"http://{rec['host']}:{rec['port']}"


def _port(settings: ServiceSettings, recorded: int | None) -> int:
    raw = (os.environ.get(PORT_ENV) or "").strip()
    if raw:
        try:
            port = int(raw)
        except ValueError:
            raise ServiceError(f"{PORT_ENV} must be a TCP port number, got {raw!r}") from None
        if not 0 < port < 65536 or port in (settings.temporal_port, settings.temporal_ui_port, settings.ray_port):
            raise ServiceError(f"{PORT_ENV}={port} is not a free TCP port of its own; choose another")
        return port
    return recorded or free_ports(1)[0]


def origins(settings: ServiceSettings) -> list[str]:
    """The UI's origins: its address, and `localhost` for the loopback address."""
    found = [f"http://{settings.host}:{settings.temporal_ui_port}"]
    if settings.host == "127.0.0.1":
        found.append(f"http://localhost:{settings.temporal_ui_port}")
    return found


def log_file(settings: ServiceSettings) -> Path:
    return settings.logs_dir / "codec-server.log"


def start(settings: ServiceSettings, key_file: Path, port: int | None = None) -> dict[str, Any]:
    """Spawn the server (its port: `port`, RATCHET_CODEC_PORT or a free one) and wait
    until it answers; its record."""
    port = _port(settings, port)
    cmd = [
        sys.executable, "-m", __name__, "--key-file", str(key_file), "--host", settings.host, "--port", str(port),
        *[a for origin in origins(settings) for a in ("--origin", origin)],
    ]  # fmt: skip
    proc = processes.spawn_logged(cmd, log_file(settings), settings.state_dir, now(), keep=True)
    rec: dict[str, Any] = {
        "pid": proc.pid, "pgid": proc.pid, "start_ticks": processes.start_ticks(proc.pid), "host": settings.host, "port": port,
        "key_file": str(key_file), "log_file": str(log_file(settings)), "cmd": cmd, "started_at": now(),
    }  # fmt: skip
    logger.info("starting the Temporal UI's codec server (pid %s) on %s", proc.pid, url(rec))
    deadline = time.monotonic() + settings.start_timeout_s
    while proc.poll() is None and not can_connect(settings.host, port, timeout=0.5) and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is not None or not can_connect(settings.host, port, timeout=0.5):
        stop(rec, 2.0)
        raise ServiceError(
            f"the Temporal UI's codec server did not start on {url(rec)}; last lines of {rec['log_file']}:\n"
            f"{processes.log_tail(Path(rec['log_file']))}"
        )
    return rec


def is_ours(rec: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    return bool(rec) and processes.same_process(rec.get("pid"), rec.get("start_ticks"))  # type: ignore[union-attr]


def healthy(rec: dict[str, Any] | None) -> bool:
    return is_ours(rec) and can_connect(rec["host"], rec["port"])  # type: ignore[index]


def describe(rec: dict[str, Any] | None) -> tuple[bool, str]:
    """(answers, detail) for `status`."""
    if not rec:
        return False, "none: started by an older ratchet; `ratchet down` and `ratchet up` add it"
    if healthy(rec):
        return True, "decodes the UI's payloads"
    return False, f"not running; `ratchet up` starts it again (log: {rec.get('log_file')})"


def stop(rec: dict[str, Any] | None, timeout: float) -> bool:
    if not rec:
        return False
    if not is_ours(rec):
        if rec.get("pid"):
            processes.reap(rec["pid"])
        return False
    pid: int = rec["pid"]
    logger.info("stopping the Temporal UI's codec server (pid %s)", pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    if processes.wait_gone([pid], timeout):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        processes.wait_gone([pid], 5.0)
    processes.reap(pid)
    return True


# -- the server (python -m ratchet.platform.services.codec_server) -----------------------


def _handler(codec, allowed: set[str]):
    from google.protobuf import json_format
    from temporalio.api.common.v1 import Payloads

    class Handler(BaseHTTPRequestHandler):
        server_version = "ratchet-codec"

        def _origin_ok(self) -> bool:
            origin = self.headers.get("Origin")
            return origin is None or origin in allowed

        def _reply(self, status: int, body: dict | str) -> None:
            data = (body if isinstance(body, str) else json.dumps(body)).encode()
            self.send_response(status)
            origin = self.headers.get("Origin")
            if origin in allowed:
                self.send_header("Access-Control-Allow-Origin", origin)
                self.send_header("Vary", "Origin")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_OPTIONS(self) -> None:  # noqa: N802 - the CORS preflight
            if not self._origin_ok():
                self._reply(HTTPStatus.FORBIDDEN, {"message": "origin not allowed"})
                return
            self.send_response(HTTPStatus.NO_CONTENT)
            origin = self.headers.get("Origin")
            if origin:
                self.send_header("Access-Control-Allow-Origin", origin)
                self.send_header("Vary", "Origin")
            self.send_header("Access-Control-Allow-Methods", "POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", "content-type, x-namespace")
            self.send_header("Access-Control-Max-Age", "600")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:  # noqa: N802
            self._reply(HTTPStatus.OK if self.path == "/health" else HTTPStatus.NOT_FOUND, {"ok": self.path == "/health"})

        def do_POST(self) -> None:  # noqa: N802
            if not self._origin_ok():
                self._reply(HTTPStatus.FORBIDDEN, {"message": "origin not allowed"})
                return
            # `/decode` (the UI adds a query, `?preserveStorageRefs=true`), or `/{namespace}/decode`
            # as the CLI's --codec-endpoint templating sends it.
            action = urlsplit(self.path).path.rstrip("/").rsplit("/", 1)[-1]
            if action == "encode":
                self._reply(
                    HTTPStatus.FORBIDDEN,
                    {"message": "ratchet's codec server only decodes: start and steer runs with ratchet's CLI or client"},
                )
                return
            if action != "decode":
                self._reply(HTTPStatus.NOT_FOUND, {"message": "POST /decode"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY:
                self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE if length else HTTPStatus.BAD_REQUEST, {"message": "bad body size"})
                return
            try:
                payloads = json_format.Parse(self.rfile.read(length), Payloads())
            except (json_format.ParseError, UnicodeDecodeError) as exc:
                self._reply(HTTPStatus.BAD_REQUEST, {"message": f"not a payloads JSON body: {exc}"})
                return
            # Ours open; any other payload (one from before the key, one a stranger sent) is
            # shown as it is.
            opened = [codec.try_open(p) or p for p in payloads.payloads]
            self._reply(HTTPStatus.OK, json_format.MessageToJson(Payloads(payloads=opened), indent=None))

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - one line a request is noise
            logger.debug(format, *args)

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ratchet.platform.services.codec_server")
    parser.add_argument("--key-file", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--origin", action="append", default=[])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ratchet.platform.payload_codec import AesGcmCodec, load_key

    codec = AesGcmCodec(load_key(args.key_file, create=False))
    server = ThreadingHTTPServer((args.host, args.port), _handler(codec, set(args.origin)))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `down`: a KeyboardInterrupt, a clean close
    logger.info("codec server on http://%s:%d for %s (%s)", args.host, args.port, ", ".join(args.origin), codec.key.describe())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
