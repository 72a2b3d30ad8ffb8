"""The order a run draws its training prompts in: epoch after epoch, each a fresh
permutation of the dataset derived from (data seed, epoch) only.

The workflow keeps one durable counter, the prompt frontier (`RunState.next_prompt`): how
many prompt positions have been handed out. Position p is row `epoch_order(seed, p //
rows, rows)[p % rows]` (workers/batch_seeds.prompt_indices), so the order is the same
on every machine, after every resume and retry, and the local loop draws what the
workflow does; nothing about the order is stored.

The permutation is a Fisher-Yates shuffle driven by `random.Random.random()` from an
integer seed: of the `random` module, only that seeding and `random()` are promised to
give the same numbers on every Python version (`random.shuffle` is not), and a run resumed
under a newer Python must continue the same order.
"""

from __future__ import annotations

import hashlib
import random
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ratchet.config.schema import RunConfig


def data_order_seed(cfg: RunConfig) -> int | None:
    """The seed of the training prompts' order, or None for file order (`data.shuffle=false`);
    `data.seed` defaults to the run's `seed`."""
    if not cfg.data.shuffle:
        return None
    return cfg.data.seed if cfg.data.seed is not None else cfg.seed


@lru_cache(maxsize=8)
def epoch_order(seed: int, epoch: int, rows: int) -> tuple[int, ...]:
    """Epoch `epoch`'s permutation of range(rows). Cached: a step looks up a few positions,
    and a dataset of a million rows takes about half a second to shuffle."""
    digest = hashlib.sha256(f"ratchet-data-order:{seed}:{epoch}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    order = list(range(rows))
    for i in range(rows - 1, 0, -1):
        j = int(rng.random() * (i + 1))
        order[i], order[j] = order[j], order[i]
    return tuple(order)
