"""KL estimators, aliases and straight-through variants, KL in the reward and the adaptive KL controller, by hand."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from ratchet.algorithms import KL_ESTIMATORS
from ratchet.algorithms.kl import AdaptiveKLController, apply_kl_in_reward, kl_penalty

from ...tensor_checks import close, lengths_mask
from .helpers import finite

torch.set_num_threads(1)


# -------------------------------------------------------------------------------------- estimators

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
    # straight-through "+" variant of each name (tested below)
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


# -------------------------------------------------------------------- aliases and straight-through

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


# ----------------------------------------------------------- KL in the reward, adaptive controller


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
