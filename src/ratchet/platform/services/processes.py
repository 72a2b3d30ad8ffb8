"""Process control on psutil: is a recorded process still the same one, which processes
share a session or group, stopping them with a timeout, reaping, and starting a service
detached with its output appended to a log file."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Mapping

import psutil

from ratchet.private_paths import PRIVATE_UMASK, make_private_dirs

from .settings import ServiceError

logger = logging.getLogger(__name__)

__all__ = [
    "all_pids",
    "alive",
    "cmdline",
    "exe_name",
    "find_binary",
    "forget",
    "group_pids",
    "log_tail",
    "reap",
    "same_process",
    "session_pids",
    "signal_pid",
    "spawn_logged",
    "start_ticks",
    "terminate",
    "wait_gone",
]

# Popen objects of the services started by this process, so that `down` in the same
# process can reap them (no zombies, no "still running" ResourceWarning).
_CHILDREN: dict[int, subprocess.Popen] = {}
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks after boot: the identity that services.json
    records (``start_ticks``, ``gcs_start_ticks``) to tell a process from a later one
    with the same pid. On Linux psutil's ``create_time()`` is boot time + those ticks /
    SC_CLK_TCK, so this inverts it exactly: records written before psutil was used
    still match, and older ratchets can read the records written now."""
    try:
        created = psutil.Process(pid).create_time()
    except psutil.Error:
        return None
    return round((created - psutil.boot_time()) * _CLOCK_TICKS)


def _thread_alive(tid: int) -> bool:
    try:
        return psutil.Process(tid).status() not in _GONE
    except psutil.Error:
        return False


def alive(pid: int | None) -> bool:
    """True for a live process. A zombie counts as dead once all its threads are gone
    (the leader of a multi-threaded process turns Z while the other threads still exit
    and still hold its sockets)."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        state = proc.status()
        if state not in _GONE:
            return True
        if state == psutil.STATUS_DEAD:
            return False
        tids = [t.id for t in proc.threads()]
    except psutil.Error:
        return False
    return any(_thread_alive(t) for t in tids)


def same_process(pid: int | None, ticks: int | None) -> bool:
    """The recorded pid is alive and is the same process (not a reused pid)."""
    if not alive(pid):
        return False
    return ticks is None or start_ticks(pid) == ticks  # type: ignore[arg-type]


def cmdline(pid: int) -> list[str]:
    """The command line of ``pid``; empty for a zombie or a process that is gone."""
    try:
        return [a for a in psutil.Process(pid).cmdline() if a]
    except psutil.Error:
        return []


def exe_name(pid: int) -> str:
    """The file name of the program ``pid`` runs, as its command line names it."""
    cmd = cmdline(pid)
    return os.path.basename(cmd[0]) if cmd else ""


def all_pids() -> list[int]:
    return psutil.pids()


def _pids_where(key: Callable[[int], int], value: int) -> list[int]:
    """Live processes (not zombies) for which ``key(pid) == value``."""
    out = []
    for proc in psutil.process_iter(["status"]):
        if proc.info["status"] in _GONE:
            continue
        with contextlib.suppress(OSError):
            if key(proc.pid) == value:
                out.append(proc.pid)
    return out


def session_pids(sid: int) -> list[int]:
    """Live processes whose session id is ``sid``."""
    return _pids_where(os.getsid, sid)


def group_pids(pgid: int) -> list[int]:
    """Live processes whose process group id is ``pgid``."""
    return _pids_where(os.getpgid, pgid)


def reap(pid: int) -> None:
    """Collect the exit status of ``pid`` if it is a child of this process (no zombie)."""
    proc = _CHILDREN.pop(pid, None)
    if proc is not None:
        with contextlib.suppress(Exception):
            proc.wait(timeout=0.1)
        return
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def signal_pid(pid: int, sig: int) -> bool:
    """Send ``sig`` to ``pid``; False when it is gone or not ours to signal."""
    try:
        psutil.Process(pid).send_signal(sig)
        return True
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        logger.warning("no permission to send signal %s to pid %s", sig, pid)
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` is alive; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    left = list(pids)
    while left:
        for pid in left:
            reap(pid)
        left = [p for p in left if alive(p)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return left


def terminate(pids: list[int], timeout: float, what: str) -> list[int]:
    """SIGTERM ``pids``, wait up to ``timeout``, SIGKILL the rest. Returns signalled pids."""
    signalled = [p for p in pids if signal_pid(p, signal.SIGTERM)]
    left = wait_gone(signalled, timeout)
    if left:
        logger.warning("%s: %s did not exit on SIGTERM within %.1fs; killing", what, left, timeout)
        for p in left:
            signal_pid(p, signal.SIGKILL)
        left = wait_gone(left, 5.0)
        if left:
            logger.error("%s: %s still alive after SIGKILL", what, left)
    return signalled


def spawn_logged(
    cmd: list[str],
    log_path: Path,
    cwd: Path,
    started_at: str,
    env: Mapping[str, str] | None = None,
    keep: bool = False,
) -> subprocess.Popen:
    """Start `cmd` detached, in a new session (its own process group), appending to
    `log_path`. ``keep``: remember the Popen so that ``reap`` can collect it later.

    The log (and its folder) are private, and the service runs with umask 077: what it
    creates under the state folder (databases, Ray's session files, its workers' output)
    is its user's alone."""
    make_private_dirs(log_path.parent)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # a log from before this change
    with os.fdopen(fd, "ab") as log:
        log.write(f"\n=== {started_at} ratchet: {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            cwd=cwd,
            env=env,
            umask=PRIVATE_UMASK,
        )
    if keep:
        _CHILDREN[proc.pid] = proc
    return proc


def forget(pid: int) -> None:
    """Drop a child that exited and was already waited for."""
    _CHILDREN.pop(pid, None)


def log_tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:]) or "(log is empty)"


def find_binary(name: str, package: str) -> Path:
    """The executable ``name`` installed next to this Python interpreter."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise ServiceError(f"`{name}` not found at {path}; install it into this environment with `pip install {package}`")
    return path
