"""Assertions on small tensors, shared by the algorithm tests."""

from __future__ import annotations

import torch


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def lengths_mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])
