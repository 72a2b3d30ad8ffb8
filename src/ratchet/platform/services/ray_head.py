"""The local Ray head's lifecycle: start it as the leader of a new session, find the
processes of that session (and only those), check it still runs, stop it."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any, TypeGuard

from ratchet.private_paths import UnsafeLocalDir, create_secret_file, ensure_private_dir

from . import processes
from .ports import can_connect
from .ray_auth import head_auth
from .settings import ServiceError, ServiceSettings, ray_address
from .state import now

logger = logging.getLogger(__name__)

__all__ = ["RAY_TEMP_DIR_MAX_LEN", "healthy", "is_ours", "pids", "start", "stop", "temp_dir"]

# AF_UNIX socket paths are limited to 108 bytes on Linux (107 usable). Ray puts its
# sockets at <temp_dir>/session_<YYYY-mm-dd_HH-MM-SS_ffffff>_<pid>/sockets/<name>;
# this is the longest suffix it appends to the temp dir (pid up to 7 digits, and a
# numbered socket name), plus some slack.
_RAY_SOCKET_SUFFIX = "/session_2000-01-01_00-00-00_000000_4194304/sockets/plasma_store.100"
_UNIX_SOCKET_MAX = 107
RAY_TEMP_DIR_MAX_LEN = _UNIX_SOCKET_MAX - len(_RAY_SOCKET_SUFFIX)


def temp_dir(settings: ServiceSettings) -> Path:
    """Ray's temp folder (its sockets, session files, its workers' logs), always inside a
    folder that is yours and closed to others: Ray makes its temp folder and the session
    folders in it world-writable (0777, so that several users can share one), so that
    folder itself cannot be the guard. ``<state>/ray`` when that path is short enough for
    Ray's unix sockets (the state folder is the private one); else
    ``/tmp/ratchet-<uid>-<name>/r``, where the private folder's <name> comes from the state
    folder's path and a random key kept in it (``ray_temp_key``, 0600): the same on every
    call for this state folder, unpredictable to other users, and checked (yours, 0700) so
    that nobody can have created it first."""
    fix = "set RATCHET_STATE_DIR to a short path of your own (Ray's temp folder goes under it)"
    preferred = settings.state_dir / "ray"
    if len(str(preferred).encode()) <= RAY_TEMP_DIR_MAX_LEN:
        settings.ensure_state_dir()
        return preferred
    name = hashlib.sha256(_temp_key(settings) + str(settings.state_dir).encode()).hexdigest()[:10]
    try:
        private = ensure_private_dir(Path("/tmp") / f"ratchet-{os.getuid()}-{name}", f"remove it, or {fix}")
    except UnsafeLocalDir as exc:
        raise ServiceError(f"Ray temp folder: {exc}") from None
    logger.info("state dir path is too long for Ray's unix sockets; using Ray temp dir %s", private / "r")
    return private / "r"


TEMP_KEY_FILE = "ray_temp_key"


def _temp_key(settings: ServiceSettings) -> bytes:
    """The state folder's random key for the name of Ray's temp folder (made once, 0600)."""
    path = settings.ensure_state_dir() / TEMP_KEY_FILE
    create_secret_file(path, secrets.token_hex(16))  # a concurrent start's key wins, whole
    return path.read_bytes()


def _package_dir() -> str:
    spec = importlib.util.find_spec("ray")
    if spec and spec.origin:
        return os.path.dirname(spec.origin)
    return os.sep + "ray" + os.sep


def is_ours(rec: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    """The recorded GCS server still runs (not a process that reused its pid)."""
    return bool(rec) and processes.same_process(rec.get("gcs_pid"), rec.get("gcs_start_ticks"))  # type: ignore[union-attr]


def healthy(rec: dict[str, Any] | None) -> bool:
    """The recorded GCS server still runs and accepts connections."""
    return is_ours(rec) and can_connect(rec["host"], rec["port"])  # type: ignore[index]


def _session_is_ours(rec: dict[str, Any]) -> bool:
    """The recorded session still holds our GCS server, or a process whose command
    line names our Ray temp dir (guards against a reused session id)."""
    if is_ours(rec):
        return True
    temp = rec.get("temp_dir") or ""
    return any(any(temp in a for a in processes.cmdline(p)) for p in processes.session_pids(rec["sid"]))


def pids(rec: dict[str, Any]) -> list[int]:
    """Processes of the Ray head recorded in ``rec``: the members of the session that
    ``ray start`` led (verified to be ours), plus any Ray executable whose command line
    names our session dir (in case one left the session)."""
    found: set[int] = set()
    sid = rec.get("sid")
    if sid and _session_is_ours(rec):
        found.update(processes.session_pids(sid))
    session_dir = rec.get("session_dir")
    if session_dir:
        ray_dir = _package_dir()
        for pid in processes.all_pids():
            if pid in found or not processes.alive(pid):
                continue
            cmd = processes.cmdline(pid)
            if any(session_dir in a for a in cmd) and any(ray_dir in a for a in cmd[:3]):
                found.add(pid)
    found.discard(os.getpid())
    return sorted(found)


def _command(settings: ServiceSettings, temp: Path) -> list[str]:
    binary = processes.find_binary("ray", "ray")
    return [
        str(binary), "start", "--head",
        "--port", str(settings.ray_port),
        "--node-ip-address", settings.host,
        "--dashboard-host", settings.host,
        "--include-dashboard=false",
        # With extra nodes the head only coordinates, as on a cluster: actors go to nodes.
        "--num-cpus", str(0 if settings.nodes or settings.worker_nodes else (os.cpu_count() or 1)),
        "--disable-usage-stats",
        *RAY_NODE_FLAGS,
        "--temp-dir", str(temp),
    ]  # fmt: skip


# What every Ray node ratchet starts is told. No usage reports. No prestarted default
# workers: a raylet would start one per CPU at start-up and again when the first driver
# connects (half a second of CPU each, then ~1% of a core each while idle), for a run
# that may come minutes later or never; a run's actors are few and long-lived, and an
# actor with a runtime_env (a `resources.torch_threads` other than its CPU count:
# actors/placement.py) could not take one anyway.
RAY_NODE_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}
# And no log monitor: it tails every worker's log file to publish the lines to drivers that
# print them (`log_to_driver`), and every ratchet driver turns that off (platform/worker.py);
# the lines stay in each node's log files. It polled all along: 3.6 CPU-s per node over a
# test's platform (benchmarks/suite_cpu.py over the suite: 93 CPU-s in 26 nodes).
RAY_NODE_FLAGS = ("--include-log-monitor=false",)


def _environment(settings: ServiceSettings) -> tuple[dict[str, str], dict[str, str], str]:
    """The head's environment, its RAY_AUTH_* part and where that came from."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(RAY_NODE_ENV)
    # Ray binds its ports on every interface whatever --node-ip-address says: token
    # authentication is what keeps others out. The head, its workers (they inherit
    # this environment) and every driver (`ray_auth_env`) use the same mode and token.
    # A user's explicit RAY_AUTH_* variables win.
    auth, source = head_auth(settings)
    if auth["RAY_AUTH_MODE"] != "token":
        logger.warning(
            "starting Ray with RAY_AUTH_MODE=%s from your environment: anyone who can reach "
            "its ports can run code on this machine; unset RAY_AUTH_MODE to use a token",
            auth["RAY_AUTH_MODE"],
        )
    env.update(auth)
    return env, auth, source


