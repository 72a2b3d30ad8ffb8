"""What does durability cost per step? The same GRPO step, twice:

1. a plain in-process loop: engine, reward function and trainer called directly, weights
   copied in memory (no Temporal, no Ray, no storage);
2. through ratchet: the training workflow on a Temporal dev server, a worker process, Ray
   actors, batches in the batch store, weights through Ray's object store.

Same model, data, batch and seed. The ratchet time per step is measured from the workflow
history (step 1's first activity scheduled to the last step's last activity completed), so
service start-up, warm-up, evaluation and the first step (caches warming, as in the plain
loop) are excluded. Per-step medians; the plain loop runs before and after ratchet, since a
shared machine's load changes in between. Prints one table.

    .venv/bin/python benchmarks/step_overhead.py [--steps 20]
    .venv/bin/python benchmarks/step_overhead.py --smoke   # seconds: that it still runs (make test does)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ratchet.config import load_config
from ratchet.platform.assets import prepare_assets
from ratchet.platform.client import RECIPE_PATH, Client
from ratchet.platform.demo import start_worker_process, stop_worker_process
from ratchet.platform.services import ServiceSettings, down, free_ports, up
from ratchet.workers.local_loop import LocalLoop


PHASES = ("generate", "score", "train", "sync")


def plain_loop(cfg, steps: int) -> dict[str, float]:
    """Median seconds per step of the bare algorithm, phase by phase (the first step left
    out: it warms caches). Medians: the machine may be shared, and a median shrugs off
    another process's burst where a mean does not."""
    loop = LocalLoop(cfg)
    rows = [loop.step(step) for step in range(steps + 1)][1:]
    out = {k: statistics.median(m[f"{k}_seconds"] for m in rows) for k in PHASES}
    out["step"] = statistics.median(sum(m[f"{k}_seconds"] for k in PHASES) for m in rows)
    return out


