"""Checks shared by the algorithm unit tests (tensor comparisons live in tests/tensor_checks.py)."""

from __future__ import annotations

import torch


def finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)