def start(settings: ServiceSettings) -> dict[str, Any]:
    """Start the head and wait until its GCS accepts connections; returns its record
    for services.json."""
    temp = temp_dir(settings)
    cmd = _command(settings, temp)
    env, auth, source = _environment(settings)
    log_path = settings.ray_log
    started_at = now()
    # A new session: every Ray process started by `ray start` inherits its id.
    proc = processes.spawn_logged(cmd, log_path, settings.state_dir, started_at, env=env)
    sid = proc.pid
    logger.info("starting Ray head (session %s) on %s", sid, ray_address(settings))
    rec: dict[str, Any] = {
        "sid": sid,
        "launcher_pid": sid,
        "host": settings.host,
        "port": settings.ray_port,
        "address": ray_address(settings),
        "temp_dir": str(temp),
        "session_dir": None,
        "auth_mode": auth["RAY_AUTH_MODE"],
        # The path only: the token stays out of this file.
        "auth_token_path": auth.get("RAY_AUTH_TOKEN_PATH"),
        "auth_source": source,
        "log_file": str(log_path),
        "cmd": cmd,
        "started_at": started_at,
    }

    def fail(msg: str) -> ServiceError:
        stop(rec, timeout=3.0)
        return ServiceError(f"{msg}\nLast lines of {log_path}:\n{processes.log_tail(log_path)}")

    try:
        rc = proc.wait(timeout=max(settings.start_timeout_s, 60.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise fail("`ray start` did not finish in time") from None
    if rc != 0:
        raise fail(f"`ray start` failed with exit code {rc}")
    latest = temp / "session_latest"
    if latest.exists():
        rec["session_dir"] = os.path.realpath(latest)
    deadline = time.monotonic() + settings.start_timeout_s
    while not can_connect(settings.host, settings.ray_port):
        if time.monotonic() >= deadline:
            raise fail(f"Ray GCS did not accept connections on {rec['address']}")
        time.sleep(0.1)
    members = processes.session_pids(sid)
    by_name = {p: processes.exe_name(p) for p in members}
    gcs = [p for p, n in by_name.items() if n == "gcs_server"]
    raylet = [p for p, n in by_name.items() if n == "raylet"]
    if not gcs:
        raise fail("Ray started, but no gcs_server process was found in its session")
    rec.update(
        gcs_pid=gcs[0],
        gcs_start_ticks=processes.start_ticks(gcs[0]),
        raylet_pid=raylet[0] if raylet else None,
        pids=sorted(members),
        ready_at=now(),
    )
    logger.info("Ray head ready at %s (gcs pid %s, temp dir %s)", rec["address"], gcs[0], temp)
    return rec


def stop(rec: dict[str, Any], timeout: float) -> bool:
    """Stop the processes of the recorded head; False when none was running."""
    found = pids(rec)
    if not found:
        logger.info("Ray head (session %s) is not running any more", rec.get("sid"))
        return False
    logger.info("stopping Ray head (session %s): pids %s", rec.get("sid"), found)
    names = {p: processes.exe_name(p) for p in found}
    # Same order as `ray stop`: raylet first (its agents and workers fate-share with
    # it), then the other processes, the GCS last.
    raylets = [p for p in found if names[p] == "raylet"]
    gcs = [p for p in found if names[p] == "gcs_server"]
    rest = [p for p in found if p not in raylets and p not in gcs]
    per_bucket = max(timeout / 3.0, 0.5)
    signalled: list[int] = []
    for bucket, what in ((raylets, "raylet"), (rest, "ray processes"), (gcs, "gcs_server")):
        if bucket:
            signalled += processes.terminate(bucket, per_bucket, what)
    # Workers or agents that outlived their parents.
    leftover = pids(rec)
    if leftover:
        signalled += processes.terminate(leftover, 2.0, "ray leftovers")
    # Ray would otherwise point a plain `ray.init()` with this temp dir at a dead head.
    with contextlib.suppress(OSError):
        (Path(rec["temp_dir"]) / "ray_current_cluster").unlink()
    return bool(signalled)
