"""Task generators writing parquet in verl's dataset layout.

The digit tasks (copy, reverse, sort, add) speak the tiny model's word-level vocabulary;
`arith` asks in plain English ("What is 23 + 58? Answer with the number only.") for a real
chat model (SmolLM2, `ratchet prepare --model smollm2-135m`), whose chat template turns
the message into its prompt.

Each row: `prompt` (chat messages), `data_source` (`digits/<task>`, or `arithmetic/add`), `ability`,
`reward_model` ({"style": "rule", "ground_truth": str}) and `extra_info` ({"index": i}).
verl users can point ratchet at their own files in the same layout.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

TASKS: dict[str, Callable[[random.Random, int], tuple[str, str]]] = {}
# data_source and ability of the tasks that are not digit tasks; the reward dispatches on
# the data_source (tasks/rewards.py).
TASK_SOURCES: dict[str, tuple[str, str]] = {}


def task(name: str, *, data_source: str | None = None, ability: str = "digits"):
    def apply(fn):
        TASKS[name] = fn
        if data_source is not None:
            TASK_SOURCES[name] = (data_source, ability)
        return fn

    return apply


def digit_tasks() -> tuple[str, ...]:
    """The tasks the tiny digit model can read (the demo's)."""
    return tuple(name for name in TASKS if name not in TASK_SOURCES)


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


@task("arith", data_source="arithmetic/add", ability="math")
def arith_task(rng: random.Random, length: int) -> tuple[str, str]:
    """Two numbers of `length` digits each (1: 0-9), summed; asked as a chat message."""
    low = 0 if length == 1 else 10 ** (length - 1)
    a, b = rng.randrange(low, 10**length), rng.randrange(low, 10**length)
    return f"What is {a} + {b}? Answer with the number only.", str(a + b)


def make_rows(task_name: str, count: int, *, seed: int, min_len: int, max_len: int) -> list[dict]:
    if task_name not in TASKS:
        raise ValueError(f"unknown task {task_name!r}; known: {', '.join(sorted(TASKS))}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = random.Random(f"{task_name}:{seed}")
    rows = []
    for i in range(count):
        question, answer = TASKS[task_name](rng, rng.randint(min_len, max_len))
        source, ability = TASK_SOURCES.get(task_name, (f"digits/{task_name}", "digits"))
        rows.append(
            {
                "data_source": source,
                "prompt": [{"role": "user", "content": question}],
                "ability": ability,
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
