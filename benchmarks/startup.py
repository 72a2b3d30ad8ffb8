"""Start-up, phase by phase: from `Client.submit` to the first step's metrics line, with
the demo recipe (tiny model, 10 warm-up steps, an evaluation at step 0) on services and a
worker that are already up. Prints one table: each phase's seconds (from the workflow
history: each activity's run, and for the warm-up what its training took), when each of
the run's actors came up (Ray's actor table), and when the progress query first named
each phase (what `ratchet train`'s bar shows meanwhile).

    .venv/bin/python benchmarks/startup.py
    .venv/bin/python benchmarks/startup.py --before /tmp/before/src   # another source tree, side by side
    .venv/bin/python benchmarks/startup.py --smoke   # that it still runs (make test does)

`--before` runs the same benchmark first with that tree's code (a `src/` folder, say
`git archive HEAD src | tar -x -C /tmp/before`), services and worker included, then with
this tree's (or `--after`'s): one column each. Each configuration runs in a fresh process,
with services of its own; one that fails shows as `-`. Seconds on a shared 2-core machine
vary by tens of percent from one run to the next.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
RECIPE = HERE.parents[1] / "examples" / "copy_grpo.yaml"  # this checkout's, whichever tree runs


FIRST_STEP_LIMIT_S = 600.0  # a hang guard: start-up is 20-60 s here
# --smoke: the same measurement with one warm-up step and no evaluation (seconds less).
SMOKE_OVERRIDES = ["warmup.steps=1", "data.eval_files=null"]


def measure(work: Path, smoke: bool = False) -> dict[str, float]:
    """One start-up, in this process: {phase: seconds} (insertion order is the table's)."""
    from ratchet.platform.assets import prepare_assets
    from ratchet.platform.client import Client
    from ratchet.platform.demo import start_worker_process, stop_worker_process, wait_until_serving
    from ratchet.platform.payload_codec import AesGcmCodec
    from ratchet.platform.payload_key import key_file_path
    from ratchet.platform.services import ServiceSettings, down, free_ports, ray_address, ray_auth_env, up
    from ratchet.platform.worker import connect_ray

    assets = prepare_assets(work / "assets", tasks=("copy",))
    train, evals = assets.data["copy"]
    overrides = [
        f"model.path={assets.model}", f"data.train_files={train}", f"data.eval_files={evals}",
        f"storage.root={work / 'runs'}", "loop.steps=3", "tracking.name=startup", *(SMOKE_OVERRIDES if smoke else []),
    ]  # fmt: skip
    t, ui, r = free_ports(3)
    settings = ServiceSettings(state_dir=work / "svc", temporal_port=t, temporal_ui_port=ui, ray_port=r, start_timeout_s=60)
    up(settings)
    worker = start_worker_process(settings)
    try:
        wait_until_serving(settings, worker)
        connect_ray(ray_address(settings), ray_auth_env(settings))
        client = Client.of_services(settings)  # the key its worker holds
        t0 = time.time()
        handle = client.submit(RECIPE, overrides)
        submitted = time.time()
        key_file = key_file_path(settings.state_dir)
        seen = _watch_phases(handle, t0, key_file)
        metrics = work / "runs" / handle.run_id / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            if time.time() - t0 > FIRST_STEP_LIMIT_S:
                raise TimeoutError(
                    f"no step recorded {FIRST_STEP_LIMIT_S:.0f} s after the submit; the worker's log: {settings.logs_dir / 'worker.log'}"
                )
            time.sleep(0.02)
        first = time.time()
        handle.stop()
        handle.result(timeout=600)
        seen.stop()
        history = handle.history()
        alive = _actors_alive(handle.run_id)
    finally:
        import ray

        ray.shutdown()  # a driver left connected exits the process once the head is gone
        stop_worker_process(worker)
        down(settings)
    rows = {"client: validate the config, start the workflow": submitted - t0}
    rows.update(_history_rows(history, t0, first, alive, AesGcmCodec(key_file)))
    rows["total: submit to the first metrics line"] = first - t0
    for phase, at in seen.first_seen.items():
        rows[f"progress first says {phase!r} at"] = at
    return rows


class _watch_phases:
    """The progress query every 0.1 s in a thread of its own: when each phase was first named."""

    def __init__(self, handle, t0: float, key_file: Path):
        from ratchet.platform.client import Client

        self.first_seen: dict[str, float] = {}
        self._done = threading.Event()
        # A client of its own: the handle's event loop is not for two threads.
        self._client = Client.connect(handle.client._temporal.service_client.config.target_host, payload_key_file=key_file)
        self._handle = self._client.get(handle.run_id)
        self._t0 = t0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                phase = self._handle.progress().phase
            except Exception:  # noqa: BLE001 - no workflow task yet, or the run just ended
                phase = None
            if phase and phase not in self.first_seen:
                self.first_seen[phase] = time.time() - self._t0
            if phase in ("step", "generate") or len(self.first_seen) > 12:
                return  # the first step started: start-up is over
            self._done.wait(0.1)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)


