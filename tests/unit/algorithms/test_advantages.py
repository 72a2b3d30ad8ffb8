"""Advantage estimators (GRPO, RLOO, GAE, REINFORCE++, ReMax) and their helpers, against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from ratchet.algorithms import ADV_ESTIMATORS
from ratchet.algorithms.advantages import (
    AdvInputs,
    AdvParams,
    discounted_returns,
    masked_whiten,
    remax_baselines,
    sequence_rewards_to_tokens,
)

from ...tensor_checks import close, lengths_mask
from .helpers import finite

torch.set_num_threads(1)


EPS = 1e-6  # AdvParams.epsilon
WEPS = 1e-8  # masked_whiten adds this to the variance (verl)


# -------------------------------------------------------------------- group estimators: GRPO, RLOO

# Two groups of different sizes, interleaved so the estimator must really group by id:
#   group 7: rows 0, 2, 3 with rewards 1, 2, 6
#   group 3: rows 1, 4    with rewards 0, 1
REWARDS = torch.tensor([1.0, 0.0, 2.0, 6.0, 1.0])
GROUP = torch.tensor([7, 3, 7, 7, 3])

# A different response length per row. (Under the AdvInputs API an *empty* response has no
# token to carry its reward, so its score is 0: see test_empty_response_has_score_zero.)
LENGTHS = [3, 1, 4, 2, 2]
MASK = lengths_mask(LENGTHS, 4)

# group 7: mean = (1 + 2 + 6) / 3 = 3; deviations -2, -1, +3;
#          unbiased var = (4 + 1 + 9) / (3 - 1) = 7, std = sqrt(7)
# group 3: mean = (0 + 1) / 2 = 0.5; deviations -0.5, +0.5;
#          unbiased var = (0.25 + 0.25) / (2 - 1) = 0.5, std = sqrt(0.5)
SQRT7, SQRT_HALF = 2.6457513110645906, 0.7071067811865476
GRPO_ROW = [-2 / (SQRT7 + EPS), -0.5 / (SQRT_HALF + EPS), -1 / (SQRT7 + EPS), 3 / (SQRT7 + EPS), 0.5 / (SQRT_HALF + EPS)]
DR_GRPO_ROW = [-2.0, -0.5, -1.0, 3.0, 0.5]

# RLOO: A_i = r_i - mean of the *other* members of the group
#   group 7: 1 - (2 + 6) / 2 = -3;  2 - (1 + 6) / 2 = -1.5;  6 - (1 + 2) / 2 = 4.5
#   group 3: 0 - 1 = -1;  1 - 0 = 1
RLOO_ROW = [-3.0, -1.0, -1.5, 4.5, 1.0]


def estimate(name: str, rewards, group, mask, params: AdvParams) -> torch.Tensor:
    """Advantages [B, T] of a registered estimator from [B] sequence rewards (new AdvInputs API)."""
    inputs = AdvInputs(sequence_rewards_to_tokens(rewards, mask), mask, group)
    return ADV_ESTIMATORS.get(name).fn(inputs, params).advantages


def broadcast(per_row: list[float], lengths: list[int], width: int) -> list[list[float]]:
    return [[v] * n + [0.0] * (width - n) for v, n in zip(per_row, lengths)]


def test_grpo_normalised_by_group_std_on_masked_tokens_only():
    adv = estimate("grpo", REWARDS, GROUP, MASK, AdvParams(norm_adv_by_std=True))
    close(adv, broadcast(GRPO_ROW, LENGTHS, 4))
    # spot values, rounded by hand: -2/sqrt(7) = -0.75593, 3/sqrt(7) = 1.13389, 0.5/sqrt(0.5) = 0.70711
    assert adv[0, 0].item() == pytest.approx(-0.75593, abs=1e-5)
    assert adv[2, 3].item() == pytest.approx(-0.37796, abs=1e-5)
    assert adv[4, 1].item() == pytest.approx(0.70711, abs=1e-5)
    assert adv[1, 1:].abs().sum() == 0 and adv[3, 2:].abs().sum() == 0  # padding


@pytest.mark.parametrize("norm", [True, False])
def test_empty_response_has_score_zero(norm):
    # rewards 1, 2, 6 in one group, but row 2 is empty: sequence_rewards_to_tokens cannot place
    # its 6 anywhere, so the estimator sees scores 1, 2, 0: mean 1, deviations 0, +1, -1,
    # unbiased var (0 + 1 + 1) / 2 = 1, std 1. The empty row's advantages are all zero.
    mask = lengths_mask([2, 2, 0], 3)
    adv = estimate("grpo", torch.tensor([1.0, 2.0, 6.0]), torch.tensor([0, 0, 0]), mask, AdvParams(norm_adv_by_std=norm))
    one = 1 / (1 + EPS) if norm else 1.0
    close(adv, [[0.0, 0.0, 0.0], [one, one, 0.0], [0.0, 0.0, 0.0]])


def test_dr_grpo_without_std_is_reward_minus_group_mean():
    adv = estimate("grpo", REWARDS, GROUP, MASK, AdvParams(norm_adv_by_std=False))
    close(adv, broadcast(DR_GRPO_ROW, LENGTHS, 4))


def test_grpo_integer_rewards_and_float_mask_dtype():
    adv = estimate("grpo", REWARDS.long(), GROUP, MASK, AdvParams(norm_adv_by_std=False))
    assert adv.dtype == torch.float32
    close(adv, broadcast(DR_GRPO_ROW, LENGTHS, 4))


@pytest.mark.parametrize("name", ["grpo", "rloo"])
@pytest.mark.parametrize("norm", [True, False])
def test_single_member_group_has_zero_advantage(name, norm):
    # row 2 is alone in group 9; rows 0 and 1 form group 4: rewards 3 and 5
    rewards = torch.tensor([3.0, 5.0, 100.0])
    group = torch.tensor([4, 4, 9])
    mask = torch.ones(3, 2)
    adv = estimate(name, rewards, group, mask, AdvParams(norm_adv_by_std=norm))
    assert torch.isfinite(adv).all()
    assert adv[2].abs().sum().item() == 0.0
    alone = estimate(name, torch.tensor([4.0]), torch.tensor([0]), torch.ones(1, 3), AdvParams(norm))
    assert alone.abs().sum().item() == 0.0 and torch.isfinite(alone).all()
    # the pair: mean 4, deviations -1 / +1, std = sqrt((1 + 1) / 1) = sqrt(2)
    expected = {
        ("grpo", True): [-1 / (math.sqrt(2) + EPS), 1 / (math.sqrt(2) + EPS)],
        ("grpo", False): [-1.0, 1.0],
        ("rloo", True): [3.0 - 5.0, 5.0 - 3.0],  # RLOO ignores the std flag
        ("rloo", False): [-2.0, 2.0],
    }[(name, norm)]
    close(adv[:2, 0], expected)


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_with_equal_rewards_has_zero_finite_advantage(name):
    rewards = torch.tensor([0.7, 0.7, 0.7, 0.2, 0.9])
    group = torch.tensor([0, 0, 0, 1, 1])
    adv = estimate(name, rewards, group, torch.ones(5, 3), AdvParams(norm_adv_by_std=True))
    assert torch.isfinite(adv).all()
    assert adv[:3].abs().max().item() < 1e-6  # std 0: 0 / (0 + eps), not 0 / 0
    assert adv[3:].abs().min().item() > 0.1


def test_rloo_leave_one_out_values():
    adv = estimate("rloo", REWARDS, GROUP, MASK, AdvParams())
    close(adv, broadcast(RLOO_ROW, LENGTHS, 4), atol=1e-5)


def test_estimators_declare_that_they_need_groups():
    assert ADV_ESTIMATORS.get("grpo").needs_group and ADV_ESTIMATORS.get("rloo").needs_group


def test_estimator_registry_flags():
    flags = {n: ADV_ESTIMATORS.get(n) for n in ADV_ESTIMATORS.names()}
    assert sorted(flags) == [
        "gae", "gpg", "grpo", "grpo_passk", "opo", "optimal_token_baseline", "reinforce_plus_plus",
        "reinforce_plus_plus_baseline", "remax", "rloo", "tir_optimal_token_baseline",
    ]  # fmt: skip
    for name in ("opo", "gpg", "grpo_passk", "optimal_token_baseline", "tir_optimal_token_baseline"):
        assert flags[name].needs_group and not (flags[name].needs_critic or flags[name].needs_baseline), name
    assert [n for n, f in flags.items() if f.needs_sum_pi_squared] == ["optimal_token_baseline", "tir_optimal_token_baseline"]
    assert flags["gae"].needs_critic and not flags["gae"].needs_group and not flags["gae"].needs_baseline
    assert flags["remax"].needs_baseline and not flags["remax"].needs_critic and not flags["remax"].needs_group
    assert flags["reinforce_plus_plus_baseline"].needs_group and not flags["reinforce_plus_plus_baseline"].needs_critic
    rpp = flags["reinforce_plus_plus"]
    assert not (rpp.needs_group or rpp.needs_critic or rpp.needs_baseline)


# --------------------------------------------------------------------------- whitening and returns


def whiten_by_hand(values: list[float]) -> list[float]:
    """(x - mean) / sqrt(unbiased var + 1e-8), with the sums written out (no torch)."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return [(v - mean) / math.sqrt(var + WEPS) for v in values]


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


