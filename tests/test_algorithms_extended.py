"""The extended ratchet.algorithms (GAE, REINFORCE++, ReMax, dual-clip, GSPO, CISPO, value
loss, KL aliases / straight-through / controllers, off-policy corrections, DAPO extras)
against values worked out by hand, plus loss/gradient invariance of every aggregation mode
under micro-batching and across 2 gloo ranks.

Expected numbers are written out as arithmetic on the inputs, never obtained by calling the
function under test a second time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import socket

import pytest
import torch

from ratchet.algorithms import (
    ADV_ESTIMATORS,
    LOSS_AGGREGATIONS,
    OFF_POLICY,
    POLICY_LOSSES,
    AdaptiveKLController,
    AdvInputs,
    AdvParams,
    LossParams,
    Normaliser,
    apply_kl_in_reward,
    discounted_returns,
    dynamic_sampling_keep,
    entropy_from_logits,
    kl_penalty,
    masked_whiten,
    off_policy_correction,
    overlong_penalty,
    remax_baselines,
    value_clipped,
    value_loss,
)

from .tensor_checks import close, lengths_mask

torch.set_num_threads(1)

WEPS = 1e-8  # masked_whiten adds this to the variance (verl)
LN2, LN3, LN4, LN1_5 = math.log(2.0), math.log(3.0), math.log(4.0), math.log(1.5)


def finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def whiten_by_hand(values: list[float]) -> list[float]:
    """(x - mean) / sqrt(unbiased var + 1e-8), with the sums written out (no torch)."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return [(v - mean) / math.sqrt(var + WEPS) for v in values]


# =========================================================================== advantages


def test_estimator_registry_flags():
    flags = {n: ADV_ESTIMATORS.get(n) for n in ADV_ESTIMATORS.names()}
    assert sorted(flags) == ["gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo"]
    assert flags["gae"].needs_critic and not flags["gae"].needs_group and not flags["gae"].needs_baseline
    assert flags["remax"].needs_baseline and not flags["remax"].needs_critic and not flags["remax"].needs_group
    assert flags["reinforce_plus_plus_baseline"].needs_group and not flags["reinforce_plus_plus_baseline"].needs_critic
    rpp = flags["reinforce_plus_plus"]
    assert not (rpp.needs_group or rpp.needs_critic or rpp.needs_baseline)


