"""DAPO extras: dynamic sampling's keep mask and the soft overlong penalty, by hand."""

from __future__ import annotations

import torch

from ratchet.algorithms.dapo import dynamic_sampling_keep, overlong_penalty

from ...tensor_checks import close

torch.set_num_threads(1)


def test_dynamic_sampling_keep():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 5.0, 0.5, 0.2, 0.2, 0.7])
    group = torch.tensor([3, 3, 1, 1, 9, 7, 4, 4, 4])
    # group 3: all 1 -> drop; group 1: 0 and 1 -> keep; 9 and 7: singletons -> drop;
    # group 4: 0.2, 0.2, 0.7 -> keep
    assert dynamic_sampling_keep(scores, group).tolist() == [False, False, True, True, False, False, True, True, True]
    assert dynamic_sampling_keep(torch.tensor([0.5, 0.5000001]), torch.tensor([0, 0]), atol=1e-3).tolist() == [False, False]
    assert dynamic_sampling_keep(torch.tensor([0.0, 1.0]).long(), torch.tensor([2, 2])).tolist() == [True, True]


def test_overlong_penalty():
    lengths = torch.tensor([10, 12, 15, 16, 20, 25])
    # L_max 20, buffer 8: free up to 12, then -(L - 12) / 8, -1 from 20 on
    close(overlong_penalty(lengths, 20, 8, 1.0), [0.0, 0.0, -3 / 8, -4 / 8, -1.0, -1.0])
    close(overlong_penalty(lengths, 20, 8, 0.5), [0.0, 0.0, -1.5 / 8, -2 / 8, -0.5, -0.5])
    close(overlong_penalty(torch.tensor([19, 20, 21]), 20, 0, 2.0), [0.0, 0.0, -2.0])  # no buffer: a step
