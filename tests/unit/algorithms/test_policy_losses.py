"""Policy losses (PPO clip, dual-clip, GSPO, CISPO), the value loss and entropy, against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from ratchet.algorithms import POLICY_LOSSES
from ratchet.algorithms.policy_losses import LossParams, entropy_from_logits, value_clipped, value_loss

from ...tensor_checks import close, lengths_mask
from .helpers import finite

torch.set_num_threads(1)


LN2, LN3 = math.log(2.0), math.log(3.0)


# ---------------------------------------------------------------------------------------- PPO clip


def test_ppo_clip_separate_low_and_high_bounds():
    params = LossParams(clip_ratio_low=0.2, clip_ratio_high=0.28)  # bounds 0.8 and 1.28
    # (advantage, ratio, expected loss, clip bound active?)
    cases = [
        (1.0, 1.1, -1.1, False),  # inside: -A r
        (1.0, 1.5, -1.28, True),  # A > 0, above 1.28: -A * 1.28
        (1.0, 0.5, -0.5, False),  # A > 0, below 0.8: pessimistic term is the unclipped -0.5
        (-1.0, 0.5, 0.8, True),  # A < 0, below 0.8: -A * 0.8
        (-1.0, 1.5, 1.5, False),  # A < 0, above: unclipped 1.5 > clipped 1.28
        (-2.0, 0.9, 1.8, False),  # inside
        (2.0, 1.25, -2.5, False),  # inside the high bound 1.28 (outside a symmetric 1.2)
        (-1.0, 0.75, 0.8, True),  # A < 0, 0.75 < 0.8
        (0.5, 1.3, -0.64, True),  # A > 0, 1.3 > 1.28: -0.5 * 1.28
    ]
    adv = torch.tensor([[c[0] for c in cases]])
    ratio = torch.tensor([[c[1] for c in cases]])
    old = torch.full_like(ratio, -2.0)
    logprob = old + ratio.log()
    mask = torch.ones_like(ratio)
    out = POLICY_LOSSES.get("ppo_clip")(logprob, old, adv, mask, params)
    close(out.ratio, [[c[1] for c in cases]], atol=1e-5)
    close(out.loss, [[c[2] for c in cases]], atol=1e-5)
    assert out.clipped.tolist() == [[c[3] for c in cases]]
    assert out.clipped.dtype == torch.bool


def test_ppo_clip_flags_only_masked_tokens():
    params = LossParams(0.2, 0.2)
    adv = torch.tensor([[1.0, 1.0]])
    old = torch.zeros(1, 2)
    logprob = torch.full((1, 2), math.log(2.0))  # ratio 2, above 1.2: clipped
    out = POLICY_LOSSES.get("ppo_clip")(logprob, old, adv, torch.tensor([[1.0, 0.0]]), params)
    assert out.clipped.tolist() == [[True, False]]
    close(out.loss, [[-1.2, -1.2]], atol=1e-6)  # the loss itself is unmasked


def test_ppo_clip_gradient_is_zero_where_clipped():
    params = LossParams(0.2, 0.2)
    old = torch.zeros(1, 3)
    # ratios 1.0 (inside), 2.0 (A>0, clipped above), 0.5 (A>0, below: unclipped, gradient flows)
    logprob = torch.tensor([[0.0, math.log(2.0), math.log(0.5)]], requires_grad=True)
    adv = torch.ones(1, 3)
    out = POLICY_LOSSES.get("ppo_clip")(logprob, old, adv, torch.ones(1, 3), params)
    out.loss.sum().backward()
    # d(-A r)/d logprob = -A r: -1.0 and -0.5; clipped token: 0
    close(logprob.grad, [[-1.0, 0.0, -0.5]], atol=1e-6)


@pytest.mark.parametrize("delta", [1000.0, -1000.0])
@pytest.mark.parametrize("a", [1.0, -1.0])
def test_ppo_clip_extreme_log_ratios_stay_finite(delta, a):
    old = torch.zeros(1, 1)
    logprob = torch.full((1, 1), delta, requires_grad=True)
    out = POLICY_LOSSES.get("ppo_clip")(logprob, old, torch.tensor([[a]]), torch.ones(1, 1), LossParams(0.2, 0.28))
    assert torch.isfinite(out.loss).all() and torch.isfinite(out.ratio).all()
    out.loss.sum().backward()
    assert torch.isfinite(logprob.grad).all()
    if delta > 0 and a > 0:
        assert out.loss.item() == pytest.approx(-1.28)  # clipped at the high bound
    if delta < 0 and a < 0:
        assert out.loss.item() == pytest.approx(0.8)  # clipped at the low bound
    if delta > 0 and a < 0:
        # log-ratio clamped to 20: loss = exp(20) = 4.85e8, large but finite
        assert out.loss.item() == pytest.approx(4.851651954097903e8, rel=1e-5)


# -------------------------------------------------------------------------- dual-clip, GSPO, CISPO


def make_logprobs(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.full((1, len(ratios)), -2.0)
    return (old + torch.tensor([ratios]).log()).requires_grad_(True), old


def test_all_policy_losses_registered():
    assert {"cispo", "dual_clip", "gspo", "ppo_clip"} <= set(POLICY_LOSSES.names())  # + the verl catalogue's (test_policy_losses_verl.py)
    assert LossParams().clip_ratio_c == 3.0


def test_dual_clip_by_hand():
    params = LossParams(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)  # bounds 0.8, 1.2, c = 3
    # (advantage, ratio, loss, PPO clip active, dual clip active)
    cases = [
        (1.0, 1.5, -1.2, True, False),  # A > 0: plain PPO, -A * 1.2
        (-1.0, 0.5, 0.8, True, False),  # A < 0 below 0.8: -A * 0.8, far from c
        (-1.0, 5.0, 3.0, False, True),  # A < 0, PPO loss 5 > -A c = 3: capped at 3
        (-2.0, 2.0, 4.0, False, False),  # PPO loss 4 < -A c = 6
        (-1.0, 3.0, 3.0, False, False),  # exactly at c: equal, not "active"
        (1.0, 10.0, -1.2, True, False),  # A > 0: no dual bound
        (-0.5, 8.0, 1.5, False, True),  # -(-0.5) * 3
    ]
    logprob, old = make_logprobs([c[1] for c in cases])
    adv = torch.tensor([[c[0] for c in cases]])
    out = POLICY_LOSSES.get("dual_clip")(logprob, old, adv, torch.ones_like(adv), params)
    close(out.loss, [[c[2] for c in cases]], atol=1e-5)
    assert out.clipped.tolist() == [[c[3] for c in cases]]
    assert out.dual_clipped.tolist() == [[c[4] for c in cases]]
    out.loss.sum().backward()
    # gradient -A r where the unclipped term is active, 0 where either bound is active
    # case 4 (-2, 2): 4; case 5 (-1, 3): tie of -A r and -A c, min splits the gradient: 3 / 2
    close(logprob.grad, [[0.0, 0.0, 0.0, 4.0, 1.5, 0.0, 0.0]], atol=1e-5)


def test_dual_clip_extreme_and_validation():
    for delta in (50.0, 1000.0, -1000.0):
        logprob = torch.full((1, 2), delta, requires_grad=True)
        out = POLICY_LOSSES.get("dual_clip")(logprob, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), LossParams())
        out.loss.sum().backward()
        assert finite(out.loss, out.ratio, logprob.grad)
        if delta > 0:
            close(out.loss, [[3.0, -1.2]])  # capped at -A c = 3; clipped at 1.2
    with pytest.raises(ValueError, match="clip_ratio_c"):
        POLICY_LOSSES.get("dual_clip")(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), LossParams(clip_ratio_c=1.0)
        )


def test_gspo_sequence_ratio_clip_and_per_token_gradient():
    params = LossParams(clip_ratio_low=0.1, clip_ratio_high=0.2)  # bounds 0.9 and 1.2
    old = torch.zeros(3, 3)
    # row 0: length 2, log-ratios 0.1, 0.3 (mean 0.2, s = e^0.2 = 1.2214 > 1.2: clipped), padding 1000
    # row 1: length 3, log-ratios -0.1, 0, 0.1 (mean 0, s = 1)
    # row 2: length 1, log-ratio 0.1 (s = e^0.1 = 1.10517, inside)
    logprob = torch.tensor([[0.1, 0.3, 1000.0], [-0.1, 0.0, 0.1], [0.1, -7.0, -7.0]], requires_grad=True)
    mask = lengths_mask([2, 3, 1], 3)
    adv = torch.tensor([[1.0], [-1.0], [2.0]]).expand(3, 3) * mask
    out = POLICY_LOSSES.get("gspo")(logprob, old, adv, mask, params)
    e01, e02 = math.exp(0.1), math.exp(0.2)
    close(out.ratio, [[e02, e02, e02], [1.0, 1.0, 1.0], [e01, e01, e01]], atol=1e-6)
    close(out.loss * mask, [[-1.2, -1.2, 0.0], [1.0, 1.0, 1.0], [-2 * e01, 0.0, 0.0]], atol=1e-6)
    assert out.clipped.tolist() == [[True, True, False], [False, False, False], [False, False, False]]
    (out.loss * mask).sum().backward()
    # d(-A s_i,t)/d logprob_t = -A s_i per token: row 1: 1 * 1; row 2: -2 e^0.1; clipped row 0 and padding: 0
    close(logprob.grad, [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [-2 * e01, 0.0, 0.0]], atol=1e-6)


def test_gspo_tiny_clip_range_and_extremes():
    params = LossParams(clip_ratio_low=3e-4, clip_ratio_high=4e-4)  # the paper's range
    logprob = torch.tensor([[0.0002, 0.0004], [0.01, -0.01]], requires_grad=True)
    out = POLICY_LOSSES.get("gspo")(logprob, torch.zeros(2, 2), torch.ones(2, 2), torch.ones(2, 2), params)
    # row 0: s = e^0.0003 = 1.0003 inside [0.9997, 1.0004]; row 1: s = e^0 = 1
    assert not out.clipped.any()
    close(out.loss, [[-math.exp(0.0003)] * 2, [-1.0, -1.0]], atol=1e-6)
    for delta in (50.0, -50.0, 1000.0, -1000.0):
        lp = torch.full((2, 3), delta, requires_grad=True)
        out = POLICY_LOSSES.get("gspo")(lp, torch.zeros(2, 3), torch.tensor([[1.0], [-1.0]]).expand(2, 3), torch.ones(2, 3), LossParams())
        out.loss.sum().backward()
        assert finite(out.loss, out.ratio, lp.grad)


def test_cispo_by_hand():
    # token 0: pi 0.5 / old 0.25 -> r = 2;  token 1: pi 0.2 / old 0.4 -> r = 0.5
    logprob = torch.tensor([[math.log(0.5), math.log(0.2)]], requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.4)]])
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    # defaults with clip_ratio_high 0.28: weight in [0, 1.28]: weights 1.28 and 0.5
    out = POLICY_LOSSES.get("cispo")(logprob, old, adv, mask, LossParams(clip_ratio_high=0.28))
    close(out.ratio, [[2.0, 0.5]], atol=1e-6)
    close(out.loss, [[-1.28 * 1.0 * math.log(0.5), -0.5 * -1.0 * math.log(0.2)]], atol=1e-6)
    assert out.clipped.tolist() == [[True, False]]
    out.loss.sum().backward()
    close(logprob.grad, [[-1.28 * 1.0, -0.5 * -1.0]], atol=1e-6)  # -w A: every token keeps a gradient
    # explicit bounds [1 - 0.2, 1 + 1.0] = [0.8, 2]: weights 2 (at the bound, not clipped) and 0.8
    params = LossParams(clip_ratio_high=0.28, cispo_clip_low=0.2, cispo_clip_high=1.0)
    out = POLICY_LOSSES.get("cispo")(logprob, old, adv, mask, params)
    close(out.loss, [[-2.0 * math.log(0.5), 0.8 * math.log(0.2)]], atol=1e-5)
    assert out.clipped.tolist() == [[False, True]]


def test_cispo_extremes_are_finite():
    for delta in (50.0, -50.0, 1000.0, -1000.0):
        logprob = torch.full((1, 2), -1.0, requires_grad=True)
        old = torch.full((1, 2), -1.0 - delta)
        out = POLICY_LOSSES.get("cispo")(logprob, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), LossParams(clip_ratio_high=0.28))
        out.loss.sum().backward()
        assert finite(out.loss, out.ratio, logprob.grad)
        expected_w = 1.28 if delta > 0 else 0.0  # e^-50 underflows below any lower bound
        close(logprob.grad, [[-expected_w, expected_w]], atol=1e-6)


@pytest.mark.parametrize("name", ["dual_clip", "gspo", "cispo"])
def test_new_policy_losses_are_finite_on_padding_garbage(name):
    # -inf / nan / 1e30 on padded positions: loss * mask (what aggregation computes) and the
    # gradient stay finite, and padding gets no gradient
    logprob = torch.tensor([[-1.0, float("-inf")], [-0.5, 1e30]], requires_grad=True)
    old = torch.tensor([[-1.2, 0.0], [-0.5, float("nan")]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    out = POLICY_LOSSES.get(name)(logprob, old, torch.ones(2, 2), mask, LossParams())
    (out.loss * mask).sum().backward()
    assert finite(out.loss * mask, logprob.grad)
    assert logprob.grad[:, 1].abs().sum().item() == 0.0
    assert not out.clipped[:, 1].any()


# ----------------------------------------------------------------------------- value loss, entropy


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 2.0, 0.0, 5.0]], requires_grad=True)
    old = torch.tensor([[0.9, 1.0, 0.5, 0.0]])
    returns = torch.tensor([[1.5, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss = value_loss(values, old, returns, mask, 0.2)
    # t0: v inside v_old +- 0.2, both terms (1 - 1.5)^2 = 0.25 -> 0.125
    # t1: v_clip = 1.2: max((2 - 1)^2, 0.2^2) = 1 -> 0.5
    # t2: v_clip = 0.3: max(0, 0.3^2) = 0.09 -> 0.045 (the clipped term wins)
    close(loss, [[0.125, 0.5, 0.045, 0.0]], atol=1e-6)
    assert value_clipped(values, old, returns, mask, 0.2).tolist() == [[False, False, True, False]]
    loss.sum().backward()
    # d/dv: t0: v - R = -0.5; t1: v - R = 1; t2: clipped, 0; t3: masked
    close(values.grad, [[-0.5, 1.0, 0.0, 0.0]], atol=1e-6)


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0], [1000.0, 1000.0], [0.0, float("-inf")], [0.0, LN3]])
    # uniform over 2: ln 2 (also at 1000); one-hot: 0; p = 1/4, 3/4: -(1/4 ln 1/4 + 3/4 ln 3/4)
    close(entropy_from_logits(logits), [LN2, LN2, 0.0, -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))], atol=1e-6)
    assert entropy_from_logits(torch.zeros(2, 3, 5)).shape == (2, 3)
