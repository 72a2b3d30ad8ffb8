"""What an actor's start costs in CPU, with its start-up run without Python's cyclic
collector (src/ratchet/start_up_gc.py, as every actor does) and with the collector on.

Each start runs in a fresh process (as a Ray actor's does): the worker class is imported,
then timed from its constructor to the end of its start (a trainer rank's `setup`
included: the policy loaded and wrapped). Same model, data and config both ways; the
median of `--repeats` processes per cell. Prints one table.

    .venv/bin/python benchmarks/actor_start.py [--repeats 3]
    .venv/bin/python benchmarks/actor_start.py --smoke   # seconds: that it still runs (make test does)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

# One start, in a process of its own: argv = kind, model, train file, run folder, "paused" or "on".
START = """
import contextlib, json, os, resource, sys
os.environ.setdefault("OMP_NUM_THREADS", "1")
import ratchet.start_up_gc as start_up_gc
if sys.argv[5] == "on":
    start_up_gc.start_up = contextlib.nullcontext  # what every actor did before
from ratchet.config import load_config
from ratchet.platform.client import RECIPE_PATH
from ratchet.workers.reward import RewardWorker
from ratchet.workers.rollout import RolloutWorker
from ratchet.workers.trainer import TrainerWorker

kind, model, train, run = sys.argv[1:5]
cfg = load_config(RECIPE_PATH, [f"model.path={model}", f"data.train_files={train}", "data.eval_files=null", f"storage.root={run}"])
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
t0 = cpu()
if kind == "trainer rank":
    TrainerWorker(cfg, model, run, 0, 1).setup(29511)
elif kind == "rollout replica":
    RolloutWorker(cfg, model, run)
else:
    RewardWorker(cfg, model, run)
print(json.dumps({"cpu_s": cpu() - t0}))
"""
KINDS = ("trainer rank", "rollout replica", "reward worker")


def start_cpu(kind: str, model: Path, train: Path, run: Path, gc: str) -> float:
    out = subprocess.run([sys.executable, "-c", START, kind, str(model), str(train), str(run), gc], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{kind} ({gc}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["cpu_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="one start of the lightest kind each way (seconds)")
    args = parser.parse_args()
    from ratchet.platform.assets import prepare_assets

    kinds, repeats = (KINDS[2:], 1) if args.smoke else (KINDS, args.repeats)  # the lightest start
    with tempfile.TemporaryDirectory(prefix="ratchet-actor-start-") as tmp:
        assets = prepare_assets(Path(tmp) / "assets", tasks=("copy",))
        train, _ = assets.data["copy"]
        table = Table(title=f"actor start, CPU-s (median of {repeats} processes)")
        for column in ("actor", "start-up without the collector", "with the collector on", "saved"):
            table.add_column(column, justify="left" if column == "actor" else "right")
        for kind in kinds:
            cells = {
                gc: statistics.median(start_cpu(kind, Path(assets.model), Path(train), Path(tmp) / "run", gc) for _ in range(repeats))
                for gc in ("paused", "on")
            }
            table.add_row(kind, f"{cells['paused']:.2f}", f"{cells['on']:.2f}", f"{cells['on'] - cells['paused']:.2f}")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