def test_masked_whiten_by_hand_and_corner_cases():
    x = torch.tensor([[1.0, 2.0, 99.0], [4.0, float("nan"), float("inf")]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # over 1, 2, 4: mean 7/3; deviations -4/3, -1/3, 5/3; unbiased var (16 + 1 + 25) / 9 / 2 = 7/3
    s = math.sqrt(7 / 3 + WEPS)
    close(masked_whiten(x, mask), [[-4 / 3 / s, -1 / 3 / s, 0.0], [5 / 3 / s, 0.0, 0.0]], atol=1e-6)
    # a constant over the mask is exactly 0 (float32 0.7 is not representable; still exact)
    out = masked_whiten(torch.full((3, 4), 0.7), torch.ones(3, 4))
    assert out.abs().max().item() == 0.0
    assert masked_whiten(torch.tensor([[3.0, 5.0]]), torch.tensor([[1.0, 0.0]])).abs().sum().item() == 0.0  # one token
    empty = masked_whiten(torch.tensor([[3.0, 5.0]]), torch.zeros(1, 2))
    assert empty.abs().sum().item() == 0.0 and finite(empty)


def test_discounted_returns_reset_at_holes_and_padding():
    rewards = torch.tensor([[1.0, 0.0, 1.0, 7.0], [0.0, 0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    # row 0: the hole at t=1 starts a new segment: G = [1, 0, 1, 0]; the 7 on padding is ignored
    # row 1: gamma 0.5: G_2 = 2, G_1 = 0 + 0.5 * 2 = 1, G_0 = 0.5
    close(discounted_returns(rewards, mask, 0.5), [[1.0, 0.0, 1.0, 0.0], [0.5, 1.0, 2.0, 0.0]])


# Shared batch for the token-level estimators: row 0 length 3, row 1 length 2 (padding holds
# garbage that must be ignored).
TR = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
TMASK = lengths_mask([3, 2], 3)


def test_gae_by_hand():
    values = torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 99.0]])
    out = ADV_ESTIMATORS.get("gae").fn(AdvInputs(TR, TMASK, torch.tensor([0, 1]), values=values), AdvParams(gamma=0.5, lam=0.5))
    # gamma = lam = 0.5, gamma * lam = 0.25, V after the last token = 0
    # row 0: t=2: delta = 1 - 0.5 = 0.5, A = 0.5
    #        t=1: delta = 0 + 0.5 * 0.5 - 0.5 = -0.25, A = -0.25 + 0.25 * 0.5 = -0.125
    #        t=0: delta = -0.25, A = -0.25 + 0.25 * -0.125 = -0.28125
    # row 1: t=2 padding (skipped); t=1: delta = 2 - 1 = 1, A = 1
    #        t=0: delta = 0 + 0.5 * 1 - 1 = -0.5, A = -0.5 + 0.25 * 1 = -0.25
    raw = [-0.28125, -0.125, 0.5, -0.25, 1.0]
    close(out.returns, [[-0.28125 + 0.5, -0.125 + 0.5, 0.5 + 0.5], [-0.25 + 1.0, 1.0 + 1.0, 0.0]])
    w = whiten_by_hand(raw)
    close(out.advantages, [[w[0], w[1], w[2]], [w[3], w[4], 0.0]], atol=1e-5)
    # spot value: mean 0.16875, var = 1.26484375 / 4, so A_1,1 = 0.83125 / 0.5623263
    assert out.advantages[1, 1].item() == pytest.approx(0.83125 / math.sqrt(1.26484375 / 4), abs=1e-5)


def test_gae_gamma_lam_one_zero_values_is_whitened_return_to_go():
    out = ADV_ESTIMATORS.get("gae").fn(AdvInputs(TR, TMASK, torch.tensor([0, 1]), values=torch.zeros(2, 3)), AdvParams())
    # A_t = sum of future rewards: [1, 1, 1], [2, 2]; returns the same
    close(out.returns, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])
    w = whiten_by_hand([1.0, 1.0, 1.0, 2.0, 2.0])
    close(out.advantages, [[w[0], w[1], w[2]], [w[3], w[4], 0.0]], atol=1e-5)


def test_gae_constant_advantage_is_zero_and_missing_values_raise():
    # one token per row, reward 1, value 0.25: every raw advantage is 0.75 -> whitened 0
    mask = torch.ones(3, 1)
    out = ADV_ESTIMATORS.get("gae").fn(
        AdvInputs(torch.ones(3, 1), mask, torch.arange(3), values=torch.full((3, 1), 0.25)), AdvParams(lam=0.9)
    )
    assert out.advantages.abs().max().item() == 0.0
    close(out.returns, [[1.0], [1.0], [1.0]])
    with pytest.raises(ValueError, match="values"):
        ADV_ESTIMATORS.get("gae").fn(AdvInputs(TR, TMASK, torch.tensor([0, 1])), AdvParams())


def test_reinforce_plus_plus_by_hand():
    out = ADV_ESTIMATORS.get("reinforce_plus_plus").fn(AdvInputs(TR, TMASK, torch.tensor([0, 1])), AdvParams(gamma=0.5))
    # G row 0 = [0.25, 0.5, 1]; row 1 = [0 + 0.5 * 2, 2] = [1, 2] (the 5 on padding is ignored)
    close(out.returns, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    # mean 4.75 / 5 = 0.95; deviations -0.7, -0.45, 0.05, 0.05, 1.05; var 1.8 / 4 = 0.45
    s = math.sqrt(0.45 + WEPS)
    close(out.advantages, [[-0.7 / s, -0.45 / s, 0.05 / s], [0.05 / s, 1.05 / s, 0.0]], atol=1e-5)


def test_reinforce_plus_plus_equal_rewards_and_all_masked_rows():
    # every response ends with reward 1, gamma 1: G = 1 on every token -> advantages 0
    mask = lengths_mask([3, 1, 2, 0], 3)
    inputs = AdvInputs(torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), mask, torch.arange(4))
    out = ADV_ESTIMATORS.get("reinforce_plus_plus").fn(inputs, AdvParams())
    assert out.advantages.abs().max().item() == 0.0 and finite(out.advantages, out.returns)
    close(out.returns, [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    everything_masked = ADV_ESTIMATORS.get("reinforce_plus_plus").fn(
        AdvInputs(torch.ones(2, 3), torch.zeros(2, 3), torch.arange(2)), AdvParams()
    )
    assert everything_masked.advantages.abs().sum().item() == 0.0 and finite(everything_masked.advantages)


def test_reinforce_plus_plus_baseline_by_hand():
    # group 0: rows 0 and 1, scores 1 and 0.5 + 2.5 = 3 (the sum of token rewards is the score)
    # group 5: row 2 alone, score 2
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 2.5], [2.0, 0.0, 0.0]])
    mask = lengths_mask([2, 3, 1], 3)
    out = ADV_ESTIMATORS.get("reinforce_plus_plus_baseline").fn(AdvInputs(rewards, mask, torch.tensor([0, 0, 5])), AdvParams())
    # centred: 1 - 2 = -1, 3 - 2 = 1, singleton keeps 2 (verl: baseline 0 for a group of one)
    # gamma 1: every token carries its sequence's value: -1, -1 | 1, 1, 1 | 2
    # mean 3 / 6 = 0.5; deviations -1.5 x2, 0.5 x3, 1.5; var (2.25 * 3 + 0.25 * 3) / 5 = 1.5
    s = math.sqrt(1.5 + WEPS)
    expected = [[-1.5 / s, -1.5 / s, 0.0], [0.5 / s, 0.5 / s, 0.5 / s], [1.5 / s, 0.0, 0.0]]
    close(out.advantages, expected, atol=1e-5)
    close(out.returns, expected, atol=1e-5)


