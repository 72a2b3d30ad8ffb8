"""Turn engine generations for a range of prompts into a `RolloutBatch`; which prompts and
which sampling seed a batch gets (the workflow's workers and the local loop alike)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ratchet.data.order import epoch_order

from .batch import RolloutBatch, SampleRow
from .engines import Engine, SamplingParams, WeightSwap
from .prompts import PromptSet

if TYPE_CHECKING:
    from .multi_turn import MultiTurnRollout


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


def generate_batch(
    engine: Engine,
    prompts: PromptSet,
    indices: list[int],
    params: SamplingParams,
    *,
    policy_version: int,
    pad_id: int,
    weight_swap: WeightSwap | None = None,
    first_position: int = 0,
    multi_turn: "MultiTurnRollout | None" = None,
) -> RolloutBatch:
    """The batch of `indices`' samples; sampled (not greedy), each prompt with its own seed
    from `params.seed` and its position in the whole batch (`first_position` for the first
    of these prompts: where this share starts when the batch is split over replicas)."""
    if not params.greedy and params.prompt_seeds is None:
        params = replace(params, prompt_seeds=prompt_seeds(params.seed, first_position, len(indices)))
    if multi_turn is not None:  # rollout.multi_turn: conversations with tool calls (workers/multi_turn.py)
        return multi_turn.generate_batch(
            engine, prompts, indices, params, policy_version=policy_version, pad_id=pad_id, weight_swap=weight_swap
        )
    groups = engine.generate([prompts.token_ids[i] for i in indices], params, version=policy_version, weight_swap=weight_swap)
    rows = [
        SampleRow(
            prompt=prompts.token_ids[idx],
            tokens=gen.token_ids,
            logprobs=gen.logprobs,
            versions=gen.versions or [policy_version] * len(gen.token_ids),
            prompt_index=idx,
            sample=prompts.sample_info(idx),
        )
        for idx, group in zip(indices, groups)
        for gen in group
    ]
    return RolloutBatch.pack(rows, pad_id)
