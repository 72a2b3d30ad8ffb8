"""Turn engine generations for a range of prompts into a `RolloutBatch` (the workflow's
workers and the local loop alike); which prompts and seeds a batch gets: batch_seeds.py."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from .batch import RolloutBatch, SampleRow
from .batch_seeds import prompt_seeds
from ratchet.workers.engines.base import Engine, SamplingParams, WeightSwap
from .prompts import PromptSet

if TYPE_CHECKING:
    from .multi_turn import MultiTurnRollout


def generate_batch(
    engine: Engine,
    prompts: PromptSet,
    indices: list[int],
    params: SamplingParams,
    *,
    policy_version: int,
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
        return multi_turn.generate_batch(engine, prompts, indices, params, policy_version=policy_version, weight_swap=weight_swap)
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
    return RolloutBatch.pack(rows)
