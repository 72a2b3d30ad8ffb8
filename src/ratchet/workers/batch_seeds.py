"""Which prompts and which sampling seeds a rollout batch gets: functions of the run's seed
and the batch's place alone, so that a retried batch, a resumed run, a batch split over
replicas and the local loop all draw the same."""

from __future__ import annotations

from ratchet.data.order import epoch_order


def prompt_indices(start: int, count: int, total: int, order_seed: int | None = None) -> list[int]:
    """The dataset rows at prompt positions start .. start + count - 1. The prompt frontier
    advances by `count` per step; position p is in epoch p // total, which draws the rows in
    the permutation `data/order.epoch_order(order_seed, epoch)` (file order when
    `order_seed` is None: `data.shuffle=false`; `data/order.data_order_seed` gives the seed).
    A function of the position only, so retries, resumes and the local loop agree.

    A batch that spans two epochs may draw a row twice; its samples then form one larger
    group (the same prompt under the same policy, so a group baseline stays unbiased)."""
    rows = []
    for position in range(start, start + count):
        epoch, at = divmod(position, total)
        rows.append(at if order_seed is None else epoch_order(order_seed, epoch, total)[at])
    return rows


def sampling_seed(seed: int, batch_index: int, part: int = 0) -> int:
    """The sampling seed of rollout round `part` of batch `batch_index` in a run seeded
    `seed`: a retried rollout samples the same, and the local loop samples what the
    workflow does. config/schema.py bounds the three so that it stays below 2**63 and
    distinct per (batch, part)."""
    return (seed * 1_000_003 + batch_index) * 101 + part


def prompt_seeds(batch_seed: int, first_position: int, count: int) -> tuple[int, ...]:
    """The seeds of the prompts at positions `first_position` .. `+ count - 1` of a batch
    seeded `batch_seed`: a prompt's seed depends on its place in the whole batch, not on
    which engine replica generates it or with which other prompts (rollout_pool.py splits
    a batch over replicas). Mixed by numpy's SeedSequence, so neighbouring seeds do not
    give correlated streams; below 2**63 (torch.manual_seed's range)."""
    import numpy as np

    return tuple(
        int(np.random.SeedSequence([batch_seed, first_position + i]).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))
        for i in range(count)
    )
