"""A digit task's questions as supervised data for pipeline stages (docs/pipelines.md):
SFT conversations (`messages`: the question, then the right answer) and preference pairs
(`prompt`, `chosen`: the right answer, `rejected`: a near miss), in TRL's conversational
layout, which the tiny model's chat template renders.

A near miss is the right answer with one digit changed, one dropped, or two swapped (the
copy task's typical mistakes), so a preference stage teaches exactly what RL rewards.
"""

from __future__ import annotations

import random
from pathlib import Path

from .generate import TASKS


def _near_miss(rng: random.Random, answer: str) -> str:
    digits = list(answer)
    for _ in range(10):
        kind = rng.randrange(3)
        out = list(digits)
        i = rng.randrange(len(out))
        if kind == 0:
            out[i] = str((int(out[i]) + rng.randrange(1, 10)) % 10)
        elif kind == 1 and len(out) > 1:
            del out[i]
        elif len(out) > 1:
            j = (i + 1) % len(out)
            out[i], out[j] = out[j], out[i]
        if out != digits:
            return "".join(out)
    return answer + "0"


def _questions(task: str, count: int, seed: int, min_len: int, max_len: int) -> list[tuple[str, str]]:
    rng = random.Random(f"{task}:{seed}:supervised")
    return [TASKS[task](rng, rng.randint(min_len, max_len)) for _ in range(count)]


def sft_rows(task: str, count: int, *, seed: int, min_len: int = 3, max_len: int = 5) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in _questions(task, count, seed, min_len, max_len)
    ]


def preference_rows(task: str, count: int, *, seed: int, min_len: int = 3, max_len: int = 5) -> list[dict]:
    rng = random.Random(f"{task}:{seed}:rejected")
    return [
        {
            "prompt": [{"role": "user", "content": q}],
            "chosen": [{"role": "assistant", "content": a}],
            "rejected": [{"role": "assistant", "content": _near_miss(rng, a)}],
        }
        for q, a in _questions(task, count, seed, min_len, max_len)
    ]


def write_rows(path: str | Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_pipeline_data(
    folder: str | Path, task: str = "copy", *, train: int = 512, held_out: int = 64, seed: int = 0, digits: int = 4
) -> dict[str, Path]:
    """sft.parquet, sft_eval.parquet, prefs.parquet, prefs_eval.parquet under `folder`
    (held-out rows from other seeds than the training rows), questions of `digits` digits
    like the demo's RL data."""
    folder = Path(folder)
    n = {"min_len": digits, "max_len": digits}
    return {
        "sft": write_rows(folder / "sft.parquet", sft_rows(task, train, seed=seed, **n)),
        "sft_eval": write_rows(folder / "sft_eval.parquet", sft_rows(task, held_out, seed=seed + 1000, **n)),
        "prefs": write_rows(folder / "prefs.parquet", preference_rows(task, train, seed=seed + 1, **n)),
        "prefs_eval": write_rows(folder / "prefs_eval.parquet", preference_rows(task, held_out, seed=seed + 1001, **n)),
    }


if __name__ == "__main__":  # python -m ratchet.tasks.pipeline_data FOLDER: examples/copy_pipeline.yaml's data
    import sys

    for name, path in write_pipeline_data(sys.argv[1] if len(sys.argv) > 1 else ".ratchet/assets/copy-pipeline").items():
        print(f"{name}: {path}")
