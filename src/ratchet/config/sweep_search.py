"""Grid and random points of a sweep's search space, from the spec and the seed alone.

Pure functions of (space, seed, trial index): the client computes every trial's values to
validate them before the sweep starts, and the worker's activity computes the same values
again for trial k whenever it is asked (a retry or a replay gets the same answer without
reading any state). A space maps dotted keys to `ParamSpace`s (src/ratchet/config/sweep_spec.py),
read here by attribute only, so this module imports nothing of ratchet.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping
from typing import Any


def axis(p: Any) -> list[Any]:
    """The grid points of one parameter: its choices, every int of an int range (or `num`
    of them), or `num` points of a float range (log-spaced when `log`), bounds included."""
    if p.values is not None:
        return list(p.values)
    lo, hi = float(p.low), float(p.high)
    if p.type == "int" and p.num is None:
        return list(range(int(lo), int(hi) + 1))
    n = int(p.num)
    if n == 1:
        points = [lo]
    elif p.log:
        a, b = math.log(lo), math.log(hi)
        points = [math.exp(a + (b - a) * i / (n - 1)) for i in range(n)]
        points[0], points[-1] = lo, hi  # exact bounds, not exp(log(x))
    else:
        points = [lo + (hi - lo) * i / (n - 1) for i in range(n)]
        points[-1] = hi
    if p.type == "int":
        return sorted({int(round(x)) for x in points})
    return points


def grid_size(space: Mapping[str, Any]) -> int:
    return math.prod(len(axis(p)) for p in space.values())


def grid_points(space: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every combination, the first key varying slowest (itertools.product's order)."""
    keys = list(space)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(axis(space[k]) for k in keys))]


def random_point(space: Mapping[str, Any], seed: int, index: int) -> dict[str, Any]:
    """Trial `index`'s draw: uniform over choices and ranges (log-uniform when `log`),
    from a generator seeded by (seed, index) alone, so trial k never depends on the others."""
    rng = random.Random(f"ratchet-sweep:{seed}:{index}")
    out: dict[str, Any] = {}
    for key, p in space.items():
        if p.values is not None:
            out[key] = p.values[rng.randrange(len(p.values))]
            continue
        lo, hi = float(p.low), float(p.high)
        if p.log:
            x = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        else:
            x = rng.uniform(lo, hi)
        if p.type == "int":
            # Each integer equally likely (log: by its share of the log range).
            x = int(math.floor(x)) if p.log else rng.randint(int(lo), int(hi))
            x = min(max(x, int(lo)), int(hi))
        else:
            x = min(max(x, lo), hi)
        out[key] = x
    return out


__all__ = ["axis", "grid_points", "grid_size", "random_point"]
