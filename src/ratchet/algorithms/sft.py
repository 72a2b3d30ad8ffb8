"""Supervised fine-tuning loss: token cross-entropy over the assistant tokens only. Pure torch.

verl's SFT trainer (verl/trainer/fsdp_sft_trainer.py, `_compute_loss_and_backward`)
sums the per-token negative log-likelihood over the loss mask and divides by the number of
loss tokens in the whole batch (across micro-batches and data-parallel ranks), so every
assistant token weighs the same whatever the length of its conversation. `normaliser` is
that global count; micro-batches that each pass it add up to the batch's token mean.
"""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] log-prob of each token given the ones before it; position 0 (no context) is 0.
    Computed in float32 whatever the logits' dtype."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, normaliser: float | int | None = None) -> torch.Tensor:
    """Masked negative log-likelihood, summed and divided by `normaliser` (default: this
    batch's loss tokens). A mask with no token gives 0 (with a gradient of 0), not NaN."""
    mask = loss_mask.to(logprobs.dtype)
    total = -(logprobs * mask).sum()
    n = float(mask.sum()) if normaliser is None else float(normaliser)
    return total / max(n, 1.0)


def sequence_logprobs(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] summed log-prob of the masked tokens, [B] their count): a completion's
    log-likelihood for preference losses (the mask may have holes)."""
    mask = loss_mask.to(logprobs.dtype)
    return (logprobs * mask).sum(-1), loss_mask.sum(-1)
