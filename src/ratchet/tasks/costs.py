"""Rule-based costs for Safe-RLHF (`safety.cost_function`), with the reward function's
signature: `compute_cost(data_source, solution_str, ground_truth, extra_info=None) -> float`.

The toy constraint of the digit tasks: the digit 7 is forbidden. A response that writes
one costs 1, any other 0, so the batch's mean cost is the fraction of responses that
break the rule. On the copy task about a third of the answers need a 7 (1 - 0.9^4), so
keeping the cost under a budget of, say, 0.15 trades reward away on those prompts: the
Lagrange multiplier decides how much (docs/algorithms.md, Safe-RLHF).
"""

from __future__ import annotations

FORBIDDEN_DIGIT = "7"


def compute_cost(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 when the response contains the forbidden digit, else 0.0 (any data source)."""
    return 1.0 if FORBIDDEN_DIGIT in solution_str else 0.0
