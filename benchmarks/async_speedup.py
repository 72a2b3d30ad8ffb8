"""Does overlapping generation and training pay off? The same recipe in the three loop modes.

Part 1, real workload: the copy task with long answers, so that generating a batch and
training on it take about the same time, run for the same number of samples in `sync`,
`one_step_off` and `fully_async` mode through the whole platform (Temporal dev server,
worker process, Ray actors on their own cores), once per seed. Prints samples/s, speedup
over sync, idle fractions and the final greedy eval reward (mean and spread over seeds:
one run's final reward moves by several hundredths with its seed, in every mode).

Part 2, orchestration alone: the same workflow with activities that only sleep (generate
and train `--stage-seconds` each, score and sync instantly), served by a worker in this
process; the achieved step time is compared with the ideal (generate + train for sync,
max(generate, train) for the overlapped modes).

    .venv/bin/python benchmarks/async_speedup.py [--steps 40] [--seeds 3] [--max-staleness 2] [--sim-steps 6]
    .venv/bin/python benchmarks/async_speedup.py --smoke   # seconds: that it still runs (make test does)
"""

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ratchet.platform.assets import prepare_assets
from ratchet.platform.client import RECIPE_PATH, Client, loop_plan
from ratchet.platform.demo import start_worker_process, stop_worker_process
from ratchet.platform.services import ServiceSettings, down, free_ports, up

ROOT = Path(__file__).resolve().parents[1]

# Generation costs per decode step, training per token: 6 prompts x 8 samples with answers
# of up to 24 tokens make the two about equal on this machine (~0.25 and ~0.3 s in sync
# mode), which is where overlapping them pays most. Every mode runs the same algorithm:
# GRPO with PPO's clip over pi / mu (`bypass`: the behaviour log-probs are the old ones, so
# the trainer needs no extra forward pass), which also bounds the lag of a stale batch.
# fully_async may run two versions ahead (max_staleness 2, queue_limit 3).
PROMPTS, GROUP, DIGITS, MAX_RESPONSE = 6, 8, 20, 24
SAME_ALGORITHM = ["algorithm.off_policy.mode=bypass"]
EVAL_PROMPTS = 128
MODES = {
    "sync": ["loop.mode=sync"],
    "one_step_off": ["loop.mode=one_step_off"],
    # Partial rollouts (the default): a sync lands inside the generation in flight.
    "fully_async": ["loop.mode=fully_async", "loop.max_staleness=2", "loop.queue_limit=3"],
}


def run_stats(run_uri: str) -> dict:
    """One run's per-step averages, leaving out the first two steps (actor warm-up)."""
    lines = [json.loads(x) for x in (Path(run_uri) / "metrics.jsonl").read_text().splitlines()]
    measured = lines[2:]

    def mean(key: str) -> float:
        return sum(m[key] for m in measured) / len(measured)

    return {
        "steps": len(measured),
        "wall": sum(m["step_seconds"] for m in measured),
        **{k: mean(m) for k, m in (("generate_s", "generate_seconds"), ("train_s", "train_seconds"), ("sync_s", "sync_seconds"),
                                   ("trainer_idle", "trainer_idle_fraction"), ("rollout_idle", "rollout_idle_fraction"),
                                   ("staleness", "staleness"))},
        # Steps whose batch holds tokens of more than one version (partial rollouts).
        "spanning": sum(len([k for k in m if k.startswith("staleness_tokens/") and k[-1].isdigit()]) > 1 for m in measured)
        / len(measured),
    }  # fmt: skip


def real_workload(work: Path, steps: int, seeds: int, console: Console) -> dict[str, dict]:
    """Every mode once per seed, the modes interleaved so that a slow minute on a shared
    machine hits all of them alike. Throughput is over all seeds' steps together; the eval
    reward is the mean over seeds (one seed's final reward moves by several hundredths
    with the order in which batches happened to finish)."""
    assets = prepare_assets(work / "assets", tasks=("copy",), digits=DIGITS)
    train, evals = assets.data["copy"]
    base = [
        f"model.path={assets.model}", f"data.train_files={train}", f"data.eval_files={evals}",
        f"storage.root={work / 'runs'}", f"loop.steps={steps}", "loop.eval_every=0", f"loop.prompts_per_step={PROMPTS}",
        f"rollout.n={GROUP}", f"rollout.max_response_length={MAX_RESPONSE}", "warmup.steps=40", "algorithm.kl.coef=0",
        f"data.eval_size={EVAL_PROMPTS}", "tracking.name=speedup",
    ]  # fmt: skip
    t, ui, r = free_ports(3)
    settings = ServiceSettings(state_dir=work / "svc", temporal_port=t, temporal_ui_port=ui, ray_port=r, start_timeout_s=60)
    up(settings)
    worker = start_worker_process(settings)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        client = Client.of_services(settings)  # the key its worker holds
        for seed in range(seeds):
            for mode, extra in MODES.items():
                summary = client.submit(RECIPE_PATH, [*base, f"seed={seed}", *SAME_ALGORITHM, *extra]).result()
                stats = {**run_stats(summary.run_uri), "eval": summary.eval_rewards[str(steps)], "dropped": summary.dropped_samples}
                runs[mode].append(stats)
                console.print(f"seed {seed} {mode}: {stats['wall'] / stats['steps']:.2f} s/step, eval {stats['eval']:.3f}")
    finally:
        stop_worker_process(worker)
        down(settings)
    results = {}
    for mode, rs in runs.items():
        n_steps, wall = sum(x["steps"] for x in rs), sum(x["wall"] for x in rs)
        evals_ = [x["eval"] for x in rs]
        results[mode] = {
            "samples_per_s": PROMPTS * GROUP * n_steps / wall,
            "step_s": wall / n_steps,
            **{k: sum(x[k] * x["steps"] for x in rs) / n_steps
               for k in ("generate_s", "train_s", "sync_s", "trainer_idle", "rollout_idle", "staleness", "spanning")},
            "eval": statistics.mean(evals_),
            "eval_sd": statistics.stdev(evals_) if len(evals_) > 1 else 0.0,
            "evals": evals_,
            "dropped": sum(x["dropped"] for x in rs),
        }  # fmt: skip
    return results


