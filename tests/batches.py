"""A small scored batch for the trainer tests, CPU and GPU (tests/gpu imports it on the GPU
machine: torch and ratchet's batch type only)."""

from __future__ import annotations

import torch

from ratchet.workers.batch import RolloutBatch

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.25, 0.0])  # one per row of make_batch's 8


def make_batch(seed: int = 0, rows: int = 8, prompt_len: int = 5, response_len: int = 6, vocab: int = 96) -> RolloutBatch:
    """2 prompts x 4 samples of random tokens below `vocab`, some responses ending early,
    the second prompt left-padded."""
    g = torch.Generator().manual_seed(seed)
    response_mask = torch.ones(rows, response_len)
    for row, length in {1: 2, 3: 4, 6: 1}.items():
        response_mask[row, length:] = 0
    prompt_mask = torch.ones(rows, prompt_len, dtype=torch.long)
    prompt_mask[4:, :2] = 0  # left padding on the second prompt
    return RolloutBatch(
        prompt_ids=torch.randint(3, vocab, (rows, prompt_len), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(3, vocab, (rows, response_len), generator=g) * response_mask.long(),
        response_mask=response_mask,
        rollout_logprobs=torch.full((rows, response_len), -4.5),
        policy_version=torch.zeros(rows, response_len, dtype=torch.long),
        prompt_index=torch.tensor([0] * 4 + [1] * 4),
        samples=[{}] * rows,
    )
