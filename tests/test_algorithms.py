"""ratchet.algorithms against values worked out by hand.

Every expected number below is written out as arithmetic on the inputs, not obtained by
calling the formula under test a second time.
"""

from __future__ import annotations

import importlib
import inspect
import math

import pytest
import torch

import ratchet.algorithms as algorithms
from ratchet.algorithms import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    OFF_POLICY,
    POLICY_LOSSES,
    AdvEstimator,
    AdvInputs,
    AdvParams,
    LossParams,
    Normaliser,
    kl_penalty,
    masked_mean,
    register_adv_estimator,
    register_kl,
    register_loss_agg,
    register_policy_loss,
    sequence_rewards_to_tokens,
)
from ratchet.algorithms.registry import Registry, decorator

from .tensor_checks import close, lengths_mask

torch.set_num_threads(1)

EPS = 1e-6  # AdvParams.epsilon


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


# --------------------------------------------------------------------------- advantages


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


# --------------------------------------------------------------------------- PPO clip


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


# --------------------------------------------------------------------------- aggregation

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
AGG_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
# masked sum = 1 + 2 + 4 = 7; 3 tokens; 2 sequences
AGG_NORM = Normaliser(tokens=3.0, sequences=2.0, max_response_length=3)
AGG_EXPECTED = {
    "token-mean": 7 / 3,
    "seq-mean-token-sum": 7 / 2,
    "seq-mean-token-mean": ((1 + 2) / 2 + 4 / 1) / 2,  # 2.75
    "seq-mean-token-sum-norm": 7 / (2 * 3),
}


def test_all_aggregation_modes_registered():
    assert LOSS_AGGREGATIONS.names() == sorted(AGG_EXPECTED)


@pytest.mark.parametrize("mode", sorted(AGG_EXPECTED))
def test_aggregation_by_hand(mode):
    value = LOSS_AGGREGATIONS.get(mode)(LOSS, AGG_MASK, AGG_NORM)
    assert value.item() == pytest.approx(AGG_EXPECTED[mode], abs=1e-6)


def test_seq_mean_token_mean_empty_response_contributes_zero():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    value = LOSS_AGGREGATIONS.get("seq-mean-token-mean")(LOSS, mask, Normaliser(tokens=2, sequences=2))
    assert value.item() == pytest.approx(((1 + 2) / 2 + 0) / 2)  # 0.75
    assert math.isfinite(value.item())


def test_aggregation_empty_batch_is_zero_not_nan():
    mask = torch.zeros(2, 3)
    for mode in AGG_EXPECTED:
        value = LOSS_AGGREGATIONS.get(mode)(LOSS, mask, Normaliser(tokens=0, sequences=0, max_response_length=3))
        assert value.item() == 0.0, mode


# A 4-row batch whose halves have very different token counts (5 and 1 tokens): averaging
# per micro-batch would weigh the short half's token 5x more.
BIG_LOSS = torch.tensor(
    [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [10.0, 11.0, 12.0]]
)
BIG_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
# full batch: tokens 6, sequences 4; masked sum 1+2+3+4+5+7 = 22
BIG_NORM = Normaliser(tokens=6.0, sequences=4.0, max_response_length=3)
BIG_EXPECTED = {
    "token-mean": 22 / 6,
    "seq-mean-token-sum": 22 / 4,
    "seq-mean-token-mean": ((1 + 2 + 3) / 3 + (4 + 5) / 2 + 7 / 1 + 0) / 4,  # (2 + 4.5 + 7) / 4 = 3.375
    "seq-mean-token-sum-norm": 22 / (4 * 3),
}


@pytest.mark.parametrize("mode", sorted(BIG_EXPECTED))
def test_global_normaliser_makes_micro_batches_sum_to_full_batch(mode):
    agg = LOSS_AGGREGATIONS.get(mode)
    full = agg(BIG_LOSS, BIG_MASK, BIG_NORM)
    halves = agg(BIG_LOSS[:2], BIG_MASK[:2], BIG_NORM) + agg(BIG_LOSS[2:], BIG_MASK[2:], BIG_NORM)
    assert full.item() == pytest.approx(BIG_EXPECTED[mode], abs=1e-6)
    assert halves.item() == pytest.approx(BIG_EXPECTED[mode], abs=1e-6)
    # strided split (how trainer ranks take rows) is the same
    strided = agg(BIG_LOSS[0::2], BIG_MASK[0::2], BIG_NORM) + agg(BIG_LOSS[1::2], BIG_MASK[1::2], BIG_NORM)
    assert strided.item() == pytest.approx(BIG_EXPECTED[mode], abs=1e-6)