def simulated(steps: int, stage_seconds: float) -> dict[str, float]:
    """Steady-state step time per mode with activities that only sleep: the stand-ins the
    workflow's own tests run it with (tests/faults/standins.py), so they answer every
    activity the workflow calls, today's and tomorrow's; generate and train hold their
    answer back `stage_seconds`, the rest answer at once."""
    sys.path.insert(0, str(ROOT))  # tests/ (the stand-ins)
    from tests.faults.standins import StandIns, dev_server, run_on, training_input

    from ratchet.config import load_config

    async def run_all() -> dict[str, float]:
        out = {}
        async with dev_server() as env:
            for mode, extra in MODES.items():
                recorded: list[float] = []
                standins = StandIns(
                    delay={"generate": stage_seconds, "train": stage_seconds},
                    answers={"record_step": lambda _: recorded.append(time.perf_counter())},
                )
                cfg = load_config(
                    RECIPE_PATH, [f"loop.steps={steps}", "data.eval_files=null", "checkpoint.every=0", *extra], check_files=False
                )
                inp = training_input(f"sim-{mode}-{time.time_ns()}", loop_plan(cfg))
                await run_on(env.client, standins, inp, limit_s=60 + 10 * steps * stage_seconds)
                # Steady state: between the first and the last step's record (the first
                # step of an overlapped mode cannot overlap anything).
                out[mode] = (recorded[-1] - recorded[0]) / (len(recorded) - 1)
        return out

    return asyncio.run(run_all())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--stage-seconds", type=float, default=2.0)
    ap.add_argument("--sim-steps", type=int, default=6)
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--seeds", type=int, default=3, help="runs per mode (seeds 0..N-1), interleaved across modes")
    ap.add_argument("--max-staleness", type=int, default=2, help="fully_async: loop.max_staleness (queue limit: one more)")
    ap.add_argument(
        "--smoke", action="store_true", help="seconds, to show the script still runs: the orchestration part only, 3 steps of 0.1 s stages"
    )
    args = ap.parse_args()
    if args.smoke:
        args.skip_real, args.sim_steps, args.stage_seconds = True, 3, 0.1
    MODES["fully_async"] = [
        "loop.mode=fully_async",
        f"loop.max_staleness={args.max_staleness}",
        f"loop.queue_limit={args.max_staleness + 1}",
    ]
    console = Console(width=200)
    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="rt-speed-"))
    try:
        real = {} if args.skip_real else real_workload(work, args.steps, args.seeds, console)
        sim = simulated(args.sim_steps, args.stage_seconds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if real:
        t = Table(title=f"real workload: {args.seeds} seeds x {args.steps} steps x {PROMPTS * GROUP} samples per mode, "
                        f"copy task with {DIGITS}-digit answers; eval on {EVAL_PROMPTS} prompts")  # fmt: skip
        cols = ("mode", "samples/s", "speedup", "s/step", "gen s", "train s", "sync s", "trainer idle", "rollout idle",
                "staleness", "spanning", "eval", "eval sd", "eval - sync", "dropped")  # fmt: skip
        for col in cols:
            t.add_column(col, justify="right")
        base = real["sync"]
        for mode, r in real.items():
            t.add_row(
                mode, f"{r['samples_per_s']:.1f}", f"{r['samples_per_s'] / base['samples_per_s']:.2f}x", f"{r['step_s']:.2f}",
                f"{r['generate_s']:.2f}", f"{r['train_s']:.2f}", f"{r['sync_s']:.3f}", f"{r['trainer_idle']:.2f}",
                f"{r['rollout_idle']:.2f}", f"{r['staleness']:.2f}", f"{r['spanning']:.2f}",
                f"{r['eval']:.3f}", f"{r['eval_sd']:.3f}", f"{r['eval'] - base['eval']:+.3f}", str(r["dropped"]),
            )  # fmt: skip
        console.print(t)
        console.print("eval reward per seed: " + "; ".join(f"{m} " + " ".join(f"{e:.3f}" for e in r["evals"]) for m, r in real.items()))
    s = args.stage_seconds
    ideal = {"sync": 2 * s, "one_step_off": s, "fully_async": s}
    t = Table(title=f"orchestration alone: generate and train sleep {s:g} s each, {args.sim_steps} steps")
    for col in ("mode", "s/step", "ideal", "over ideal"):
        t.add_column(col, justify="right")
    for mode, step in sim.items():
        t.add_row(mode, f"{step:.2f}", f"{ideal[mode]:.2f}", f"{(step / ideal[mode] - 1) * 100:+.1f}%")
    console.print(t)
    sys.stdout.flush()  # os._exit flushes nothing
    os._exit(0)  # the Temporal SDK can crash at interpreter exit


if __name__ == "__main__":
    main()
