"""Turn engine generations for a range of prompts into a `RolloutBatch`; which prompts and
which sampling seed a batch gets (the workflow's workers and the local loop alike)."""

from __future__ import annotations

import torch

from .batch import RolloutBatch
from .engines import Engine, SamplingParams, WeightSwap
from .prompts import PromptSet


def prompt_indices(start: int, count: int, total: int) -> list[int]:
    """The prompt frontier advances by `count` per step and wraps around the dataset (epochs)."""
    return [(start + i) % total for i in range(count)]


def sampling_seed(seed: int, batch_index: int, part: int = 0) -> int:
    """The sampling seed of rollout round `part` of batch `batch_index` in a run seeded
    `seed`: a retried rollout samples the same, and the local loop samples what the
    workflow does. config/schema.py bounds the three so that it stays below 2**63 and
    distinct per (batch, part)."""
    return (seed * 1_000_003 + batch_index) * 101 + part


def generate_batch(
    engine: Engine,
    prompts: PromptSet,
    indices: list[int],
    params: SamplingParams,
    *,
    policy_version: int,
    pad_id: int,
    weight_swap: WeightSwap | None = None,
) -> RolloutBatch:
    groups = engine.generate([prompts.token_ids[i] for i in indices], params, version=policy_version, weight_swap=weight_swap)
    rows = [(idx, gen) for idx, group in zip(indices, groups) for gen in group]
    prompt_w = max(len(prompts.token_ids[i]) for i in indices)
    resp_w = max(1, max(len(g.token_ids) for _, g in rows))
    b = len(rows)
    prompt_ids = torch.full((b, prompt_w), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((b, prompt_w), dtype=torch.long)
    response_ids = torch.full((b, resp_w), pad_id, dtype=torch.long)
    response_mask = torch.zeros((b, resp_w), dtype=torch.float32)
    logprobs = torch.zeros((b, resp_w), dtype=torch.float32)
    versions = torch.zeros((b, resp_w), dtype=torch.long)
    for r, (idx, gen) in enumerate(rows):
        p = prompts.token_ids[idx]
        prompt_ids[r, prompt_w - len(p) :] = torch.tensor(p)
        prompt_mask[r, prompt_w - len(p) :] = 1
        k = len(gen.token_ids)
        if k:
            response_ids[r, :k] = torch.tensor(gen.token_ids)
            response_mask[r, :k] = 1.0
            logprobs[r, :k] = torch.tensor(gen.logprobs)
            versions[r, :k] = torch.tensor(gen.versions) if gen.versions else policy_version
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        rollout_logprobs=logprobs,
        policy_version=versions,
        prompt_index=torch.tensor([idx for idx, _ in rows], dtype=torch.long),
        samples=[prompts.sample_info(idx) for idx, _ in rows],
    )
