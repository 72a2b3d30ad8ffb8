"""Where does the time from submit to the first step go? The demo recipe (tiny model,
10 warm-up steps, an evaluation at step 0) submitted to services and a worker that are
already up (`ratchet up && ratchet worker`), timed from `Client.submit` to the first
line of `metrics.jsonl`. The phases come from the workflow history (each activity's
wait for a worker, and its run); the costs they are made of (a fresh process importing
torch and transformers, a Ray actor's start) are measured apart. Prints two tables.

    .venv/bin/python benchmarks/first_step.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ratchet.platform.assets import prepare_assets
from ratchet.platform.client import RECIPE_PATH, Client
from ratchet.platform.demo import start_worker_process, stop_worker_process, wait_until_serving
from ratchet.platform.services import ServiceSettings, down, free_ports, temporal_address, up


def first_step(overrides: list[str], state: Path) -> tuple[list[tuple[str, float]], float]:
    """(phase, seconds) rows from submit to the first metrics line, and that total."""
    t, ui, r = free_ports(3)
    settings = ServiceSettings(state_dir=state, temporal_port=t, temporal_ui_port=ui, ray_port=r, start_timeout_s=60)
    up(settings)
    worker = start_worker_process(settings)
    try:
        wait_until_serving(settings, worker)
        client = Client.connect(temporal_address(settings))
        t0 = time.time()
        handle = client.submit(RECIPE_PATH, overrides)
        submitted = time.time()
        metrics = Path(overrides_root(overrides)) / handle.run_id / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.02)
        first = time.time()
        handle.stop()
        handle.result(timeout=600)
        history = handle.history()
    finally:
        stop_worker_process(worker)
        down(settings)
    rows = [("client: validate the config and start the workflow", submitted - t0)]
    rows += history_phases(history, t0, first)
    return rows, first - t0


def overrides_root(overrides: list[str]) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith("storage.root="))


def history_phases(history, t0: float, first: float) -> list[tuple[str, float]]:
    """Each activity before the first metrics line: its wait for a worker and its run; the
    time between activities (workflow tasks) summed as one row."""
    names, scheduled, started = {}, {}, {}
    rows: list[tuple[str, float]] = []
    busy = 0.0
    start_event = None
    for e in history.events:
        ts = e.event_time.seconds + e.event_time.nanos / 1e9
        if ts > first:
            break
        if e.HasField("workflow_execution_started_event_attributes"):
            start_event = ts
        if e.HasField("activity_task_scheduled_event_attributes"):
            names[e.event_id] = e.activity_task_scheduled_event_attributes.activity_type.name
            scheduled[e.event_id] = ts
        elif e.HasField("activity_task_started_event_attributes"):
            started[e.activity_task_started_event_attributes.scheduled_event_id] = ts
        elif e.HasField("activity_task_completed_event_attributes"):
            sid = e.activity_task_completed_event_attributes.scheduled_event_id
            name = names[sid]
            rows.append((f"{name}: waiting for a worker", started[sid] - scheduled[sid]))
            rows.append((f"{name}: running", ts - started[sid]))
            if name == "warmup":
                result = json.loads(e.activity_task_completed_event_attributes.result.payloads[0].data)
                rows.append(("  of which the warm-up's training and save (the rest: its process, imports)", result["seconds"]))
            busy += ts - scheduled[sid]
    first_activity = min(scheduled.values())
    rows.insert(0, ("workflow start to its first activity", first_activity - (start_event or t0)))
    between = (first - first_activity) - busy
    rows.append(("workflow tasks between activities, and the metrics line", between))
    return rows


def isolated_costs() -> list[tuple[str, float]]:
    """What the phases are made of, each measured in a fresh process."""
    py = sys.executable
    out = []
    for label, code in [
        ("python + import torch", "import torch"),
        ("python + import torch, transformers (a worker's imports)", "import torch, transformers; from transformers import AutoModelForCausalLM"),
        ("python + import ratchet.workers.trainer", "import ratchet.workers.trainer"),
    ]:
        t0 = time.perf_counter()
        subprocess.run([py, "-c", code], check=True)
        out.append((label, time.perf_counter() - t0))
    return out


def main() -> None:
    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="rt-first-"))
    try:
        assets = prepare_assets(work / "assets", tasks=("copy",))
        train, evals = assets.data["copy"]
        overrides = [
            f"model.path={assets.model}", f"data.train_files={train}", f"data.eval_files={evals}",
            f"storage.root={work / 'runs'}", "loop.steps=3", "tracking.name=first-step",
        ]  # fmt: skip
        rows, total = first_step(overrides, work / "svc")
        costs = isolated_costs()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    console = Console(width=160)
    table = Table(title="submit to the first step's metrics line (demo recipe, services and worker already up)")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    for label, seconds in rows:
        table.add_row(label, f"{seconds:.2f}")
    table.add_row("total", f"{total:.2f}")
    console.print(table)
    parts = Table(title="what the phases are made of (each in a fresh process)")
    parts.add_column("cost")
    parts.add_column("seconds", justify="right")
    for label, seconds in costs:
        parts.add_row(label, f"{seconds:.2f}")
    console.print(parts)
    os._exit(0)  # the Temporal SDK can crash at interpreter exit


if __name__ == "__main__":
    main()
