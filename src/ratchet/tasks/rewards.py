"""Rule-based rewards with verl's signature:
`compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`.

The digit tasks give partial credit: the fraction of answer positions that hold the right
digit, over the longer of answer and response. A random guess scores about 0.1, an exact
answer 1.0, so GRPO gets a graded signal from the very first steps.

The arithmetic task (`arithmetic/add`) reads a chat model's free text: the answer is the
last number in the response (a model that works it out, "23 + 58 = 81", is right), and the
right number anywhere else earns half, so early, chatty samples still rank.
"""

from __future__ import annotations

import re


def digit_match_score(solution_str: str, ground_truth: str) -> float:
    response = re.sub(r"\D", "", solution_str)
    if not ground_truth:
        return float(response == "")
    hits = sum(a == b for a, b in zip(response, ground_truth))
    return hits / max(len(ground_truth), len(response))


_NUMBER = re.compile(r"-?\d+")


def arithmetic_score(solution_str: str, ground_truth: str) -> float:
    """1 when the last number in the response is the answer, 0.5 when the answer appears
    before it, else 0. Thousands separators are ignored ("1,024" reads 1024)."""
    numbers = _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", solution_str))
    if numbers and numbers[-1] == ground_truth:
        return 1.0
    return 0.5 if ground_truth in numbers else 0.0


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """Default reward of the generated tasks: `digits/*` and `arithmetic/*` data sources."""
    if data_source.startswith("arithmetic/"):
        score = arithmetic_score(solution_str, ground_truth)
        return {"score": score, "exact": float(score == 1.0)}
    if not data_source.startswith("digits/"):
        raise ValueError(f"no rule-based reward for data_source {data_source!r}; set reward.function to your own")
    score = digit_match_score(solution_str, ground_truth)
    return {"score": score, "exact": float(re.sub(r"\D", "", solution_str) == ground_truth)}
