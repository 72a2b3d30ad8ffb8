"""The MLflow UI that `up` starts next to Temporal: ratchet's built-in dashboard.

It is `mlflow server` on 127.0.0.1, reading the state folder's SQLite store
(`<state>/mlflow.db`, where the workers' trackers write by default). It starts in the
background: `up` returns without waiting for it (the server takes seconds to import), and
`status` says whether it answers yet. When it cannot start (mlflow missing, its port
taken by another process) `up` records why and carries on; the rest of the platform does
not need it. MLflow's telemetry and its background job runner are off: nothing leaves the
machine and no idle worker processes pile up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, TypeGuard

from ratchet.extras import missing_message
from ratchet.tracking.mlflow_tracker import create_sqlite_store, quiet_mlflow_env
from ratchet.tracking.uris import MLFLOW_DB, default_mlflow_uri, mlflow_artifacts_dir

from . import processes
from .ports import can_connect, port_in_use
from .settings import ServiceSettings, mlflow_ui_url
from .state import now, save_state

logger = logging.getLogger(__name__)

__all__ = ["command", "describe", "ensure", "healthy", "is_ours", "start", "stop"]


def command(settings: ServiceSettings) -> list[str]:
    """This module as a program (it creates the store, then becomes `mlflow server`)."""
    return [
        sys.executable, "-m", __name__, str(settings.state_dir / MLFLOW_DB),
        "--backend-store-uri", default_mlflow_uri(settings.state_dir),
        "--default-artifact-root", mlflow_artifacts_dir(settings.state_dir).as_uri(),
        "--host", settings.host,
        "--port", str(settings.mlflow_ui_port),
        "--workers", "1",
    ]  # fmt: skip


def is_ours(rec: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    return bool(rec) and bool(rec.get("pid")) and processes.same_process(rec.get("pid"), rec.get("start_ticks"))  # type: ignore[union-attr]


def healthy(rec: dict[str, Any] | None) -> bool:
    """Ours and still running (it may still be starting: `status` tells that apart)."""
    return is_ours(rec)


def start(settings: ServiceSettings) -> dict[str, Any]:
    """Spawn the server without waiting for it; the record says why when it cannot start
    (an `error` and no pid) instead of raising."""
    port, url = settings.mlflow_ui_port, mlflow_ui_url(settings)
    assert port is not None  # `ensure` starts it only when a port was asked for
    base = {"host": settings.host, "port": port, "url": url, "log_file": str(settings.mlflow_ui_log), "started_at": now()}
    not_installed = missing_message("mlflow", "the MLflow UI")
    if not_installed:
        return {**base, "error": not_installed}
    if port_in_use(settings.host, port, settings.host):
        return {
            **base,
            "error": f"port {port} is in use by a process ratchet did not start; set RATCHET_MLFLOW_UI_PORT=<port> "
            "(or ServiceSettings(mlflow_ui_port=...)) and run `ratchet up` again",
        }
    cmd = command(settings)
    settings.ensure_state_dir()
    env = quiet_mlflow_env(dict(os.environ))
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    proc = processes.spawn_logged(cmd, settings.mlflow_ui_log, settings.state_dir, now(), env=env, keep=True)
    logger.info("starting the MLflow UI (pid %s) on %s", proc.pid, url)
    return {**base, "pid": proc.pid, "pgid": proc.pid, "start_ticks": processes.start_ticks(proc.pid), "cmd": cmd}


def describe(rec: dict[str, Any] | None) -> tuple[bool, str]:
    """(answers, detail) for `status`."""
    if not rec:
        return False, ""
    if rec.get("error"):
        return False, f"not started: {rec['error']}"
    answers = can_connect(rec["host"], rec["port"])
    if answers:
        return True, ""
    if is_ours(rec):
        return False, f"starting (log: {rec.get('log_file')})"
    return False, f"exited; last lines of {rec.get('log_file')}:\n{processes.log_tail(Path(rec.get('log_file', '')), 10)}"


def stop(rec: dict[str, Any], timeout: float) -> bool:
    """Stop the recorded server's process group (the server and its uvicorn worker)."""
    if not is_ours(rec):
        if rec.get("pid"):
            processes.reap(rec["pid"])
        return False
    pid: int = rec["pid"]
    members = processes.group_pids(pid)  # started in its own session: group id = pid
    logger.info("stopping the MLflow UI (pid %s, group %s)", pid, members)
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    left = processes.wait_gone(members, timeout)
    if left:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        processes.wait_gone(left, 5.0)
    processes.reap(pid)
    return True


def ensure(settings: ServiceSettings, state: dict[str, Any], started: list[str]) -> None:
    """`up`'s part (under its lock): start the UI unless ours runs or none is asked for;
    a failure to start is recorded in services.json and logged, never raised."""
    if settings.mlflow_ui_port is None:
        return
    services = state["services"]
    rec = services.get("mlflow_ui")
    if healthy(rec):
        if rec.get("port") != settings.mlflow_ui_port:  # type: ignore[union-attr]
            logger.warning(
                "the MLflow UI already runs on port %s (asked: %s); run `ratchet down` first to move it",
                rec.get("port"), settings.mlflow_ui_port,  # type: ignore[union-attr]
            )  # fmt: skip
        return
    if rec:
        stop(rec, settings.stop_timeout_s)
    services["mlflow_ui"] = rec = start(settings)
    if rec.get("error"):
        logger.warning("MLflow UI not started: %s", rec["error"])
    else:
        started.append("mlflow_ui")
    save_state(settings, state)


def _serve(argv: list[str]) -> None:
    """`python -m ratchet.platform.services.mlflow_ui DB ARGS...`: create the SQLite store
    at DB as the workers do (atomically: an `mlflow server` that made it itself and was
    stopped half-way would leave a store MLflow refuses), then exec `mlflow server ARGS`
    in this same process, so the pid `up` recorded is the server's."""
    create_sqlite_store(Path(argv[0]))
    os.execv(sys.executable, [sys.executable, "-m", "mlflow", "server", *argv[1:]])


if __name__ == "__main__":
    _serve(sys.argv[1:])
