"""What does durability cost per step? The same GRPO step, twice:

1. a plain in-process loop: engine, reward function and trainer called directly, weights
   copied in memory (no Temporal, no Ray, no storage);
2. through ratchet: the training workflow on a Temporal dev server, a worker process, Ray
   actors, batches in the batch store, weights through Ray's object store.

Same model, data, batch and seed. The ratchet time per step is measured from the workflow
history (first `generate` scheduled to last `sync_weights` completed), so service start-up,
warm-up and evaluation are excluded. Prints one table.

    .venv/bin/python benchmarks/step_overhead.py [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ratchet.config import load_config
from ratchet.platform.assets import prepare_assets
from ratchet.platform.client import RECIPE_PATH, Client
from ratchet.platform.demo import start_worker_process, stop_worker_process
from ratchet.platform.services import ServiceSettings, down, free_ports, temporal_address, up
from ratchet.workers.local_loop import LocalLoop


def plain_loop(cfg, steps: int) -> dict[str, float]:
    """Seconds per step of the bare algorithm, phase by phase (first step excluded: it warms caches)."""
    loop = LocalLoop(cfg)
    totals = {"generate": 0.0, "score": 0.0, "train": 0.0, "sync": 0.0}
    for step in range(steps + 1):
        metrics = loop.step(step)
        if step > 0:
            for name in totals:
                totals[name] += metrics[f"{name}_seconds"]
    out = {k: v / steps for k, v in totals.items()}
    out["step"] = sum(out.values())
    return out


def ratchet_loop(overrides: list[str], steps: int, state: Path) -> dict[str, float]:
    t, ui, r = free_ports(3)
    settings = ServiceSettings(state_dir=state, temporal_port=t, temporal_ui_port=ui, ray_port=r, start_timeout_s=60)
    up(settings)
    worker = start_worker_process(settings)
    try:
        client = Client.connect(temporal_address(settings))
        handle = client.submit(RECIPE_PATH, overrides)
        summary = handle.result()
        history = handle.history()
    finally:
        stop_worker_process(worker)
        down(settings)
    first_generate, last_sync = None, None
    names = {}
    for e in history.events:
        if e.HasField("activity_task_scheduled_event_attributes"):
            names[e.event_id] = e.activity_task_scheduled_event_attributes.activity_type.name
            if names[e.event_id] == "generate" and first_generate is None:
                first_generate = e.event_time.ToDatetime()
        if e.HasField("activity_task_completed_event_attributes"):
            if names.get(e.activity_task_completed_event_attributes.scheduled_event_id) == "sync_weights":
                last_sync = e.event_time.ToDatetime()
    import json

    metrics = [json.loads(x) for x in (Path(summary.run_uri) / "metrics.jsonl").read_text().splitlines()]
    inside = {k: sum(m[f"{k}_seconds"] for m in metrics[1:]) / (steps - 1) for k in ("generate", "score", "train", "sync")}
    return {"step": (last_sync - first_generate).total_seconds() / steps, **inside}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="rt-bench-"))
    try:
        assets = prepare_assets(work / "assets", tasks=("copy",))
        train, evals = assets.data["copy"]
        overrides = [
            f"model.path={assets.model}", f"data.train_files={train}", f"data.eval_files={evals}",
            f"storage.root={work / 'runs'}", f"loop.steps={args.steps}", "loop.eval_every=0",
            "warmup.steps=0", "data.eval_size=8", "tracking.name=bench",
        ]  # fmt: skip
        cfg = load_config(RECIPE_PATH, overrides)
        plain = plain_loop(cfg, args.steps)
        through = ratchet_loop(overrides, args.steps, work / "svc")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    table = Table(title=f"seconds per GRPO step ({cfg.loop.prompts_per_step} prompts x {cfg.rollout.n} samples, {args.steps} steps)")
    table.add_column("")
    for col in ("step", "generate", "score", "train", "sync"):
        table.add_column(col, justify="right")
    table.add_row("plain loop (in-process)", *(f"{plain[k]:.3f}" for k in ("step", "generate", "score", "train", "sync")))
    table.add_row("ratchet (workflow + Ray)", *(f"{through[k]:.3f}" for k in ("step", "generate", "score", "train", "sync")))
    console = Console(width=160)
    console.print(table)
    overhead_ms = (through["step"] - plain["step"]) * 1000
    # The phases run in separate processes through ratchet, so their compute differs a little
    # from the in-process loop; the time outside every phase is orchestration alone.
    outside_ms = (through["step"] - sum(through[k] for k in ("generate", "score", "train", "sync"))) * 1000
    console.print(f"ratchet step - plain step: {overhead_ms:.0f} ms per step ({through['step'] / plain['step']:.2f}x the plain loop)")
    console.print(f"orchestration (ratchet step time outside the four phases): {outside_ms:.0f} ms per step")
    os._exit(0)  # the Temporal SDK can crash at interpreter exit


if __name__ == "__main__":
    main()