def ratchet_loop(overrides: list[str], steps: int, state: Path) -> dict[str, float]:
    t, ui, r = free_ports(3)
    settings = ServiceSettings(state_dir=state, temporal_port=t, temporal_ui_port=ui, ray_port=r, start_timeout_s=60)
    up(settings)
    worker = start_worker_process(settings)
    try:
        client = Client.of_services(settings)  # the key its worker holds
        handle = client.submit(RECIPE_PATH, overrides)
        summary = handle.result()
        history = handle.history()
    finally:
        stop_worker_process(worker)
        down(settings)
    # A step starts with its `step` activity (sync mode) or its `generate` (per-phase
    # activities) and ends when the next one starts (the last: when its `step` or
    # `sync_weights` completes). Step 0 is left out, as in the plain loop.
    starts, ends, names = [], [], {}
    scheduled, started = {}, {}  # activity scheduled / started times, by scheduled event id
    queued, running = [], []  # per step activity: scheduled -> started, started -> completed
    for e in history.events:
        if e.HasField("activity_task_scheduled_event_attributes"):
            names[e.event_id] = e.activity_task_scheduled_event_attributes.activity_type.name
            scheduled[e.event_id] = e.event_time.ToDatetime()
            if names[e.event_id] in ("step", "generate"):
                starts.append(e.event_time.ToDatetime())
        if e.HasField("activity_task_started_event_attributes"):
            started[e.activity_task_started_event_attributes.scheduled_event_id] = e.event_time.ToDatetime()
        if e.HasField("activity_task_completed_event_attributes"):
            sid = e.activity_task_completed_event_attributes.scheduled_event_id
            if names.get(sid) in ("step", "sync_weights"):
                ends.append(e.event_time.ToDatetime())
            if names.get(sid) == "step" and sid in started:
                queued.append((started[sid] - scheduled[sid]).total_seconds())
                running.append((e.event_time.ToDatetime() - started[sid]).total_seconds())
    bounds = [*starts[1:steps], ends[-1]]
    durations = [(b - a).total_seconds() for a, b in zip(bounds, bounds[1:])]
    metrics = [json.loads(x) for x in (Path(summary.run_uri) / "metrics.jsonl").read_text().splitlines()][1:]
    inside = {k: statistics.median(m[f"{k}_seconds"] for m in metrics) for k in PHASES}
    out = {"step": statistics.median(durations), **inside}
    if running:  # sync mode: one `step` activity per step (step 0 left out)
        out["activity_queued"] = statistics.median(queued[1:steps])
        out["activity_running"] = statistics.median(running[1:steps])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="seconds, to show the script still runs (make test does): 3 steps")
    args = ap.parse_args()
    if args.smoke:
        args.steps = 3
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="rt-bench-"))
    try:
        assets = prepare_assets(work / "assets", tasks=("copy",))
        train, evals = assets.data["copy"]
        overrides = [
            f"model.path={assets.model}", f"data.train_files={train}", f"data.eval_files={evals}",
            f"storage.root={work / 'runs'}", f"loop.steps={args.steps}", "loop.eval_every=0",
            "warmup.steps=0", "data.eval_size=8", "tracking.name=bench",
            # The plain loop logs to no tracker; MLflow's background thread would compete
            # for these two cores. (The run registry stays on: it is ratchet's own bookkeeping.)
            "tracking.mlflow=false",
        ]  # fmt: skip
        cfg = load_config(RECIPE_PATH, overrides)
        before = plain_loop(cfg, args.steps)
        through = ratchet_loop(overrides, args.steps, work / "svc")
        after = plain_loop(cfg, args.steps)  # the machine may have got busier or quieter meanwhile
    finally:
        shutil.rmtree(work, ignore_errors=True)

    table = Table(title=f"seconds per GRPO step ({cfg.loop.prompts_per_step} prompts x {cfg.rollout.n} samples, {args.steps} steps)")
    table.add_column("")
    for col in ("step", "generate", "score", "train", "sync"):
        table.add_column(col, justify="right")
    table.add_row("plain loop (in-process), before", *(f"{before[k]:.3f}" for k in ("step", *PHASES)))
    table.add_row("ratchet (workflow + Ray)", *(f"{through[k]:.3f}" for k in ("step", *PHASES)))
    table.add_row("plain loop (in-process), after", *(f"{after[k]:.3f}" for k in ("step", *PHASES)))
    console = Console(width=160)
    console.print(table)
    plain = (before["step"] + after["step"]) / 2
    ratios = sorted(through["step"] / p["step"] for p in (before, after))
    busy = ": far apart, the load changed; measure on a quiet machine" if ratios[1] > 1.1 * ratios[0] else ""
    console.print(
        f"ratchet step - plain step: {(through['step'] - plain) * 1000:.0f} ms per step ({through['step'] / plain:.2f}x the plain "
        f"loop; {ratios[0]:.2f}x-{ratios[1]:.2f}x against the runs before and after{busy})"
    )
    # The phases run in separate processes through ratchet, so their compute differs a little
    # from the in-process loop; the time outside every phase is orchestration alone.
    outside_ms = (through["step"] - sum(through[k] for k in PHASES)) * 1000
    console.print(f"ratchet step time outside the four phases: {outside_ms:.0f} ms per step")
    if "activity_running" in through:
        # Where that goes: Temporal (the workflow task that schedules the next step, and the
        # activity's dispatch) or the activity itself (Ray calls, actor look-ups, storage).
        in_activity_ms = (through["activity_running"] - sum(through[k] for k in PHASES)) * 1000
        temporal_ms = (through["step"] - through["activity_running"]) * 1000
        console.print(
            f"  of which in the step activity, outside the phases: {in_activity_ms:.0f} ms; in Temporal between steps: "
            f"{temporal_ms:.0f} ms (activity dispatch {through['activity_queued'] * 1000:.0f} ms)"
        )
    sys.stdout.flush()  # os._exit flushes nothing
    os._exit(0)  # the Temporal SDK can crash at interpreter exit


if __name__ == "__main__":
    main()
