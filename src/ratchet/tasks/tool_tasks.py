"""A toy task where a tool helps: sums for the tiny digit model, with the calculator.

Each prompt is a raw string that opens a calculator call in the `words` format
(tools/parsing.py): `add : 3 4 + 5 8`. The model's first turn completes the call (its text
up to `=` or to the end of the turn is added to the arguments); the calculator's answer
joins the conversation, and the model goes on. A policy that closes the call at once
(`=`) gets the exact sum from the tool and only has to stop; one that writes digits first
changes the expression. The reward reads the whole trajectory (observations included)
and the calls in `extra_info["tool_calls"]`.

The tiny model does not learn to use the tool in a few steps; the task is there to make
every conversation call a tool at least once, deterministically, so that the multi-turn
machinery (masks with holes, tool failures, recovery mid-conversation) is exercised
through the real workflow (tests/e2e/test_multi_turn.py, examples/copy_multi_turn_tools.yaml).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .rewards import arithmetic_score

DATA_SOURCE = "tools/add"


def tool_add_rows(count: int, *, seed: int, digits: int = 2) -> list[dict]:
    """Rows in verl's layout: a raw prompt that opens the `add` call, the sum as ground truth."""
    rng = random.Random(f"tool-add:{seed}")
    rows = []
    for i in range(count):
        a, b = rng.randrange(10**digits), rng.randrange(10**digits)
        rows.append(
            {
                "prompt": f"add : {' '.join(str(a))} + {' '.join(str(b))}",
                "data_source": DATA_SOURCE,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                # verl's per-row tool arguments: the calculator takes none, so the entry is empty.
                "extra_info": {"index": i, "tools_kwargs": {"add": {"create_kwargs": {}}}},
            }
        )
    return rows


def write_tool_add_jsonl(path: str | Path, count: int, *, seed: int, digits: int = 2) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in tool_add_rows(count, seed=seed, digits=digits)))
    return path


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """1 when the last number of the conversation (the model's turns and the tools' answers)
    is the answer, 0.5 when it appears earlier; extras: the calls made and those that failed."""
    calls = (extra_info or {}).get("tool_calls") or []
    return {
        "score": arithmetic_score(solution_str, ground_truth),
        "tool_calls": float(len(calls)),
        "tool_errors": float(sum(bool(c.get("error")) for c in calls)),
        "turns": float((extra_info or {}).get("num_turns") or 1),
    }