def test_masked_whiten_shows_nan_on_real_tokens():
    out = masked_whiten(torch.tensor([[1.0, float("nan")]]), torch.ones(1, 2))
    assert torch.isnan(out).all()


def test_discounted_returns_run_across_holes_and_ignore_padding():
    rewards = torch.tensor([[1.0, 5.0, 1.0, 7.0], [0.0, 0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    # row 0: the hole at t=1 (tool output, its 5 ignored) is skipped, not a reset, and not a
    #        discount step: G_2 = 1, G_0 = 1 + 0.5 * 1 = 1.5; the 7 on padding is ignored
    # row 1: gamma 0.5: G_2 = 2, G_1 = 0 + 0.5 * 2 = 1, G_0 = 0.5
    close(discounted_returns(rewards, mask, 0.5), [[1.5, 0.0, 1.0, 0.0], [0.5, 1.0, 2.0, 0.0]])


# ------------------------------------------------- token-level estimators: GAE, REINFORCE++, ReMax

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
    inputs = AdvInputs(
        rewards,
        mask,
        torch.tensor([0, 0, 1]),
        values=torch.full((3, 2), float("nan")).masked_fill(mask.bool(), 0.5),
        baseline_rewards=torch.zeros(3),
    )
    out = ADV_ESTIMATORS.get(name).fn(inputs, AdvParams())
    assert finite(out.advantages, out.returns)
    assert out.advantages[1].abs().sum().item() == 0.0 and out.advantages[:, 1].abs().sum().item() == 0.0
    # the NaN on padding must not silently zero the real tokens either: rows 0 and 2 differ
    if name != "remax":  # (remax with baseline 0: A = G = 1e6 and 3)
        assert out.advantages[0, 0].item() != 0.0 and out.advantages[2, 0].item() != 0.0
    else:
        close(out.advantages[:, 0], [1e6, 0.0, 3.0])
