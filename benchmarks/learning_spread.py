"""How far apart do seeds land? The spread behind every learning assertion of the suite.

A learning assertion ("the eval reward rose by more than m after N steps") must hold on
any CPU: another CPU's float kernels, or another release of a package, move a run as much
as another seed does. So each case below reruns, in-process, the run behind one such
assertion for several seeds and prints the quantity the test asserts on, per seed, with
its minimum: the test's margin must sit well outside that (its docstring says by how
much, with these numbers).

  demo       tests/e2e/test_e2e.py::test_eval_reward_beats_warmup_model: the demo recipe
             (examples/copy_grpo.yaml), greedy eval rise after 30/45/60/90 steps
             (LocalLoop gives the platform run's numbers to the digit)
  gpu-grpo   benchmarks/gpu_check.py's GRPO row on CPU: reward rise of the last 10 steps
             over the first 10, in 40 and 100 steps
  safe-rlhf  tests/unit/test_safe_rlhf_learning.py: cost, multiplier and reward over 30 steps
  pipeline   tests/e2e/test_pipeline.py: SFT eval loss, DPO margin and accuracy, RL reward
  lora-ranks tests/unit/test_lora.py::test_two_gloo_ranks_train_lora_like_one_and_reshard_checkpoints:
             2 gloo ranks against 1, adapter and merged weights after 2 updates

    .venv/bin/python benchmarks/learning_spread.py demo --seeds 0-7
    .venv/bin/python benchmarks/learning_spread.py gpu-grpo safe-rlhf --seeds 0-5
    .venv/bin/python benchmarks/learning_spread.py --smoke   # that it still runs (make test does)

One torch thread; a case takes 40-90 s a seed on one core.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/ (the cases reuse the tests' own helpers)

import torch  # noqa: E402

torch.set_num_threads(1)


def seeds_arg(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


class Assets:
    """The demo's model and copy data, built once into a private folder."""

    def __init__(self, root: Path):
        from ratchet.platform.assets import prepare_assets

        self.root = root
        self.assets = prepare_assets(root / "assets", tasks=("copy",))
        self.train, self.eval = self.assets.data["copy"]

    def overrides(self, seed: int) -> list[str]:
        return [
            f"model.path={self.assets.model}", f"data.train_files={self.train}", f"data.eval_files={self.eval}",
            f"storage.root={self.root / 'runs'}", f"seed={seed}",
        ]  # fmt: skip

    def warm(self, cfg, seed: int) -> str:
        from ratchet.storage.object_store import ObjectStore
        from ratchet.workers.warmup import warmup_policy

        return warmup_policy(cfg, cfg.model.path, ObjectStore(str(self.root / f"warm-{seed}-{time.monotonic_ns()}")).url).uri


def mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


# --------------------------------------------------------------------------- the cases


def case_demo(assets: Assets, seed: int) -> dict[str, float]:
    from ratchet.config import load_config
    from ratchet.platform.client import RECIPE_PATH
    from ratchet.workers.local_loop import LocalLoop

    cfg = load_config(RECIPE_PATH, assets.overrides(seed))
    loop = LocalLoop(cfg, policy_path=assets.warm(cfg, seed))
    out = {"eval 0": loop.evaluate()}
    for step in range(90):
        loop.step(step)
        if step + 1 in (30, 45, 60, 90):
            out[f"rise {step + 1}"] = loop.evaluate() - out["eval 0"]
    return out


def case_gpu_grpo(assets: Assets, seed: int) -> dict[str, float]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    gpu_check.prepare_interpreter(ROOT / "src")
    base_config = gpu_check.run_config
    gpu_check.run_config = lambda overrides: base_config({**overrides, "seed": seed})
    try:
        report = gpu_check.Report("spread")
        sizes = gpu_check.Sizes(("smoke",), (), 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, gpu_check.FULL.grpo_warmup_steps, 100, 1e9)
        with tempfile.TemporaryDirectory() as tmp:
            gpu_check.check_grpo(report, Path(tmp), "cpu", sizes)
    finally:
        gpu_check.run_config = base_config
    rewards = [float(x) for x in report.rows[-1].detail.rsplit("per step: ", 1)[1].split()]
    first = sum(rewards[:10]) / 10
    return {"first 10": first, "rise 40": sum(rewards[30:40]) / 10 - first, "rise 100": sum(rewards[-10:]) / 10 - first}


def case_safe_rlhf(assets: Assets, seed: int) -> dict[str, float]:
    from ratchet.config import load_config
    from ratchet.workers.local_loop import LocalLoop
    from tests.unit.test_safe_rlhf_and_filters import EXAMPLE
    from tests.unit.test_safe_rlhf_learning import SAFE, STEPS

    overrides = [*assets.overrides(seed), "data.eval_files=null"]
    cfg = load_config(EXAMPLE, overrides)
    loop = LocalLoop(load_config(EXAMPLE, [*overrides, *SAFE]), policy_path=assets.warm(cfg, seed))
    rows = [loop.step(s) for s in range(STEPS)]
    lam = [r["safe/lambda"] for r in rows]
    return {
        "cost 0": rows[0]["safe/cost_mean"], "cost last 5": mean(rows[-5:], "safe/cost_mean"),
        "violation last 10": mean(rows[-10:], "safe/cost_budget_violation"),
        "distinct lambdas": len({round(x, 6) for x in lam}), "lambda max": max(lam),
        "reward rise": mean(rows[-5:], "reward_mean") - mean(rows[:5], "reward_mean"),
    }  # fmt: skip


