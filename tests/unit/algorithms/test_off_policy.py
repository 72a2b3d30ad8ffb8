"""Off-policy corrections (none, TIS, decoupled, bypass, rejection) at each level, and their metrics, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from ratchet.algorithms import OFF_POLICY
from ratchet.algorithms.off_policy import off_policy_correction

from ...tensor_checks import close, lengths_mask
from .helpers import finite

torch.set_num_threads(1)


LN2, LN4, LN1_5 = math.log(2.0), math.log(4.0), math.log(1.5)

# Row 0 length 3, row 1 length 2. Token ratios w = pi_old / mu: [2, 1, 1/2] and [4, 3/2];
# padding holds -inf / nan garbage.
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.3, float("-inf")]])
OLD = ROLLOUT + torch.tensor([[LN2, 0.0, -LN2], [LN4, LN1_5, 0.0]])
OLD[1, 2] = float("nan")
OPMASK = lengths_mask([3, 2], 3)

# rollout/trainer KL, k3 = e^d - d - 1 with d = old - rollout, over 5 tokens
K3_BY_HAND = ((2 - LN2 - 1) + 0.0 + (0.5 + LN2 - 1) + (4 - LN4 - 1) + (1.5 - LN1_5 - 1)) / 5
K1_BY_HAND = -(LN2 + 0.0 - LN2 + LN4 + LN1_5) / 5


def correct(mode, cap=3.0, level="token", old=OLD, rollout=ROLLOUT, mask=OPMASK):
    return off_policy_correction(mode, old_logprob=old, rollout_logprob=rollout, mask=mask, cap=cap, level=level)


def check_metrics(corr, mean, maximum, truncated=0.0, masked=0.0):
    m = corr.metrics
    assert m["is_weight_mean"] == pytest.approx(mean, abs=1e-5)
    assert m["is_weight_max"] == pytest.approx(maximum, abs=1e-5)
    assert m["frac_truncated"] == pytest.approx(truncated, abs=1e-6)
    assert m["frac_masked"] == pytest.approx(masked, abs=1e-6)
    assert m["rollout_trainer_kl"] == pytest.approx(K3_BY_HAND, abs=1e-5)
    assert m["rollout_trainer_k1"] == pytest.approx(K1_BY_HAND, abs=1e-5)


def test_off_policy_registry():
    assert OFF_POLICY.names() == ["bypass", "decoupled", "none", "rejection", "tis"]
    with pytest.raises(ValueError, match="registered: bypass, decoupled, none, rejection, tis"):
        correct("nope")
    with pytest.raises(ValueError, match="level"):
        correct("tis", level="batch")


def test_off_policy_none():
    corr = correct("none")
    close(corr.weights, OPMASK)
    close(corr.mask, OPMASK)
    assert not corr.use_rollout_as_old
    check_metrics(corr, 1.0, 1.0)
    no_rollout = off_policy_correction("none", old_logprob=OLD, rollout_logprob=None, mask=OPMASK)
    close(no_rollout.weights, OPMASK)
    assert "rollout_trainer_kl" not in no_rollout.metrics


def test_tis_token():
    corr = correct("tis", cap=3.0, level="token")
    close(corr.weights, [[2.0, 1.0, 0.5], [3.0, 1.5, 0.0]], atol=1e-5)  # 4 truncated to 3
    close(corr.mask, OPMASK)
    assert not corr.weights.requires_grad
    check_metrics(corr, (2 + 1 + 0.5 + 3 + 1.5) / 5, 3.0, truncated=1 / 5)


def test_tis_sequence_and_geometric():
    # sequence: row 0 product 2 * 1 * 1/2 = 1; row 1 4 * 1.5 = 6 -> 3
    corr = correct("tis", cap=3.0, level="sequence")
    close(corr.weights, [[1.0, 1.0, 1.0], [3.0, 3.0, 0.0]], atol=1e-5)
    check_metrics(corr, (3 * 1 + 2 * 3) / 5, 3.0, truncated=2 / 5)
    # geometric: row 0 1; row 1 sqrt(6) = 2.449 < 3
    corr = correct("tis", cap=3.0, level="geometric")
    r6 = math.sqrt(6)
    close(corr.weights, [[1.0, 1.0, 1.0], [r6, r6, 0.0]], atol=1e-5)
    check_metrics(corr, (3 + 2 * r6) / 5, r6)


def test_decoupled_masks_tokens_above_cap():
    corr = correct("decoupled", cap=3.0)
    # the token with w = 4 is dropped, the others keep their weight
    close(corr.mask, [[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    close(corr.weights, [[2.0, 1.0, 0.5], [0.0, 1.5, 0.0]], atol=1e-5)
    assert not corr.use_rollout_as_old
    check_metrics(corr, (2 + 1 + 0.5 + 1.5) / 4, 2.0, masked=1 / 5)


def test_bypass_uses_rollout_as_old():
    corr = correct("bypass")
    assert corr.use_rollout_as_old
    close(corr.weights, OPMASK)
    close(corr.mask, OPMASK)
    check_metrics(corr, 1.0, 1.0)
    alone = off_policy_correction("bypass", old_logprob=None, rollout_logprob=ROLLOUT, mask=OPMASK)
    assert alone.use_rollout_as_old and "rollout_trainer_kl" not in alone.metrics


def test_rejection_sequence_geometric_token():
    # sequence ratios 1 and 6: with cap 3, [1/3, 3] keeps row 0 only
    corr = correct("rejection", cap=3.0, level="sequence")
    close(corr.mask, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    close(corr.weights, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    check_metrics(corr, 1.0, 1.0, masked=2 / 5)
    # geometric means 1 and sqrt(6) = 2.449: cap 3 keeps both, cap 2 drops row 1
    close(correct("rejection", cap=3.0, level="geometric").mask, OPMASK)
    close(correct("rejection", cap=2.0, level="geometric").mask, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    # token level, cap 1.8: keep w in [0.5556, 1.8]: 2 no, 1 yes, 0.5 no | 4 no, 1.5 yes
    corr = correct("rejection", cap=1.8, level="token")
    close(corr.mask, [[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    check_metrics(corr, 1.0, 1.0, masked=3 / 5)
    with pytest.raises(ValueError, match="cap"):
        correct("rejection", cap=0.5)


@pytest.mark.parametrize("mode", ["none", "tis", "decoupled", "bypass", "rejection"])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_off_policy_extreme_log_ratios_finite(mode, level):
    rollout = torch.zeros(4, 3)
    old = torch.tensor([[50.0, 50.0, 0.0], [-50.0, 0.0, 0.0], [1000.0, 1000.0, 1000.0], [-1000.0, 0.0, 0.0]])
    corr = correct(mode, cap=2.0, level=level, old=old, rollout=rollout, mask=torch.ones(4, 3))
    assert finite(corr.weights, corr.mask)
    assert all(math.isfinite(v) for v in corr.metrics.values()), corr.metrics
    assert corr.weights.max().item() <= 2.0 + 1e-6 and corr.weights.min().item() >= 0.0
    if mode == "tis" and level != "geometric":
        assert corr.weights[2, 0].item() == pytest.approx(2.0)  # truncated at cap
        assert corr.weights[3, 0].item() == 0.0  # e^-1000
    if mode == "rejection":
        assert corr.mask[2].sum().item() == 0.0 and corr.mask[3, 0].item() == 0.0


def test_off_policy_requires_logprobs_and_validates_cap():
    with pytest.raises(ValueError, match="rollout_logprob"):
        off_policy_correction("tis", old_logprob=OLD, rollout_logprob=None, mask=OPMASK)
    with pytest.raises(ValueError, match="cap"):
        correct("tis", cap=0.0)


def test_off_policy_all_masked_metrics_are_zero_not_nan():
    for mode in OFF_POLICY.names():
        corr = correct(mode, mask=torch.zeros(2, 3))
        assert corr.mask.sum().item() == 0.0 and corr.weights.abs().sum().item() == 0.0
        assert all(v == 0.0 for v in corr.metrics.values()), (mode, corr.metrics)
