"""`ratchet demo`: one command from a fresh checkout to a tiny model that visibly learns.

It builds the demo assets, starts the embedded services and a worker process, submits the
copy-task recipe (supervised warm-up, then GRPO), follows it with a progress bar, prints a
summary table and ends with one line of JSON. The services stay up afterwards so the run
can be browsed in the Temporal UI; `ratchet down` stops them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from rich.console import Console

from ratchet.private_paths import PRIVATE_UMASK
from ratchet.registry.urls import ENV as REGISTRY_ENV
from ratchet.registry.urls import sqlite_url

from .assets import prepare_assets
from .client import RECIPE_PATH as RECIPE
from .client import Client, RunHandle
from .payload_key import KEY_FILE_VAR, key_file_path
from .plot import plot_or_reason
from .services import ServiceSettings, mlflow_ui_url, ray_address, ray_auth_env, temporal_address, up
from .tables import show
from .watch import run_link, summary_table, watch


def start_worker_process(settings: ServiceSettings) -> subprocess.Popen:
    log_dir = settings.ensure_private_subdir(Path(settings.state_dir) / "logs")
    env = dict(os.environ, RATCHET_TEMPORAL_ADDRESS=temporal_address(settings), RATCHET_RAY_ADDRESS=ray_address(settings))
    # The token's path (not the token) in the environment: the worker joins Ray with it.
    env.update(ray_auth_env(settings))
    # The run registry of these services' state folder, unless the user named another.
    env.setdefault(REGISTRY_ENV, sqlite_url(settings.state_dir))
    env["RATCHET_STATE_DIR"] = str(settings.state_dir)  # the trackers' default stores: <state>/mlflow.db, <state>/wandb
    env[KEY_FILE_VAR] = str(key_file_path(settings.state_dir))  # the services' payload key, unless one was named
    # A worker started while the Temporal server restarts waits for it instead of exiting
    # at once: nothing restarts this process, and its runs would wait for a worker forever.
    env.setdefault("RATCHET_WORKER_WAIT_S", "60")
    # Private like the services (processes.spawn_logged): its log, and what it writes.
    with open(os.open(log_dir / "worker.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "ratchet.platform.worker"], env=env, stdout=log, stderr=subprocess.STDOUT, umask=PRIVATE_UMASK
        )


def wait_until_serving(settings: ServiceSettings, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Block until the worker process polls its task queue (it logs "worker on ..." after
    joining Ray and Temporal and sweeping the actors of closed runs), so that nothing a
    caller creates next is taken for a leftover by that sweep."""
    log_path = Path(settings.state_dir) / "logs" / "worker.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the worker process exited with code {proc.returncode}; see {log_path}")
        lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
        if any(" worker on " in line and f"pid {proc.pid}" in line for line in lines):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the worker process did not start serving within {timeout_s:.0f} s; see {log_path}")


def stop_worker_process(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_demo(settings: ServiceSettings, overrides: Sequence[str], console: Console) -> int:
    t0 = time.perf_counter()
    if not RECIPE.is_file():
        console.print(f"[red]demo recipe not found at {RECIPE}; run `ratchet demo` from a source checkout[/red]")
        return 1
    state = Path(settings.state_dir).resolve()
    console.print("[bold]1/4[/bold] building the tiny model and the copy task")
    assets = prepare_assets(state / "assets", tasks=("copy",))
    train, evals = assets.data["copy"]
    paths = [f"model.path={assets.model}", f"data.train_files={train}", f"data.eval_files={evals}", f"storage.root={state / 'runs'}"]
    console.print("[bold]2/4[/bold] starting Temporal (dev server) and Ray")
    up(settings)
    ui_url = f"http://{settings.host}:{settings.temporal_ui_port}"
    console.print(f"      Temporal UI: {ui_url}", soft_wrap=True)
    if mlflow_ui_url(settings):
        console.print(
            f"      MLflow UI: {mlflow_ui_url(settings)} (starts in the background; `ratchet status` says when it answers)", soft_wrap=True
        )
    console.print("[bold]3/4[/bold] starting a worker")
    worker = start_worker_process(settings)
    try:
        client = Client.of_services(settings)
        handle = client.submit(RECIPE, [*paths, *overrides])
        console.print(f"[bold]4/4[/bold] training: run [bold]{handle.run_id}[/bold]", soft_wrap=True)
        # Links and paths are printed whole (soft_wrap): a line break inside one breaks it.
        console.print(f"      {run_link(ui_url, handle.run_id)}", soft_wrap=True)
        if not isinstance(handle, RunHandle):  # overrides that add `stages`: a pipeline, followed as `ratchet train` does
            from .pipelines import follow_pipeline

            follow_pipeline(handle, console)
            return 0
        summary = watch(handle, console)
    finally:
        stop_worker_process(worker)
    wall = time.perf_counter() - t0
    show(console, summary_table(summary, wall, ui_url))
    console.print("services are still up for browsing; stop them with `ratchet down`")
    console.print(
        f"plot: {plot_or_reason([summary.run_id], state / 'plots' / f'{summary.run_id}.png', str(state / 'runs'))}", soft_wrap=True
    )
    line = {
        "run_id": summary.run_id,
        "steps": summary.steps,
        "reward_first10": round(summary.reward_first10, 4),
        "reward_last10": round(summary.reward_last10, 4),
        "wall_s": round(wall, 1),
    }
    sys.stdout.write(json.dumps(line) + "\n")
    return 0
