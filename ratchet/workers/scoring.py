"""Apply a verl-signature reward function to a batch's decoded responses."""

from __future__ import annotations

from typing import Callable

import torch

from .batch import RolloutBatch


def score_batch(batch: RolloutBatch, tokenizer, reward_fn: Callable) -> tuple[torch.Tensor, list[dict]]:
    """Rewards [B] and, per sample, the extra numbers a dict-returning function gave."""
    rewards, extras = [], []
    for row, info in enumerate(batch.samples):
        n = int(batch.response_mask[row].sum().item())
        text = tokenizer.decode(batch.response_ids[row, :n].tolist(), skip_special_tokens=True)
        out = reward_fn(
            data_source=info["data_source"], solution_str=text, ground_truth=info["ground_truth"], extra_info=info["extra_info"]
        )
        if isinstance(out, dict):
            if "score" not in out:
                raise ValueError(f"reward function returned a dict without 'score': {sorted(out)}")
            rewards.append(float(out["score"]))
            extras.append({k: float(v) for k, v in out.items() if k != "score" and isinstance(v, (int, float))})
        else:
            rewards.append(float(out))
            extras.append({})
    return torch.tensor(rewards, dtype=torch.float32), extras
