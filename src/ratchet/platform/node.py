"""One Ray node of `ratchet up --nodes N`, supervised: `python -m ratchet.platform.node --index I`.

It leads its own session (services/ray_nodes.py starts it so) and keeps two children in
it: `ray start --block`, which joins the head as node `node-<I>` with the resource
`ratchet_node_<I>`, and (unless `--no-worker`) the node's `ratchet worker` (its Temporal
identity starts with `node-<I>/`). A worker that exits is started again, as a process supervisor would; when the
raylet goes, the node goes with it. SIGTERM stops both in order: the worker first (its
running activities are handed back), then Ray, which drains the node. A SIGKILL of the
whole session is a machine dying: nothing here runs, which is the point.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from .services import processes
from .services.ray_head import RAY_NODE_FLAGS
from .services.ray_nodes import READY_LINE, node_name, node_resource, worker_identity_prefix

log = logging.getLogger("ratchet.node")

_POLL_S = 0.5
_RAY_READY_LINE = "Ray runtime started"


def _ray_command(index: int, cpus: float, host: str) -> list[str]:
    return [
        str(processes.find_binary("ray", "ray")), "start", "--block",
        "--address", os.environ["RATCHET_RAY_ADDRESS"],
        "--node-ip-address", host,
        "--node-name", node_name(index),
        "--num-cpus", f"{cpus:g}",
        "--resources", json.dumps({node_resource(index): 1}),
        "--disable-usage-stats",
        *RAY_NODE_FLAGS,
    ]  # fmt: skip


def _start_worker(index: int) -> subprocess.Popen:
    # A worker that finds Temporal down waits for it rather than exiting at once: this
    # supervisor restarts a worker that exits, which would otherwise loop once a second.
    env = dict(os.environ, RATCHET_WORKER_IDENTITY=f"{worker_identity_prefix(index)}{os.getpid()}")
    env.setdefault("RATCHET_WORKER_WAIT_S", "60")
    return subprocess.Popen([sys.executable, "-m", "ratchet.platform.worker"], env=env, stdin=subprocess.DEVNULL)


def _wait_ray_ready(ray: subprocess.Popen, name: str) -> None:
    """Until `ray start` says the node runs (its output is echoed into the node's log)."""
    assert ray.stdout is not None  # started with stdout=PIPE
    for line in iter(ray.stdout.readline, ""):
        sys.stdout.write(line)
        sys.stdout.flush()
        if _RAY_READY_LINE in line:
            return
    raise SystemExit(f"`ray start` for {name} ended before the node ran (exit code {ray.wait()})")


def _echo(ray: subprocess.Popen) -> None:
    assert ray.stdout is not None  # started with stdout=PIPE
    for line in ray.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--cpus", type=float, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--no-worker", action="store_true", help="Run Ray only, no ratchet worker.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    name = node_name(args.index)
    ray = subprocess.Popen(_ray_command(args.index, args.cpus, args.host), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_ray_ready(ray, name)
    # The rest of `ray start`'s output into the node's log too (a full pipe would block it).
    threading.Thread(target=_echo, args=(ray,), daemon=True).start()
    worker = None if args.no_worker else _start_worker(args.index)
    print(f"{READY_LINE} {name} (raylet session {os.getsid(0)}, worker pid {worker.pid if worker else 'none'})", flush=True)

    stopping = False

    def on_term(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while not stopping:
        if ray.poll() is not None:
            log.error("%s: Ray exited with code %s; stopping the node's worker", name, ray.returncode)
            if worker is not None:
                worker.terminate()
                worker.wait(30)
            return 1
        if worker is not None and worker.poll() is not None:
            log.warning("%s: the worker exited with code %s; starting it again", name, worker.returncode)
            worker = _start_worker(args.index)
        time.sleep(_POLL_S)
    log.info("%s: stopping (worker, then Ray)", name)
    if worker is not None:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
    ray.terminate()
    try:
        ray.wait(45)
    except subprocess.TimeoutExpired:
        ray.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
