"""Every algorithm on the copy task, from the same warm-up model.

Runs the in-process loop (`ratchet.workers.local_loop`, the same trainer code the Ray
workers run) for each recipe and prints one table: mean sampled reward over the ten steps
around four marks (0, a third, two thirds, the end), greedy eval reward at the end, and
wall time. With several `--seeds`, each number is the mean over seeds (every seed starts
from the same warm-up model; the seed moves the sampling, the prompt order and the value
head), and the eval of each seed is listed too: on this task one seed's eval moves by
about ±0.15, so compare recipes over three seeds or more.

    .venv/bin/python benchmarks/algorithms.py [--steps 150] [--recipes grpo,rloo,...]
    .venv/bin/python benchmarks/algorithms.py --all --steps 30   # one recipe per registered name
    .venv/bin/python benchmarks/algorithms.py --recipes grpo --seeds 0,1,2 \
        --recipe "gae-lr3e-3: algorithm.adv_estimator=gae critic.lr=3e-3"

`--recipes` takes names from RECIPES (hand-written: what a user would set for each
algorithm); `--all` adds one recipe per name registered in src/ratchet/catalog/algorithms.py
(`adv:<estimator>`, `loss:<policy loss>`, `off_policy:<mode>`), so an algorithm added
there is benchmarked without editing this file; `--recipe "LABEL: KEY=VALUE ..."` adds one
of your own. A recipe that fails (bad config, an error in its step) gets a row saying so,
and the script exits 1 after printing the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ratchet.algorithms import ADV_ESTIMATORS, OFF_POLICY, POLICY_LOSSES
from ratchet.config import load_config
from ratchet.platform.assets import prepare_assets
from ratchet.platform.client import RECIPE_PATH
from ratchet.storage.object_store import ObjectStore
from ratchet.workers.local_loop import LocalLoop
from ratchet.workers.warmup import warmup_policy

# PPO with a critic, as examples/copy_ppo_gae.yaml sets it (docs/algorithms.md, "PPO with a
# critic, and REINFORCE++, on the copy task", says why each key and what it measured).
# `--all` gives these keys to every estimator registered with needs_critic.
CRITIC_KEYS = ["algorithm.lam=1.0", "critic.lr=1e-3", "critic.warmup_steps=10"]
GAE_KEYS = ["algorithm.adv_estimator=gae", *CRITIC_KEYS]

# Per recipe, what a user would set besides the demo recipe (examples/copy_grpo.yaml: GRPO,
# ppo_clip, token-mean, k3 KL loss at 0.001).
RECIPES: dict[str, list[str]] = {
    "grpo": [],
    "grpo (Dr. GRPO)": ["algorithm.norm_adv_by_std=false"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_plus_plus": ["algorithm.adv_estimator=reinforce_plus_plus"],
    "reinforce_plus_plus_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
    "remax": ["algorithm.adv_estimator=remax"],
    "gae (PPO + critic)": GAE_KEYS,
}

# `--all`: keys a registered policy loss needs besides its name (its paper's settings);
# a loss not listed runs with the PPO defaults (clip 0.2, token-mean).
LOSS_KEYS: dict[str, list[str]] = {
    "gspo": ["algorithm.clip_ratio_low=3e-4", "algorithm.clip_ratio_high=4e-4", "algorithm.loss_agg_mode=seq-mean-token-mean"],
}


def catalog_recipes() -> dict[str, list[str]]:
    """One recipe per registered advantage estimator, policy loss and off-policy mode."""
    out: dict[str, list[str]] = {}
    for name in ADV_ESTIMATORS.names():
        critic = CRITIC_KEYS if ADV_ESTIMATORS.get(name).needs_critic else []
        out[f"adv:{name}"] = [f"algorithm.adv_estimator={name}", *critic]
    for name in POLICY_LOSSES.names():
        out[f"loss:{name}"] = [f"algorithm.policy_loss={name}", *LOSS_KEYS.get(name, [])]
    for name in OFF_POLICY.names():
        out[f"off_policy:{name}"] = [f"algorithm.off_policy.mode={name}"]
    return out


@dataclass
class Row:
    recipe: str
    overrides: list[str]
    rewards: list[float] = field(default_factory=list)  # the windows at the marks, mean over seeds
    evals: list[float] = field(default_factory=list)  # greedy eval per seed
    wall_s: float = 0.0
    error: str | None = None

    @property
    def eval_mean(self) -> float:
        return sum(self.evals) / len(self.evals)


def window_mean(xs: list[float], at: int) -> float:
    lo = max(0, min(at, len(xs) - 10))
    part = xs[lo : lo + 10]
    return sum(part) / len(part)


def marks(steps: int) -> list[int]:
    return sorted({0, steps // 3, 2 * steps // 3, steps})


def run_recipe(name: str, overrides: list[str], base: list[str], warm: str, steps: int, seeds: list[int], console: Console) -> Row:
    row = Row(name, overrides)
    per_seed = []
    t0 = time.perf_counter()
    try:
        for seed in seeds:
            cfg = load_config(RECIPE_PATH, [*base, *overrides, f"seed={seed}"])
            loop = LocalLoop(cfg, policy_path=warm)
            rewards = [loop.step(s)["reward_mean"] for s in range(steps)]
            row.evals.append(loop.evaluate())
            per_seed.append([window_mean(rewards, m) for m in marks(steps)])
    except Exception as e:  # noqa: BLE001 - one broken recipe must not hide the others' rows
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120]
    row.wall_s = time.perf_counter() - t0
    if per_seed and row.error is None:
        row.rewards = [sum(col) / len(col) for col in zip(*per_seed)]
    console.print(f"{name}: {'FAILED ' + row.error if row.error else 'done'} in {row.wall_s:.0f} s")
    return row


def table_of(rows: list[Row], steps: int, seeds: list[int]) -> Table:
    title = f"copy task, {steps} steps from the same warm-up model"
    title += f", mean over seeds {','.join(map(str, seeds))}" if len(seeds) > 1 else f", seed {seeds[0]}"
    table = Table(title=title)
    table.add_column("recipe", justify="left")
    for m in marks(steps):
        table.add_column(f"reward@{m}", justify="right")
    table.add_column("eval (greedy)", justify="right")
    if len(seeds) > 1:
        table.add_column("eval per seed", justify="right")
    table.add_column("wall s", justify="right")
    for r in rows:
        if r.error:
            cells = [r.error, *[""] * (len(marks(steps)) - 1 + (len(seeds) > 1))]
        else:
            cells = [*(f"{x:.3f}" for x in r.rewards), f"{r.eval_mean:.3f}"]
            if len(seeds) > 1:
                cells.append(" ".join(f"{e:.3f}" for e in r.evals))
        table.add_row(r.recipe, *cells, f"{r.wall_s:.0f}")
    return table


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--recipes", default=None, help="comma-separated names from RECIPES (default: all of them, unless --all or --recipe)")
    ap.add_argument("--estimators", dest="recipes", help=argparse.SUPPRESS)  # the old name of --recipes
    ap.add_argument("--all", action="store_true", help="also one recipe per registered estimator, policy loss and off-policy mode")
    ap.add_argument(
        "--recipe", dest="adhoc", action="append", default=[], metavar="'LABEL: KEY=VALUE ...'", help="a recipe of your own (repeatable)"
    )
    ap.add_argument("--seeds", default="0", help="comma-separated run seeds (default 0)")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE", help="override for every recipe (repeatable)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    known = {**RECIPES, **catalog_recipes()}
    if args.recipes is not None:
        names = [n for n in args.recipes.split(",") if n]
    else:
        names = [] if args.all or args.adhoc else list(RECIPES)
    if args.all:
        names += [n for n in catalog_recipes() if n not in names]
    for spec in args.adhoc:
        label, _, keys = spec.partition(":")
        known[label.strip()] = keys.split()
        names.append(label.strip())
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown recipe(s) {', '.join(unknown)}; known: {', '.join(known)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    work = Path(tempfile.mkdtemp(prefix="rt-alg-"))
    console = Console(width=200)
    rows: list[Row] = []
    try:
        assets = prepare_assets(work / "assets", tasks=("copy",))
        train, evals = assets.data["copy"]
        base = [
            f"model.path={assets.model}", f"data.train_files={train}", f"data.eval_files={evals}",
            f"storage.root={work / 'runs'}", f"loop.steps={args.steps}", *args.extra,
        ]  # fmt: skip
        cfg = load_config(RECIPE_PATH, base)
        warm = warmup_policy(cfg, cfg.model.path, ObjectStore(str(work / "warm")).url).uri
        for name in names:
            rows.append(run_recipe(name, known[name], base, warm, args.steps, seeds, console))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    console.print(table_of(rows, args.steps, seeds))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    sys.exit(1 if any(r.error for r in main()) else 0)