def test_reinforce_plus_plus_baseline_equal_rewards_and_single_member_groups():
    mask = lengths_mask([2, 3, 1, 2], 3)
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    # all four rewards 1 in two groups: centred scores all 0 -> 0
    out = ADV_ESTIMATORS.get("reinforce_plus_plus_baseline").fn(AdvInputs(rewards, mask, torch.tensor([0, 0, 1, 1])), AdvParams())
    assert out.advantages.abs().max().item() == 0.0 and finite(out.advantages)
    # all singletons with equal rewards: raw scores 1 everywhere, a constant -> 0
    out = ADV_ESTIMATORS.get("reinforce_plus_plus_baseline").fn(AdvInputs(rewards, mask, torch.arange(4)), AdvParams())
    assert out.advantages.abs().max().item() == 0.0 and finite(out.advantages)


def test_remax_by_hand():
    # row 0 carries a per-token KL penalty -0.1 on its first two tokens; row 2 is empty
    rewards = torch.tensor([[-0.1, -0.1, 1.0], [0.0, 2.0, 4.0], [0.0, 0.0, 0.0]])
    mask = lengths_mask([3, 2, 0], 3)
    inputs = AdvInputs(rewards, mask, torch.arange(3), baseline_rewards=torch.tensor([0.25, 3.0, 1.0]))
    out = ADV_ESTIMATORS.get("remax").fn(inputs, AdvParams(gamma=0.5))  # gamma is not used
    # G row 0 = [-0.1 - 0.1 + 1, -0.1 + 1, 1] = [0.8, 0.9, 1.0]; row 1 = [2, 2]
    close(out.returns, [[0.8, 0.9, 1.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    close(out.advantages, [[0.8 - 0.25, 0.9 - 0.25, 1.0 - 0.25], [2.0 - 3.0, 2.0 - 3.0, 0.0], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="baseline_rewards"):
        ADV_ESTIMATORS.get("remax").fn(AdvInputs(rewards, mask, torch.arange(3)), AdvParams())


def test_remax_baselines_follow_each_sample_to_its_prompt():
    # greedy responses to prompts 5 and 3 scored 0.25 and 1.0; samples of 3, 5, 3, 5
    baselines = remax_baselines(torch.tensor([3, 5, 3, 5]), torch.tensor([5, 3]), torch.tensor([0.25, 1.0]))
    assert baselines.tolist() == [1.0, 0.25, 1.0, 0.25] and baselines.dtype == torch.float32


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"])
def test_new_estimators_finite_on_degenerate_batches(name):
    # one sequence, all-masked rows, huge rewards, NaN garbage on padding
    rewards = torch.tensor([[1e6, float("nan")], [0.0, 0.0], [3.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    inputs = AdvInputs(rewards, mask, torch.tensor([0, 0, 1]), values=torch.full((3, 2), float("nan")).masked_fill(mask.bool(), 0.5),
                       baseline_rewards=torch.zeros(3))
    out = ADV_ESTIMATORS.get(name).fn(inputs, AdvParams())
    assert finite(out.advantages, out.returns)
    assert out.advantages[1].abs().sum().item() == 0.0 and out.advantages[:, 1].abs().sum().item() == 0.0
    # the NaN on padding must not silently zero the real tokens either: rows 0 and 2 differ
    if name != "remax":  # (remax with baseline 0: A = G = 1e6 and 3)
        assert out.advantages[0, 0].item() != 0.0 and out.advantages[2, 0].item() != 0.0
    else:
        close(out.advantages[:, 0], [1e6, 0.0, 3.0])


def test_masked_whiten_shows_nan_on_real_tokens():
    out = masked_whiten(torch.tensor([[1.0, float("nan")]]), torch.ones(1, 2))
    assert torch.isnan(out).all()


# =========================================================================== policy losses


def make_logprobs(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.full((1, len(ratios)), -2.0)
    return (old + torch.tensor([ratios]).log()).requires_grad_(True), old


def test_all_policy_losses_registered():
    assert POLICY_LOSSES.names() == ["cispo", "dual_clip", "gspo", "ppo_clip"]
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
        POLICY_LOSSES.get("dual_clip")(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), LossParams(clip_ratio_c=1.0))


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


# =========================================================================== KL

LOGPROB = torch.tensor([-1.0, -2.0, -0.5, -0.3])
REF = torch.tensor([-1.5, -1.0, -0.5, 1.7])
# r = ref - logprob = [-0.5, 1.0, 0.0, 2.0]; logprob - ref = [0.5, -1.0, 0.0, -2.0]
BASE = {
    "k1": [0.5, -1.0, 0.0, -2.0],
    "abs": [0.5, 1.0, 0.0, 2.0],
    "mse": [0.125, 0.5, 0.0, 2.0],
    "k2": [0.125, 0.5, 0.0, 2.0],
    "low_var_kl": [math.exp(-0.5) + 0.5 - 1, math.e - 2, 0.0, math.exp(2) - 3],
    "k3": [math.exp(-0.5) + 0.5 - 1, math.e - 2, 0.0, math.exp(2) - 3],
}


@pytest.mark.parametrize("kind", ["k2", "k3"])
def test_kl_aliases(kind):
    close(kl_penalty(kind, LOGPROB, REF), BASE[kind], atol=1e-6)


@pytest.mark.parametrize("base", sorted(BASE))
def test_straight_through_kl_value_of_base_gradient_of_k2(base):
    logprob = LOGPROB.clone().requires_grad_(True)
    ref = REF.clone().requires_grad_(True)
    kl = kl_penalty(base + "+", logprob, ref)
    close(kl.detach(), BASE[base], atol=1e-6)
    kl.sum().backward()
    close(logprob.grad, [0.5, -1.0, 0.0, -2.0], atol=1e-6)  # d k2 / d logprob = logprob - ref
    close(ref.grad, [-0.5, 1.0, 0.0, 2.0], atol=1e-6)


@pytest.mark.parametrize("kind", ["k1+", "k2+", "k3+", "mse+", "low_var_kl+", "abs+", "k2", "k3"])
def test_kl_variants_finite_for_extreme_log_ratios(kind):
    logprob = torch.tensor([50.0, -50.0, 1000.0, -1000.0], requires_grad=True)
    ref = torch.zeros(4)
    kl = kl_penalty(kind, logprob, ref)
    kl.sum().backward()
    assert finite(kl, logprob.grad)


def test_apply_kl_in_reward_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    logprob = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.0, 99.0], [5.0, 5.0, 5.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [1.7, -1.0, 0.0], [0.0, 0.0, 0.0]])
    mask = lengths_mask([3, 2, 0], 3)  # row 2 is empty
    # k1 = logprob - ref: [0.5, -1, 0], [-2, 0]; r' = r - 0.1 k1
    out, mean_kl = apply_kl_in_reward(rewards, logprob, ref, mask, 0.1, "k1")
    close(out, [[-0.05, 0.1, 1.0], [0.2, 2.0, 0.0], [0.0, 0.0, 0.0]], atol=1e-6)
    # per-sequence token means -1/6 and -1, averaged over the two non-empty rows
    assert mean_kl.item() == pytest.approx((-1 / 6 - 1) / 2, abs=1e-6)
    # mse: [0.125, 0.5, 0], [2, 0]: means 0.625 / 3 and 1
    out, mean_kl = apply_kl_in_reward(rewards, logprob, ref, mask, 2.0, "mse")
    close(out, [[-0.25, -1.0, 1.0], [-4.0, 2.0, 0.0], [0.0, 0.0, 0.0]], atol=1e-6)
    assert mean_kl.item() == pytest.approx((0.625 / 3 + 1.0) / 2, abs=1e-6)
    _, empty = apply_kl_in_reward(rewards, logprob, ref, torch.zeros(3, 3), 1.0, "k3")
    assert empty.item() == 0.0


def test_adaptive_kl_controller_by_hand():
    ctrl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    # kl 9: error 9/6 - 1 = 0.5, clipped to 0.2; coef * (1 + 0.2 * 256 / 10000) = 0.1 * 1.00512
    assert ctrl.update(9.0, 256) == pytest.approx(0.100512, abs=1e-12)
    # kl 5.4: error -0.1; * (1 - 0.1 * 100 / 10000) = * 0.999
    assert ctrl.update(5.4, 100) == pytest.approx(0.100512 * 0.999, abs=1e-12)
    # kl 0: error -1 clipped to -0.2; * (1 - 0.2 * 1000 / 10000) = * 0.98
    assert ctrl.update(0.0, 1000) == pytest.approx(0.100512 * 0.999 * 0.98, abs=1e-12)
    assert ctrl.coef == pytest.approx(0.100512 * 0.999 * 0.98, abs=1e-12)


def test_adaptive_kl_controller_state_round_trip_is_exact():
    steps = [(9.0, 256), (5.4, 100), (6.6, 64), (0.0, 1000)]
    straight = AdaptiveKLController(0.1, 6.0, 10000)
    for kl, n in steps:
        straight.update(kl, n)
    resumed = AdaptiveKLController(0.1, 6.0, 10000)
    for kl, n in steps[:2]:
        resumed.update(kl, n)
    carried = json.loads(json.dumps(resumed.state()))  # what a workflow would carry
    assert isinstance(carried, float)
    fresh = AdaptiveKLController(0.1, 6.0, 10000)
    fresh.load_state(carried)
    for kl, n in steps[2:]:
        fresh.update(kl, n)
    assert fresh.coef == straight.coef  # bit-exact
    assert dataclasses.asdict(fresh) == json.loads(json.dumps(dataclasses.asdict(fresh)))
    assert AdaptiveKLController(0.1, 6.0, 10000, coef=carried).coef == carried


def test_adaptive_kl_controller_validation():
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, 0.0, 100)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 1.0, 0)


# =========================================================================== off-policy

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


# =========================================================================== DAPO


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


# =========================================================================== aggregation invariance

B, T, D, V = 8, 5, 4, 6
LENGTHS = [5, 3, 1, 4, 2, 5, 0, 3]  # one empty response


def problem():
    """A tiny 'language model': logits = x @ W, W shared by every token, in float64."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    w0 = torch.randn(D, V, generator=g, dtype=torch.float64) * 0.5
    mask = lengths_mask(LENGTHS, T).double()
    with torch.no_grad():
        lp0 = (x @ w0).log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    old = lp0 + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # some tokens get clipped
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) * mask
    norm = Normaliser(tokens=float(mask.sum()), sequences=float(B), max_response_length=T)
    return x, tokens, w0, mask, old, adv, norm


def shard_loss(w, rows, mode, loss_name="ppo_clip"):
    x, tokens, _, mask, old, adv, norm = problem()
    logprob = (x[rows] @ w).log_softmax(-1).gather(-1, tokens[rows].unsqueeze(-1)).squeeze(-1)
    out = POLICY_LOSSES.get(loss_name)(logprob, old[rows], adv[rows], mask[rows], LossParams(0.2, 0.28))
    return LOSS_AGGREGATIONS.get(mode)(out.loss, mask[rows], norm)


def loss_and_grad(row_sets, mode, loss_name="ppo_clip"):
    w = problem()[2].clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for rows in row_sets:
        loss = shard_loss(w, rows, mode, loss_name)
        loss.backward()
        total = total + loss.detach()
    return total, w.grad.clone()


@pytest.mark.parametrize("loss_name", ["ppo_clip", "dual_clip", "gspo", "cispo"])
@pytest.mark.parametrize("mode", sorted(LOSS_AGGREGATIONS.names()))
def test_one_vs_four_micro_batches_same_loss_and_gradient(mode, loss_name):
    full_loss, full_grad = loss_and_grad([torch.arange(B)], mode, loss_name)
    micro_loss, micro_grad = loss_and_grad([torch.arange(i, i + 2) for i in range(0, B, 2)], mode, loss_name)
    assert full_grad.abs().sum() > 0
    torch.testing.assert_close(micro_loss, full_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(micro_grad, full_grad, atol=1e-6, rtol=0)


def _gloo_worker(rank: int, world: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for mode in LOSS_AGGREGATIONS.names():
            w = problem()[2].clone().requires_grad_(True)
            loss = shard_loss(w, torch.arange(rank, B, world), mode)  # strided rows, as the trainer
            loss.backward()
            grad, total = w.grad.clone(), loss.detach().clone()
            dist.all_reduce(grad, op=dist.ReduceOp.SUM)
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            results[mode] = (total, grad)
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="no gloo")
def test_one_vs_two_gloo_ranks_same_loss_and_gradient(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "rank0.pt"
    mp.spawn(_gloo_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    results = torch.load(out)
    assert sorted(results) == LOSS_AGGREGATIONS.names()
    for mode, (total, grad) in results.items():
        full_loss, full_grad = loss_and_grad([torch.arange(B)], mode)
        torch.testing.assert_close(total, full_loss, atol=1e-6, rtol=0, msg=mode)
        torch.testing.assert_close(grad, full_grad, atol=1e-6, rtol=0, msg=mode)