def _actors_alive(run_id: str) -> dict[str, float]:
    """{actor role: the time it came up (its __init__ done)}, from Ray's actor table."""
    from ray._private import state

    out = {}
    for info in state.actors().values():
        name = info.get("Name") or ""
        if name.startswith(f"{run_id}/") and info.get("StartTime"):
            out[name.split("/", 1)[1]] = info["StartTime"] / 1000.0
    return out


def _history_rows(history, t0: float, first: float, alive: dict[str, float], codec) -> dict[str, float]:
    """`codec`: opens the history's payloads (sealed with the services' payload key)."""
    names, scheduled, started = {}, {}, {}
    rows: dict[str, float] = {}
    busy = 0.0
    for e in history.events:
        ts = e.event_time.seconds + e.event_time.nanos / 1e9
        if ts > first:
            break
        if e.HasField("activity_task_scheduled_event_attributes"):
            names[e.event_id] = e.activity_task_scheduled_event_attributes.activity_type.name
            scheduled[e.event_id] = ts
        elif e.HasField("activity_task_started_event_attributes"):
            started[e.activity_task_started_event_attributes.scheduled_event_id] = ts
        elif e.HasField("activity_task_completed_event_attributes"):
            sid = e.activity_task_completed_event_attributes.scheduled_event_id
            name = names[sid]
            label = "step-0 eval" if name == "evaluate" else ("first step" if name == "step" else name)
            rows[label] = ts - started[sid]
            busy += ts - scheduled[sid]
            if name == "warmup":
                result = json.loads(codec.open(e.activity_task_completed_event_attributes.result.payloads[0]).data)
                rows["  warm-up: its training and save"] = result["seconds"]
                rows["  warm-up: the rest (a process, imports, loading)"] = ts - started[sid] - result["seconds"]
            if name == "start_workers":
                for role, up_at in sorted(alive.items(), key=lambda kv: kv[1]):
                    rows[f"  {role} up, after the start_workers start"] = up_at - started[sid]
    rows["workflow tasks and queues between activities"] = (first - min(scheduled.values())) - busy
    return rows


def _one(work: Path, out: Path, smoke: bool) -> None:
    rows = measure(work, smoke)
    out.write_text(json.dumps(rows))
    os._exit(0)  # the Temporal SDK can crash at interpreter exit


def _run_with(src: Path | None, label: str, smoke: bool) -> dict[str, float]:
    """The benchmark in a fresh process (services included) with `src` first on the path;
    {} when it failed (its output says why)."""
    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="rt-start-"))
    out = work / "rows.json"
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    try:
        print(f"measuring {label} ...", file=sys.stderr, flush=True)
        smoke_flag = ["--smoke"] if smoke else []
        done = subprocess.run([sys.executable, str(HERE), "--one", str(work), str(out), *smoke_flag], env=env, timeout=900)
        if done.returncode != 0 or not out.exists():
            print(f"{label}: the measurement failed (exit {done.returncode})", file=sys.stderr, flush=True)
            return {}
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="a source tree (its src/ folder) to measure first, as the 'before' column")
    ap.add_argument("--after", type=Path, help="the source tree of the second column (default: this checkout's)")
    ap.add_argument("--one", nargs=2, type=Path, help=argparse.SUPPRESS)
    ap.add_argument(
        "--smoke", action="store_true", help="seconds less, to show the script still runs (make test does): one warm-up step, no evaluation"
    )
    args = ap.parse_args()
    if args.one:
        _one(*args.one, args.smoke)
    from rich.console import Console
    from rich.table import Table

    columns = {}
    if args.before:
        columns["before"] = _run_with(args.before.resolve(), "before", args.smoke)
    label = "after" if args.before else "seconds"
    columns[label] = _run_with(args.after.resolve() if args.after else None, label, args.smoke)
    phases = list(dict.fromkeys(k for rows in columns.values() for k in rows))
    table = Table(title="start-up: submit to the first step (demo recipe; services and a worker already up)")
    table.add_column("phase", overflow="fold")
    for label in columns:
        table.add_column(label, justify="right")
    for phase in phases:
        table.add_row(phase, *(f"{rows[phase]:.2f}" if phase in rows else "-" for rows in columns.values()))
    Console(width=200).print(table)
    sys.stdout.flush()  # os._exit flushes nothing
    os._exit(0 if all(columns.values()) else 1)  # a failed measurement fails the script


if __name__ == "__main__":
    main()
