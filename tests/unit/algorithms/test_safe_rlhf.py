"""Safe-RLHF: the Lagrange multiplier's update and the mixed advantage, by hand and by
gradient (algorithms/safe_rlhf.py), and the trainer's estimator wrapper (workers/safety.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from ratchet.algorithms.advantages import AdvInputs, AdvParams, sequence_rewards_to_tokens
from ratchet.algorithms.policy_losses import LossParams
from ratchet.algorithms.advantages import grpo
from ratchet.algorithms.policy_losses import ppo_clip
from ratchet.algorithms.safe_rlhf import combined_advantages, lagrange_update, lagrangian_lambda_loss

from ...tensor_checks import close

torch.set_num_threads(1)


# --------------------------------------------------------------------------- the multiplier


def test_projected_update_by_hand():
    assert lagrange_update(0.5, 0.3, 0.1, 2.0) == pytest.approx(0.9)  # over budget: up by lr * 0.2
    assert lagrange_update(0.5, 0.0, 0.2, 1.0) == pytest.approx(0.3)  # under budget: down by lr * 0.2
    assert lagrange_update(0.1, 0.0, 0.2, 1.0) == 0.0  # projected onto lambda >= 0
    assert lagrange_update(0.0, 0.0, 0.2, 1.0) == 0.0
    assert lagrange_update(0.5, 1.0, 0.0, 10.0, lam_max=2.0) == 2.0  # clamped at lambda_max
    assert lagrange_update(0.7, 0.4, 0.4, 5.0) == pytest.approx(0.7)  # on budget: unchanged
    assert lagrange_update(0.7, 3.0, 0.0, 0.0) == pytest.approx(0.7)  # lr 0: fixed


def test_log_update_by_hand():
    # log lambda += lr * (J_C - d) * lambda: 0.5 * exp(2 * 0.2 * 0.5)
    assert lagrange_update(0.5, 0.3, 0.1, 2.0, mode="log") == pytest.approx(0.5 * math.exp(0.2))
    assert lagrange_update(0.5, 0.0, 0.2, 1.0, mode="log") == pytest.approx(0.5 * math.exp(-0.1))
    assert lagrange_update(0.5, 1.0, 0.0, 10.0, mode="log", lam_max=1.5) == 1.5
    assert lagrange_update(0.0, 1.0, 0.0, 1.0, mode="log") == 0.0  # log 0: stays
    assert lagrange_update(1e-3, 0.0, 1.0, 1.0, mode="log") > 0  # never reaches 0
    assert math.isfinite(lagrange_update(1e3, 1e3, 0.0, 1.0, mode="log"))  # overflow guarded


@pytest.mark.parametrize("mode", ["projected", "log"])
def test_update_is_one_sgd_step_on_the_lagrangian(mode):
    """safe-rlhf steps log lambda with SGD on -(J_C - d) exp(log lambda); `lagrange_update`
    is that step (and the same for lambda itself, before projection)."""
    for lam, cost, budget, lr in [(0.5, 0.3, 0.1, 2.0), (1.2, 0.05, 0.2, 0.7), (0.3, 0.9, 0.9, 1.0)]:
        param = torch.tensor(math.log(lam) if mode == "log" else lam, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.SGD([param], lr=lr)
        loss = lagrangian_lambda_loss(param, cost, budget, mode=mode)
        loss.backward()
        analytic = -(cost - budget) * (lam if mode == "log" else 1.0)
        assert param.grad.item() == pytest.approx(analytic)
        opt.step()
        stepped = param.exp().item() if mode == "log" else param.item()
        assert lagrange_update(lam, cost, budget, lr, mode=mode) == pytest.approx(max(0.0, stepped))


def test_update_refuses_bad_numbers():
    with pytest.raises(ValueError, match="finite"):
        lagrange_update(0.5, float("nan"), 0.0, 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        lagrange_update(-0.1, 0.5, 0.0, 1.0)
    with pytest.raises(ValueError, match="unknown multiplier update"):
        lagrange_update(0.5, 0.5, 0.0, 1.0, mode="dual")


# --------------------------------------------------------------------------- the mixed advantage


def test_combined_advantages_by_hand():
    a_r, a_c = torch.tensor([1.0, -1.0, 0.0]), torch.tensor([0.5, 2.0, -1.0])
    close(combined_advantages(a_r, a_c, 1.0), [0.25, -1.5, 0.5])  # (A_r - A_c) / 2
    close(combined_advantages(a_r, a_c, 0.0), a_r)  # no multiplier: the reward's advantage
    close(combined_advantages(a_r, a_c, 1e6), -a_c, atol=1e-5)  # a huge one: minus the cost's
    with pytest.raises(ValueError):
        combined_advantages(a_r, a_c, -1.0)


def test_policy_gradient_of_the_mix_is_the_mix_of_gradients():
    """On the PPO loss at ratio 1, d loss / d logprob = -A per token; with the mixed
    advantage that is (g_r - lambda g_c) / (1 + lambda), autograd against the formula."""
    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])  # a hole in row 1
    a_r, a_c, lam = torch.randn(2, 3) * mask, torch.randn(2, 3) * mask, 0.6
    old = torch.randn(2, 3)

    def grad(adv):
        logprob = old.clone().requires_grad_(True)
        out = ppo_clip(logprob, old, adv, mask, LossParams())
        (out.loss * mask).sum().backward()
        return logprob.grad

    g = grad(combined_advantages(a_r, a_c, lam))
    close(g, -(a_r - lam * a_c) / (1 + lam) * mask)
    close(g, (grad(a_r) - lam * grad(a_c)) / (1 + lam))


# --------------------------------------------------------------------------- the trainer's estimator wrapper


def _safety(**kw):
    base = dict(budget=0.25, lambda_lr=1.0, lambda_update="projected", lambda_max=None, lambda_init=1.0, enabled=True)
    return SimpleNamespace(**{**base, **kw})


def test_safe_estimator_by_hand():
    from ratchet.workers.safety import SafeRLHFEstimator

    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])  # row 3: a hole first
    rewards, costs = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([1.0, 0.0, 0.0, 1.0])
    group = torch.tensor([0, 0, 1, 1])
    est = SafeRLHFEstimator(grpo, costs, 0.5, _safety())
    out = est(AdvInputs(sequence_rewards_to_tokens(rewards, mask), mask, group), AdvParams())
    # mean cost 0.5 > budget 0.25: lambda 0.5 + 0.25 = 0.75, used for this update already
    assert est.lam == pytest.approx(0.75)
    s = 0.5 / math.sqrt(0.5)  # GRPO of a (1, 0) pair: +-0.5 / std 0.7071
    a_r = torch.tensor([s, -s, 0.0, 0.0])
    a_c = torch.tensor([s, -s, -s, s])
    expected = ((a_r - 0.75 * a_c) / 1.75).unsqueeze(-1) * mask
    close(out.advantages, expected, atol=1e-5)
    assert est.metrics["safe/lambda"] == pytest.approx(0.75)
    assert est.metrics["safe/cost_mean"] == pytest.approx(0.5)
    assert est.metrics["safe/cost_budget_violation"] == pytest.approx(0.25)


def test_safe_estimator_degenerate_cases():
    from ratchet.workers.safety import SafeRLHFEstimator

    # all costs equal: the cost's advantage is 0, the mix is A_r / (1 + lambda)
    mask = torch.ones(4, 2)
    rewards, group = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 2])  # groups of one: 1, 2
    est = SafeRLHFEstimator(grpo, torch.full((4,), 0.1), 1.0, _safety(budget=0.1))
    inputs = AdvInputs(sequence_rewards_to_tokens(rewards, mask), mask, group)
    out = est(inputs, AdvParams())
    close(out.advantages, grpo(inputs, AdvParams()).advantages / 2.0, atol=1e-6)
    assert out.advantages[2:].abs().sum() == 0  # groups of one
    # an empty mask: advantage 0, finite
    empty = torch.zeros(2, 3)
    est = SafeRLHFEstimator(grpo, torch.tensor([1.0, 0.0]), 1.0, _safety())
    out = est(AdvInputs(torch.zeros(2, 3), empty, torch.tensor([0, 0])), AdvParams())
    assert out.advantages.abs().sum() == 0 and torch.isfinite(out.advantages).all()


def test_safe_estimator_refuses_missing_and_non_finite_costs():
    from ratchet.errors import NonFiniteError
    from ratchet.workers.safety import SafeRLHFEstimator

    mask, group = torch.ones(2, 2), torch.tensor([0, 0])
    inputs = AdvInputs(torch.zeros(2, 2), mask, group)
    with pytest.raises(ValueError, match="no costs"):
        SafeRLHFEstimator(grpo, None, 1.0, _safety())(inputs, AdvParams())
    with pytest.raises(NonFiniteError, match="safety.cost_function"):
        SafeRLHFEstimator(grpo, torch.tensor([0.0, float("inf")]), 1.0, _safety())(inputs, AdvParams())