def case_pipeline(assets: Assets, seed: int) -> dict[str, float]:
    from types import SimpleNamespace

    from ratchet.config.pipeline_plan import rl_stage_config
    from ratchet.config.schema import RunConfig
    from ratchet.storage.object_store import ObjectStore
    from ratchet.tasks.pipeline_data import write_pipeline_data
    from ratchet.workers.local_loop import LocalLoop
    from ratchet.workers.supervised import ChunkRequest, run_chunk
    from tests.e2e.test_pipeline import DPO_STEPS, RL_STEPS, SFT_STEPS, _config

    data = write_pipeline_data(assets.root / f"pipeline-data-{seed}", train=256, held_out=64)
    # The e2e test's own cut of the example, on these assets.
    raw = _config(SimpleNamespace(assets=assets.assets, runs_root=assets.root / "runs"), data)
    raw["seed"] = seed
    cfg = RunConfig.model_validate(raw)
    store = ObjectStore(str(assets.root / "runs"))
    model = str(assets.assets.model)
    results = {}
    for index, kind, steps in ((0, "sft", SFT_STEPS), (1, "dpo", DPO_STEPS)):
        run = store.child(f"spread-{seed}-{kind}-{time.monotonic_ns()}").url
        stage, chunk = cfg.stages[index].model_dump(mode="json"), cfg.stages[index].chunk_steps
        chunks = [run_chunk(ChunkRequest(run, stage, index, model, start, start + chunk, seed=seed)) for start in range(0, steps, chunk)]
        results[kind] = (chunks[0].eval_before, chunks[-1].eval_after)
        model = chunks[-1].model_uri
    loop = LocalLoop(rl_stage_config(cfg, 2), policy_path=model)
    rl_reward = sum(loop.step(s)["reward_mean"] for s in range(RL_STEPS)) / RL_STEPS
    return {
        "sft loss drop": results["sft"][0]["loss"] - results["sft"][1]["loss"],
        "dpo margin": results["dpo"][1]["reward_margin"], "dpo accuracy": results["dpo"][1]["reward_accuracy"],
        "rl reward": rl_reward,
    }  # fmt: skip


def _two_lora_ranks(rank: int, port: int, model_path: str, out: str, seed: int) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from ratchet.workers import lora
    from ratchet.workers.policy_update import PolicyTrainer
    from tests.unit.test_lora import make_cfg, train

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        trainer = PolicyTrainer(model_path, make_cfg(model_path), rank=rank, world_size=2)
        for s in range(2):
            train(trainer, seed + s)
        merged, adapter = trainer.full_state(), lora.adapter_state(trainer.model)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in merged.items() if k != "lm_head.weight"}, f"{out}/merged.safetensors")
            save_file({k: v.contiguous() for k, v in adapter.items()}, f"{out}/adapter.safetensors")
    finally:
        dist.destroy_process_group()


def case_lora_ranks(assets: Assets, seed: int) -> dict[str, float]:
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from ratchet.workers import lora
    from ratchet.workers.policy_update import PolicyTrainer
    from ratchet.workers.runtime import free_port
    from tests.unit.test_lora import make_cfg, train

    model = str(assets.assets.model)
    trainer = PolicyTrainer(model, make_cfg(model))
    for s in range(2):
        train(trainer, seed + s)
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_two_lora_ranks, args=(free_port(), model, out, seed), nprocs=2, join=True)
        merged, adapter = load_file(f"{out}/merged.safetensors"), load_file(f"{out}/adapter.safetensors")
    one_merged, one_adapter = trainer.full_state(), lora.adapter_state(trainer.model)
    return {
        "adapter diff": max((adapter[k] - one_adapter[k]).abs().max().item() for k in adapter),
        "merged diff": max((merged[k] - one_merged[k]).abs().max().item() for k in merged),
    }


CASES = {
    "demo": case_demo,
    "gpu-grpo": case_gpu_grpo,
    "safe-rlhf": case_safe_rlhf,
    "pipeline": case_pipeline,
    "lora-ranks": case_lora_ranks,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", help=f"one or more of: {', '.join(sorted(CASES))}")
    ap.add_argument("--seeds", type=seeds_arg, default=seeds_arg("0-3"), help="e.g. 0-7 or 0,3,5")
    ap.add_argument("--smoke", action="store_true", help="seconds, to show the script still runs (make test does): lora-ranks, seed 0")
    args = ap.parse_args()
    if args.smoke:
        args.cases, args.seeds = ["lora-ranks"], [0]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown or not args.cases:
        ap.error(f"name one or more cases of {', '.join(sorted(CASES))} (not {', '.join(unknown) or 'none'})")
    from rich.console import Console
    from rich.table import Table

    from ratchet.workers.runtime import configure_worker_process

    configure_worker_process(1)  # one thread, transformers' progress bars off, as in the workers
    with tempfile.TemporaryDirectory(prefix="ratchet-spread-") as tmp:
        assets = Assets(Path(tmp))
        for name in args.cases:
            rows = []
            for seed in args.seeds:
                t0 = time.perf_counter()
                rows.append((seed, CASES[name](assets, seed), time.perf_counter() - t0))
                print(f"[{name}] seed {seed}: " + ", ".join(f"{k} {v:.4g}" for k, v in rows[-1][1].items()), flush=True)
            keys = list(rows[0][1])
            table = Table(title=f"{name}: seeds {','.join(map(str, args.seeds))} (torch {torch.__version__}, one thread)")
            table.add_column("seed")
            for k in keys:
                table.add_column(k, justify="right")
            table.add_column("s", justify="right")
            for seed, values, seconds in rows:
                table.add_row(str(seed), *[f"{values[k]:.4g}" for k in keys], f"{seconds:.0f}")
            table.add_row("min", *[f"{min(r[1][k] for r in rows):.4g}" for k in keys], "", style="bold")
            table.add_row("max", *[f"{max(r[1][k] for r in rows):.4g}" for k in keys], "", style="bold")
            Console(width=200).print(table)


if __name__ == "__main__":
    main()