def test_local_token_mean_would_differ_which_is_why_the_normaliser_is_global():
    # halves with local normalisers: (1+2+3+4+5)/5 = 3 and 7/1 = 7; mean 5 != 22/6
    agg = LOSS_AGGREGATIONS.get("token-mean")
    local = (agg(BIG_LOSS[:2], BIG_MASK[:2], Normaliser(5, 2)) + agg(BIG_LOSS[2:], BIG_MASK[2:], Normaliser(1, 2))) / 2
    assert local.item() == pytest.approx(5.0)
    assert local.item() != pytest.approx(22 / 6)


@pytest.mark.parametrize("mode", sorted(BIG_EXPECTED))
def test_global_normaliser_makes_micro_batch_gradients_sum_to_full_batch(mode):
    agg = LOSS_AGGREGATIONS.get(mode)
    # loss_ij = w_j * x_ij**2, a parameter shared by all rows
    x = BIG_LOSS / 4

    def grad(rows_list):
        w = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
        for rows in rows_list:
            agg(w * x[rows].square(), BIG_MASK[rows], BIG_NORM).backward()
        return w.grad.clone()

    full = grad([slice(0, 4)])
    accumulated = grad([slice(0, 2), slice(2, 4)])
    torch.testing.assert_close(accumulated, full, atol=1e-6, rtol=0)
    if mode == "token-mean":
        # d/dw_j = sum over masked tokens of column j of x^2 / 6
        # x = loss / 4: col 0 masked rows 0,1,2 -> (1 + 16 + 49) / 16 = 66 / 16
        #               col 1 masked rows 0,1   -> (4 + 25) / 16 = 29 / 16
        #               col 2 masked row 0      -> 9 / 16
        close(full, [66 / 16 / 6, 29 / 16 / 6, 9 / 16 / 6], atol=1e-6)


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    assert masked_mean(x, mask).item() == pytest.approx((1 + 3 + 4) / 3)
    assert masked_mean(x, torch.zeros(2, 2)).item() == 0.0


# --------------------------------------------------------------------------- KL

LOGPROB = torch.tensor([-1.0, -2.0, -0.5, -0.3])
REF = torch.tensor([-1.5, -1.0, -0.5, 1.7])
# r = ref - logprob = [-0.5, 1.0, 0.0, 2.0]
KL_EXPECTED = {
    "k1": [0.5, -1.0, 0.0, -2.0],  # logprob - ref = -r
    "abs": [0.5, 1.0, 0.0, 2.0],
    "mse": [0.125, 0.5, 0.0, 2.0],  # r^2 / 2
    # exp(r) - r - 1: e^-0.5 + 0.5 - 1 = 0.6065306597 - 0.5; e - 2; 0; e^2 - 3
    "low_var_kl": [0.1065306597, 0.7182818285, 0.0, 4.3890560989],
}


def test_all_kl_estimators_registered():
    # the four estimators, the aliases k2 (= mse) and k3 (= low_var_kl), and a
    # straight-through "+" variant of each name (tests/test_algorithms_extended.py)
    names = set(KL_EXPECTED) | {"k2", "k3"}
    assert KL_ESTIMATORS.names() == sorted(names | {n + "+" for n in names})


@pytest.mark.parametrize("kind", sorted(KL_EXPECTED))
def test_kl_estimators_by_hand(kind):
    close(kl_penalty(kind, LOGPROB, REF), KL_EXPECTED[kind], atol=1e-6)
    close(KL_ESTIMATORS.get(kind)(LOGPROB, REF), KL_EXPECTED[kind], atol=1e-6)


def test_low_var_kl_is_clamped_and_finite_for_extreme_inputs():
    logprob = torch.tensor([0.0, -1000.0, 0.0, -1e30, 0.0], requires_grad=True)
    ref = torch.tensor([-1000.0, 0.0, 3.0, 0.0, -3.0])
    # r = -1000 -> clamped to -20: e^-20 + 20 - 1 = 19.000000002 -> clamped to 10
    # r = +1000 -> clamped to 20: e^20 - 21 -> 10;  r = 3: e^3 - 4 = 16.09 -> 10
    # r = 1e30 -> 10;  r = -3: e^-3 + 3 - 1 = 2.0497870684 (inside the clamp)
    kl = kl_penalty("low_var_kl", logprob, ref)
    close(kl, [10.0, 10.0, 10.0, 10.0, 2.0497870684], atol=1e-6)
    kl.sum().backward()
    assert torch.isfinite(logprob.grad).all()
    assert (kl >= 0).all()


