"""Rule-based rewards with verl's signature:
`compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`.

The digit tasks give partial credit: the fraction of answer positions that hold the right
digit, over the longer of answer and response. A random guess scores about 0.1, an exact
answer 1.0, so GRPO gets a graded signal from the very first steps.
"""

from __future__ import annotations

import re


def digit_match_score(solution_str: str, ground_truth: str) -> float:
    response = re.sub(r"\D", "", solution_str)
    if not ground_truth:
        return float(response == "")
    hits = sum(a == b for a, b in zip(response, ground_truth))
    return hits / max(len(ground_truth), len(response))


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """Default reward of the digit tasks; any `digits/*` data source."""
    if not data_source.startswith("digits/"):
        raise ValueError(f"no rule-based reward for data_source {data_source!r}; set reward.function to your own")
    score = digit_match_score(solution_str, ground_truth)
    return {"score": score, "exact": float(re.sub(r"\D", "", solution_str) == ground_truth)}
