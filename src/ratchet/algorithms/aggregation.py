"""Loss aggregation: how a [batch, tokens] matrix of per-token losses becomes one number.

Every mode divides by a *global* normaliser (tokens or sequences of the whole batch, over
all data-parallel ranks and micro-batches) that the trainer passes in. Summing the
micro-batch losses and the ranks' gradients then gives exactly the loss and gradient of
the full batch, whatever the world size or micro-batching (verl's historical bug was
averaging per micro-batch, which weights short micro-batches more). Each mode is
registered by its line in catalog/algorithms.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Normaliser:
    """Counts over the whole global batch. `max_response_length` is for *-sum-norm."""

    tokens: float
    sequences: float
    max_response_length: int = 1


def token_mean(loss: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    """Every token of the batch weighs the same (DAPO)."""
    return (loss * mask).sum() / max(norm.tokens, 1.0)


def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    """Sum over each sequence's tokens, mean over sequences."""
    return (loss * mask).sum() / max(norm.sequences, 1.0)


def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    """Mean over each sequence's tokens, then mean over sequences (original GRPO).
    An empty response contributes zero."""
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_seq.sum() / max(norm.sequences, 1.0)


def seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    """Token sum divided by a constant (max response length) per sequence (Dr. GRPO)."""
    return (loss * mask).sum() / max(norm.sequences * norm.max_response_length, 1.0)


def token_sum(loss: torch.Tensor, mask: torch.Tensor, norm: Normaliser) -> torch.Tensor:
    """The plain sum over every token of the batch, no normaliser (verl's `token-sum`).

    Summing is already global: micro-batches and ranks add up to the full batch, and the
    trainer multiplies each rank's loss by the world size against FSDP's averaging, which
    is verl's `* dp_size`. The gradient grows with the batch's token count, so the learning
    rate must be scaled down by about that count compared to `token-mean`."""
    return (loss * mask).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` where `mask` is 1; 0 when the mask is empty."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)
