"""Task generators writing parquet in verl's dataset layout.

Each row: `prompt` (chat messages), `data_source` (task name), `ability`,
`reward_model` ({"style": "rule", "ground_truth": str}) and `extra_info` ({"index": i}).
verl users can point ratchet at their own files in the same layout.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

TASKS: dict[str, Callable[[random.Random, int], tuple[str, str]]] = {}


def task(name: str):
    def apply(fn):
        TASKS[name] = fn
        return fn

    return apply


def _digits(rng: random.Random, length: int) -> list[str]:
    return [str(rng.randrange(10)) for _ in range(length)]


@task("copy")
def copy_task(rng: random.Random, length: int) -> tuple[str, str]:
    d = _digits(rng, length)
    return f"copy : {' '.join(d)}", "".join(d)


@task("reverse")
def reverse_task(rng: random.Random, length: int) -> tuple[str, str]:
    d = _digits(rng, length)
    return f"reverse : {' '.join(d)}", "".join(reversed(d))


@task("sort")
def sort_task(rng: random.Random, length: int) -> tuple[str, str]:
    d = _digits(rng, length)
    return f"sort : {' '.join(d)}", "".join(sorted(d))


@task("add")
def add_task(rng: random.Random, length: int) -> tuple[str, str]:
    a, b = rng.randrange(10**length), rng.randrange(10**length)
    return f"add : {' '.join(str(a))} + {' '.join(str(b))}", str(a + b)


def make_rows(task_name: str, count: int, *, seed: int, min_len: int, max_len: int) -> list[dict]:
    if task_name not in TASKS:
        raise ValueError(f"unknown task {task_name!r}; known: {', '.join(sorted(TASKS))}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = random.Random(f"{task_name}:{seed}")
    rows = []
    for i in range(count):
        question, answer = TASKS[task_name](rng, rng.randint(min_len, max_len))
        rows.append(
            {
                "data_source": f"digits/{task_name}",
                "prompt": [{"role": "user", "content": question}],
                "ability": "digits",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"index": i, "task": task_name},
            }
        )
    return rows


def write_task_parquet(path: str | Path, task_name: str, count: int, *, seed: int, min_len: int = 3, max_len: int = 5) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(make_rows(task_name, count, seed=seed, min_len=min_len, max_len=max_len)), path)
    return path
