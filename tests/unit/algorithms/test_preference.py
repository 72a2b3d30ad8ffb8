"""Preference losses (DPO sigmoid, IPO, SimPO) and the SFT loss: hand-worked numbers,
gradients against the analytic ones, degenerate cases, and the catalog entries."""

from __future__ import annotations

import importlib
import inspect
import math

import pytest
import torch

from ratchet.catalog.algorithms import PREFERENCE_LOSSES
from ratchet.algorithms.preference import PrefInputs, PrefParams, dpo_sigmoid, ipo, preference_metrics, simpo
from ratchet.algorithms.sft import sequence_logprobs, sft_loss, token_logprobs

torch.set_num_threads(1)


def _t(*values: float, grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def _softplus(x: float) -> float:  # -log sigmoid(-x)
    return math.log1p(math.exp(x))


def test_dpo_sigmoid_by_hand():
    # h = (-1 - -3) - (-2 - -2) = 2; beta h = 1; loss = -log sigmoid(1) = log(1 + e^-1).
    c, r = _t(-1.0, grad=True), _t(-3.0, grad=True)
    inp = PrefInputs(c, r, _t(2.0), _t(2.0), _t(-2.0), _t(-2.0))
    out = dpo_sigmoid(inp, PrefParams(beta=0.5))
    assert out.losses.item() == pytest.approx(_softplus(-1.0))
    assert out.chosen_rewards.item() == pytest.approx(0.5) and out.rejected_rewards.item() == pytest.approx(-0.5)
    out.losses.sum().backward()
    # d/dh -log sigmoid(beta h) = -beta (1 - sigmoid(beta h)); dh/dc = 1, dh/dr = -1.
    g = -0.5 * (1 - 1 / (1 + math.exp(-1.0)))
    assert c.grad.item() == pytest.approx(g) and r.grad.item() == pytest.approx(-g)


def test_dpo_label_smoothing_is_conservative_dpo():
    inp = PrefInputs(_t(-1.0), _t(-3.0), _t(2.0), _t(2.0), _t(-2.0), _t(-2.0))
    out = dpo_sigmoid(inp, PrefParams(beta=0.5, label_smoothing=0.1))
    assert out.losses.item() == pytest.approx(0.9 * _softplus(-1.0) + 0.1 * _softplus(1.0))


def test_ipo_by_hand_uses_per_token_log_probs():
    # Averages: chosen -2/2 = -1, rejected -6/3 = -2, ref -1 and -1: h = 1; 1/(2 beta) = 2.
    c, r = _t(-2.0, grad=True), _t(-6.0, grad=True)
    inp = PrefInputs(c, r, _t(2.0), _t(3.0), _t(-2.0), _t(-3.0))
    out = ipo(inp, PrefParams(beta=0.25))
    assert out.losses.item() == pytest.approx(1.0)
    out.losses.sum().backward()
    # dloss/dh = 2 (h - 2) = -2; dh/dc_sum = 1/2, dh/dr_sum = -1/3.
    assert c.grad.item() == pytest.approx(-1.0) and r.grad.item() == pytest.approx(2 / 3)
    assert out.chosen_rewards.item() == pytest.approx(0.0) and out.rejected_rewards.item() == pytest.approx(0.25 * -1.0)


def test_simpo_by_hand_needs_no_reference():
    # Averages -1 and -2; h = 1 - gamma/beta = 1 - 1/2; beta h = 1.
    c, r = _t(-2.0, grad=True), _t(-6.0, grad=True)
    out = simpo(PrefInputs(c, r, _t(2.0), _t(3.0)), PrefParams(beta=2.0, simpo_gamma=1.0))
    assert out.losses.item() == pytest.approx(_softplus(-1.0))
    assert out.chosen_rewards.item() == pytest.approx(-2.0) and out.rejected_rewards.item() == pytest.approx(-4.0)
    out.losses.sum().backward()
    g = -2.0 * (1 - 1 / (1 + math.exp(-1.0)))
    assert c.grad.item() == pytest.approx(g / 2) and r.grad.item() == pytest.approx(-g / 3)


@pytest.mark.parametrize("fn", [dpo_sigmoid, ipo, simpo])
def test_gradient_matches_finite_differences(fn):
    torch.manual_seed(0)
    c, r = torch.randn(5, dtype=torch.float64) - 3, torch.randn(5, dtype=torch.float64) - 3
    nc, nr = torch.tensor([1.0, 2, 3, 4, 5], dtype=torch.float64), torch.tensor([2.0, 2, 1, 3, 6], dtype=torch.float64)
    rc, rr = torch.randn(5, dtype=torch.float64) - 3, torch.randn(5, dtype=torch.float64) - 3
    p = PrefParams(beta=0.3, label_smoothing=0.05, simpo_gamma=0.4)

    def f(cc, rj):
        return fn(PrefInputs(cc, rj, nc, nr, rc, rr), p).losses.sum()

    assert torch.autograd.gradcheck(f, (c.requires_grad_(), r.requires_grad_()))


@pytest.mark.parametrize("fn", [dpo_sigmoid, simpo])
def test_all_equal_pairs_give_log_two(fn):
    # Chosen and rejected alike (and the reference alike): DPO's loss is log 2; SimPO with
    # gamma 0 too. Accuracy 0 (ties are not wins), margin 0.
    x = _t(-2.0, -2.0)
    out = fn(PrefInputs(x, x.clone(), _t(2.0, 2.0), _t(2.0, 2.0), x.clone(), x.clone()), PrefParams(beta=0.1, simpo_gamma=0.0))
    assert out.losses.tolist() == pytest.approx([math.log(2)] * 2)
    m = preference_metrics(out)
    assert m["reward_accuracy"] == 0.0 and m["reward_margin"] == pytest.approx(0.0)


def test_empty_completion_is_finite():
    # A completion with no loss tokens (mask all 0): averages count it as one token, not NaN.
    out = ipo(PrefInputs(_t(0.0), _t(-1.0), _t(0.0), _t(1.0), _t(0.0), _t(0.0)), PrefParams(beta=0.5))
    assert torch.isfinite(out.losses).all()
    out = simpo(PrefInputs(_t(0.0), _t(0.0), _t(0.0), _t(0.0)), PrefParams())
    assert torch.isfinite(out.losses).all()


def test_reference_losses_refuse_a_missing_reference():
    with pytest.raises(ValueError, match="reference"):
        dpo_sigmoid(PrefInputs(_t(0.0), _t(0.0), _t(1.0), _t(1.0)), PrefParams())


def test_metrics_accuracy_and_margin():
    inp = PrefInputs(_t(-1.0, -4.0), _t(-3.0, -2.0), _t(1.0, 1.0), _t(1.0, 1.0), _t(-2.0, -2.0), _t(-2.0, -2.0))
    m = preference_metrics(dpo_sigmoid(inp, PrefParams(beta=1.0)))
    # rewards: chosen (1, -2), rejected (-1, 0): one win of two; margins 2 and -2.
    assert m["reward_accuracy"] == 0.5 and m["reward_margin"] == pytest.approx(0.0)
    assert m["rewards_chosen"] == pytest.approx(-0.5) and m["rewards_rejected"] == pytest.approx(-0.5)


def test_catalog_lists_every_preference_loss():
    module = importlib.import_module("ratchet.algorithms.preference")
    implemented = {n for n, f in vars(module).items() if inspect.isfunction(f) and list(inspect.signature(f).parameters) == ["inp", "p"]}
    assert {e.impl.split(":")[1] for e in PREFERENCE_LOSSES.entries.values()} == implemented
    assert PREFERENCE_LOSSES.get("sigmoid").fn is dpo_sigmoid
    assert not PREFERENCE_LOSSES.get("simpo").needs_reference and PREFERENCE_LOSSES.get("ipo").needs_reference


# --------------------------------------------------------------------------- SFT


def test_token_logprobs_by_hand():
    # Two tokens, vocabulary of 2; logits at position 0 predict token 1: log softmax([0, ln 3]) = ln(3/4).
    logits = torch.tensor([[[0.0, math.log(3)], [5.0, 5.0]]])
    lp = token_logprobs(logits, torch.tensor([[0, 1]]))
    assert lp.tolist()[0] == pytest.approx([0.0, math.log(0.75)])


def test_sft_loss_masks_holes_and_uses_the_global_normaliser():
    lp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 0], [0, 1]])  # holes: the second and third tokens are not trained
    loss = sft_loss(lp, mask)
    assert loss.item() == pytest.approx((1 + 4) / 2)
    loss.backward()
    assert lp.grad.tolist() == [[-0.5, 0.0], [0.0, -0.5]]  # d/d lp = -mask / n
    # Micro-batches each divided by the batch's token count add up to the batch mean.
    parts = sft_loss(lp[:1], mask[:1], normaliser=2) + sft_loss(lp[1:], mask[1:], normaliser=2)
    assert parts.item() == pytest.approx(loss.item())


def test_sft_loss_of_an_empty_mask_is_zero():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss = sft_loss(lp, torch.zeros(1, 2))
    loss.backward()
    assert loss.item() == 0.0 and lp.grad.abs().sum().item() == 0.0


def test_sequence_logprobs_sum_masked_tokens():
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    total, count = sequence_logprobs(lp, torch.tensor([[0, 1, 1]]))
    assert total.item() == -5.0 and count.item() == 2
