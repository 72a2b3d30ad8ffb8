"""Every advantage estimator on the copy task, from the same warm-up model.

Runs the in-process loop (`ratchet.workers.local_loop`, the same trainer code the Ray
workers run) for each estimator and prints one table: mean sampled reward over the ten
steps around steps 0, 50, 100 and 150, greedy eval reward at the end, and wall time.

    .venv/bin/python benchmarks/algorithms.py [--steps 150] [--estimators grpo,rloo,...]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ratchet.config import load_config
from ratchet.platform.assets import prepare_assets
from ratchet.platform.client import RECIPE_PATH
from ratchet.storage import ObjectStore
from ratchet.workers.local_loop import LocalLoop
from ratchet.workers.warmup import warmup_policy

# Per estimator, what a user would set besides the estimator itself.
RECIPES = {
    "grpo": [],
    "grpo (Dr. GRPO)": ["algorithm.norm_adv_by_std=false"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_plus_plus": ["algorithm.adv_estimator=reinforce_plus_plus"],
    "reinforce_plus_plus_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
    "remax": ["algorithm.adv_estimator=remax"],
    "gae (PPO + critic)": ["algorithm.adv_estimator=gae", "algorithm.lam=0.95", "critic.lr=1e-3"],
}


def window_mean(xs: list[float], at: int) -> float:
    lo = max(0, min(at, len(xs) - 10))
    part = xs[lo : lo + 10]
    return sum(part) / len(part)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--estimators", default=",".join(RECIPES), help="comma-separated names from the table")
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="rt-alg-"))
    console = Console(width=160)
    table = Table(title=f"copy task, {args.steps} steps from the same warm-up model")
    for col in ("estimator", "reward@0", "reward@50", "reward@100", f"reward@{args.steps}", "eval (greedy)", "wall s"):
        table.add_column(col, justify="right")
    try:
        assets = prepare_assets(work / "assets", tasks=("copy",))
        train, evals = assets.data["copy"]
        base = [
            f"model.path={assets.model}", f"data.train_files={train}", f"data.eval_files={evals}",
            f"storage.root={work / 'runs'}", f"loop.steps={args.steps}",
        ]  # fmt: skip
        cfg = load_config(RECIPE_PATH, base)
        warm = warmup_policy(cfg, cfg.model.path, ObjectStore(str(work / "warm")).url).uri
        for name in args.estimators.split(","):
            cfg = load_config(RECIPE_PATH, [*base, *RECIPES[name]])
            t0 = time.perf_counter()
            loop = LocalLoop(cfg, policy_path=warm)
            rewards = [loop.step(s)["reward_mean"] for s in range(args.steps)]
            eval_reward = loop.evaluate()
            wall = time.perf_counter() - t0
            marks = [0, 50, 100, args.steps]
            table.add_row(name, *(f"{window_mean(rewards, m):.3f}" for m in marks), f"{eval_reward:.3f}", f"{wall:.0f}")
            console.print(f"{name}: done in {wall:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    console.print(table)


if __name__ == "__main__":
    main()