def test_low_var_kl_is_non_negative():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    assert (kl_penalty("low_var_kl", a, b) >= 0).all()


# --------------------------------------------------------------------------- registries


@pytest.mark.parametrize(
    ("registry", "known"),
    [
        (ADV_ESTIMATORS, ["grpo", "rloo"]),
        (POLICY_LOSSES, ["ppo_clip"]),
        (LOSS_AGGREGATIONS, ["seq-mean-token-mean", "token-mean"]),
        (KL_ESTIMATORS, ["k1", "low_var_kl"]),
    ],
)
def test_unknown_name_lists_registered_names(registry, known):
    for name in known:
        assert registry.check(name) == name
    with pytest.raises(ValueError) as err:
        registry.get("no-such-thing")
    msg = str(err.value)
    assert "no-such-thing" in msg and registry.kind in msg
    for name in registry.names():
        assert name in msg


def test_double_registration_is_rejected_and_keeps_the_first():
    before = ADV_ESTIMATORS.get("grpo")
    with pytest.raises(ValueError, match="registered twice"):
        register_adv_estimator("grpo", needs_group=False)(lambda *a: None)
    for register, name in [
        (register_policy_loss, "ppo_clip"),
        (register_loss_agg, "token-mean"),
        (register_kl, "k1"),
    ]:
        with pytest.raises(ValueError, match="registered twice"):
            register(name)(lambda *a: None)
    assert ADV_ESTIMATORS.get("grpo") is before


def test_fresh_registry_and_decorator():
    reg: Registry = Registry("widget")
    assert reg.names() == []

    @decorator(reg, "b")
    def b():
        return "b"

    def a():
        return "a"

    decorator(reg, "a", wrap=lambda fn: ("wrapped", fn))(a)
    assert b() == "b"  # the decorator returns the function unchanged
    assert reg.get("b") is b and reg.get("a") == ("wrapped", a)
    assert reg.names() == ["a", "b"]
    with pytest.raises(ValueError, match=r"unknown widget 'c'; registered: a, b"):
        reg.get("c")
    with pytest.raises(ValueError, match="widget 'a' is registered twice"):
        reg.register("a", 1)
    reg.register("c", "math:sqrt")  # a "module:attribute" entry is imported on first get
    assert reg.get("c") is math.sqrt and reg.names() == ["a", "b", "c"]


# Each kind's implementations, recognised by their parameters: a function with this signature
# in the module is an implementation, and must be listed in catalog.py (and vice versa).
IMPLEMENTATIONS = {
    "advantage estimator": ("ratchet.algorithms.advantages", ["inputs", "params"]),
    "policy loss": ("ratchet.algorithms.policy_losses", ["logprob", "old_logprob", "advantages", "mask", "params"]),
    "loss aggregation": ("ratchet.algorithms.aggregation", ["loss", "mask", "norm"]),
    "KL estimator": ("ratchet.algorithms.kl", ["logprob", "ref_logprob"]),
    "off-policy correction": ("ratchet.algorithms.off_policy", ["log_w", "keep", "cap"]),
}


@pytest.mark.parametrize("registry", [ADV_ESTIMATORS, POLICY_LOSSES, LOSS_AGGREGATIONS, KL_ESTIMATORS, OFF_POLICY])
def test_catalog_matches_implementations(registry):
    """The catalog's "module:function" entries and the functions in the modules are the
    same set: neither a misspelt entry nor an implementation missing from the catalog."""
    module_name, params = IMPLEMENTATIONS[registry.kind]
    module = importlib.import_module(module_name)
    implemented = {
        name
        for name, fn in vars(module).items()
        if inspect.isfunction(fn) and list(inspect.signature(fn).parameters) == params
    }
    targets = {name: entry.impl if isinstance(entry, AdvEstimator) else entry for name, entry in registry.entries.items()}
    assert all(isinstance(t, str) and t.startswith(module_name + ":") for t in targets.values()), targets
    assert {t.split(":")[1] for t in targets.values()} == implemented
    for name, target in targets.items():
        entry = registry.get(name)
        assert getattr(entry, "fn", entry) is getattr(module, target.split(":")[1])


def test_every_exported_name_resolves():
    # The package imports its torch-backed names on first use, from a table of module names.
    for name in algorithms.__all__:
        assert getattr(algorithms, name) is not None, name

