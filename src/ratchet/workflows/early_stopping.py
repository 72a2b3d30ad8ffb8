"""Early-stopping rules for sweep trials, and the best trial: pure, deterministic maths
the sweep workflow runs on the metric values its activities read.

Values are oriented so that bigger is better (`oriented`: a minimised metric is negated)
before a rule compares them. Standard library only: it runs inside the workflow sandbox.

- median: stop a trial whose value at a rung is worse than the median of the values the
  *other* trials had at that rung (once `min_trials` others have reached it), as
  Optuna's MedianPruner and Vizier's median rule do.
- asha (asynchronous successive halving): a trial that reaches a rung continues only if
  its value is in the top max(1, n // eta) of the n trials that have reached the rung so
  far, itself included (Optuna's SuccessiveHalvingPruner); the first to arrive always
  continues, later ones are held to the bar the earlier ones set.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def oriented(value: float, direction: str) -> float:
    return value if direction == "max" else -value


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def median_stops(value: float, others: Sequence[float], *, direction: str = "max", min_trials: int = 1) -> bool:
    """True when `value` is strictly worse than the median of `others` (needs min_trials of them)."""
    if len(others) < min_trials or not others:
        return False
    return oriented(value, direction) < median([oriented(v, direction) for v in others])


def asha_stops(value: float, others: Sequence[float], *, eta: int, direction: str = "max") -> bool:
    """True when `value` is not in the top max(1, n // eta) of the n = len(others) + 1
    values at the rung (ties favour the trial being judged)."""
    mine = oriented(value, direction)
    n = len(others) + 1
    keep = max(1, n // eta)
    better = sum(1 for v in others if oriented(v, direction) > mine)
    return better >= keep


def should_stop(rule: str, value: float, others: Sequence[float], *, eta: int = 3, direction: str = "max", min_trials: int = 1) -> bool:
    if rule == "median":
        return median_stops(value, others, direction=direction, min_trials=min_trials)
    if rule == "asha":
        return asha_stops(value, others, eta=eta, direction=direction)
    return False


def best_index(objectives: Mapping[int, float], direction: str = "max") -> int | None:
    """The trial with the best objective (the lowest index on a tie); None when empty."""
    if not objectives:
        return None
    return min(objectives, key=lambda k: (-oriented(objectives[k], direction), k))


__all__ = ["asha_stops", "best_index", "median", "median_stops", "oriented", "should_stop"]
