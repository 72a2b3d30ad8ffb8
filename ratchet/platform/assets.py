"""`ratchet prepare`: the demo's model and data, built by code (no downloads)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ratchet.models.tiny import build_tiny_model
from ratchet.tasks.generate import TASKS, write_task_parquet


@dataclass
class DemoAssets:
    model: Path
    data: dict[str, tuple[Path, Path]]  # task -> (train, eval)


def prepare_assets(out_dir: str | Path, *, tasks: tuple[str, ...] = tuple(TASKS), digits: int = 4, seed: int = 0) -> DemoAssets:
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
    return DemoAssets(model=model, data=data)
