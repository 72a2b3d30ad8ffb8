"""Extra Ray nodes on this machine (`ratchet up --nodes N`): a cluster to try on one host.

Each node is one session led by a small supervisor (`ratchet.platform.node`): its raylet
with the raylet's agents and actor processes, and the node's own `ratchet worker`. Killing
the session kills the node whole, as when a machine dies; the head never sees a goodbye.
A node carries a custom resource `ratchet_node_<i>` and the Ray node name `node-<i>`, so a
placement, a test or `ratchet drain node-<i>` can tell the nodes apart. The head joins with
no CPUs of its own then: like a production head, it only coordinates, and every actor
lands on a node that can die.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, TypeGuard

from . import processes
from .ray_auth import ray_auth_env
from .ray_head import RAY_NODE_ENV
from .settings import ServiceError, ServiceSettings, ray_address, temporal_address
from .state import now

logger = logging.getLogger(__name__)

__all__ = ["NODE_LOG", "kill", "node_name", "node_resource", "pids", "start", "stop", "worker_identity_prefix"]

NODE_LOG = "node-{index}.log"
# The supervisor writes this line once the raylet runs and the node's worker was started.
READY_LINE = "ratchet node ready:"


def node_name(index: int) -> str:
    return f"node-{index}"


def node_resource(index: int) -> str:
    """The custom Ray resource only node `index` has (one unit)."""
    return f"ratchet_node_{index}"


def worker_identity_prefix(index: int) -> str:
    """How the node's Temporal worker names itself: a pending activity's
    `last_worker_identity` tells which node runs it."""
    return f"{node_name(index)}/"


def log_path(settings: ServiceSettings, index: int) -> Path:
    return settings.logs_dir / NODE_LOG.format(index=index)


def _environment(settings: ServiceSettings) -> dict[str, str]:
    """The supervisor's environment: where the head and Temporal are, the head's token
    (its path, never the token), and the state folder its worker records runs in."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(ray_auth_env(settings))
    env.update(
        RATCHET_RAY_ADDRESS=ray_address(settings),
        RATCHET_TEMPORAL_ADDRESS=temporal_address(settings),
        RATCHET_STATE_DIR=str(settings.state_dir),
        **RAY_NODE_ENV,
    )
    from ratchet.registry.urls import ENV as REGISTRY_ENV
    from ratchet.registry.urls import sqlite_url

    env.setdefault(REGISTRY_ENV, sqlite_url(settings.state_dir))
    return env


def start(settings: ServiceSettings, index: int) -> dict[str, Any]:
    """Start node `index` and wait until its raylet runs and its worker (if it has one)
    polls Temporal; returns its record for services.json. Nodes 1..settings.nodes offer
    `node_cpus` (and run a worker if `node_workers`); the `worker_nodes` after them offer
    no CPUs and run a worker only."""
    path = log_path(settings, index)
    offset = path.stat().st_size if path.exists() else 0
    compute = index <= settings.nodes
    cpus, worker = (settings.node_cpus, settings.node_workers) if compute else (0.0, True)
    cmd = [
        sys.executable, "-m", "ratchet.platform.node",
        "--index", str(index), "--cpus", f"{cpus:g}", "--host", settings.host, *([] if worker else ["--no-worker"]),
    ]  # fmt: skip
    started_at = now()
    proc = processes.spawn_logged(cmd, path, settings.state_dir, started_at, env=_environment(settings), keep=True)
    rec: dict[str, Any] = {
        "index": index,
        "name": node_name(index),
        "sid": proc.pid,
        "pid": proc.pid,
        "start_ticks": processes.start_ticks(proc.pid),
        "cpus": cpus,
        "worker": worker,
        "log_file": str(path),
        "started_at": started_at,
    }
    deadline = time.monotonic() + max(settings.start_timeout_s, 60.0)
    while True:
        text = _read_from(path, offset)
        # Ready once the node's worker polls Temporal (it logs "worker on ... pid P").
        match = re.search(rf"{READY_LINE} .*worker pid (\d+|none)", text)
        if match and (match.group(1) == "none" or re.search(rf" worker on .* pid {match.group(1)}\b", text)):
            break
        if proc.poll() is not None or time.monotonic() >= deadline:
            kill(rec)
            why = f"exited with code {proc.returncode}" if proc.poll() is not None else "did not get ready in time"
            raise ServiceError(f"Ray node {node_name(index)} {why}\nLast lines of {path}:\n{processes.log_tail(path)}")
        time.sleep(0.1)
    logger.info("Ray node %s ready (session %s)", node_name(index), proc.pid)
    return rec


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def is_ours(rec: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    """The recorded supervisor still runs (not a process that reused its pid)."""
    return bool(rec) and processes.same_process(rec.get("pid"), rec.get("start_ticks"))  # type: ignore[union-attr]


def pids(rec: dict[str, Any]) -> list[int]:
    """Every live process of the node: its session (supervisor, raylet, agents, actor
    processes, the node's worker)."""
    if not is_ours(rec) and not processes.session_pids(rec["sid"]):
        return []
    found = [p for p in processes.session_pids(rec["sid"]) if p != os.getpid()]
    return sorted(found)


def kill(rec: dict[str, Any]) -> list[int]:
    """SIGKILL every process of the node at once: a machine that died. Returns the pids."""
    found = pids(rec)
    for pid in found:
        processes.signal_pid(pid, signal.SIGKILL)
    processes.wait_gone(found, 10.0)
    processes.reap(rec["pid"])
    return found


def stop(rec: dict[str, Any], timeout: float) -> bool:
    """Stop the node in order: the supervisor stops its worker (running activities are
    handed back) and its raylet; what is left after `timeout` is killed."""
    found = pids(rec)
    if not found:
        return False
    if processes.signal_pid(rec["pid"], signal.SIGTERM):
        processes.wait_gone([rec["pid"]], timeout)
    left = pids(rec)
    if left:
        processes.terminate(left, 2.0, f"Ray node {rec.get('name')}")
    processes.reap(rec["pid"])
    return True
