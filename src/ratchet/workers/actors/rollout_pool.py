"""A batch's prompts split over a run's rollout replicas by load (whole prompts, so a GRPO
group's n samples always come from one replica), and the load each replica carries: the
plain part of the rollout group (rollout_group.py), which sends the shares, redoes a lost
replica's share on the healthy ones and stores them as the one batch a single replica
would have written.

Why the batch does not depend on the split: each prompt is sampled with a seed from the
batch's seed and its position in the batch (batch_seeds.prompt_seeds), and the shares
are joined in position order (`RolloutWorker.save_shares`), so 1, 2 or N replicas store the
same rows with the same tokens (log-probs equal up to float rounding of different batch
shapes, ~1e-6 on CPU).

Load: the prompts this process has sent to each replica and not yet got back (one Temporal
worker process runs every activity of its runs, so the async loops' overlapping generations
see each other); a new batch fills the least loaded replicas first.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_load_lock = threading.Lock()
_in_flight: Counter[str] = Counter()  # prompts sent to each replica (by actor name), not yet back


@dataclass(frozen=True)
class Share:
    """Prompts `prompt_start` .. `+ prompt_count - 1` (dataset order, wrapping), at
    `position` .. of the batch, for replica `replica`."""

    replica: int
    prompt_start: int
    prompt_count: int
    position: int


def split_by_load(count: int, loads: list[int]) -> list[int]:
    """How many of `count` prompts each replica gets so that the most loaded ends as
    little loaded as possible (water filling; ties to the lower rank)."""
    shares = [0] * len(loads)
    for _ in range(count):
        i = min(range(len(loads)), key=lambda k: (loads[k] + shares[k], k))
        shares[i] += 1
    return shares


def plan_shares(prompt_start: int, prompt_count: int, position: int, replicas: list[int], loads: list[int]) -> list[Share]:
    """Contiguous shares of the prompts at `position` .. (from dataset index `prompt_start`)
    over `replicas` (ranks), sized by `split_by_load`, in rank order; empty ones left out."""
    out, offset = [], 0
    for rank, count in zip(replicas, split_by_load(prompt_count, loads)):
        if count:
            out.append(Share(rank, prompt_start + offset, count, position + offset))
            offset += count
    return out


def loads(names: list[str]) -> list[int]:
    """The prompts in flight on each replica (by actor name)."""
    with _load_lock:
        return [_in_flight.get(name, 0) for name in names]


@contextmanager
def counted(names: dict[int, str], shares: list[Share]) -> Iterator[None]:
    """`shares` count as in flight on their replicas (`names`: rank -> actor name) while the body runs."""
    with _load_lock:
        for s in shares:
            _in_flight[names[s.replica]] += s.prompt_count
    try:
        yield
    finally:
        with _load_lock:
            for s in shares:
                _in_flight[names[s.replica]] -= s.prompt_count
                if _in_flight[names[s.replica]] <= 0:
                    del _in_flight[names[s.replica]]


def prefetch_shares(
    replicas: list, batch_index: int, prompt_start: int, prompt_count: int, policy_version: int, *, part: int = 0,
    exact: bool = False,
) -> None:  # fmt: skip
    """Start generating a batch on `replicas` (in rank order, none busy: sync mode between
    two steps) without waiting: each keeps its share for the request that asks for it
    (`RolloutWorker.prefetch_share`). Split as `generate_shares` splits it with no load, so
    the request finds the same shares; a different split just generates anew."""
    ranks = list(range(len(replicas)))
    for s in plan_shares(prompt_start, prompt_count, 0, ranks, [0] * len(ranks)):
        replicas[s.replica].prefetch_share.remote(batch_index, s.prompt_start, s.prompt_count, policy_version, part, exact, s.position)
