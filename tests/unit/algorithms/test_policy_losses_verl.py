"""The rest of verl's policy losses (SAPO, GMPO, DPPO-TV/KL, DRO, REINFORCE with IS weights,
Clip-Cov, KL-Cov): values worked out by hand, gradients against the analytic gradient, the
clip/selection flags, and degenerate inputs (empty mask, holes, extreme ratios, padding garbage)."""

from __future__ import annotations

import math

import pytest
import torch

from ratchet.algorithms import LOSS_AGGREGATIONS, POLICY_LOSSES
from ratchet.algorithms.policy_losses import LossParams
from ratchet.algorithms.aggregation import Normaliser
from ratchet.algorithms.policy_losses_cov import clip_cov_select, kl_cov_select, token_covariance
from ratchet.algorithms.policy_losses_verl import binary_kl

from ...tensor_checks import close
from .helpers import finite

torch.set_num_threads(1)

NEW = ["sapo", "gmpo", "geo_mean", "dppo_tv", "dppo_kl", "dro", "reinforce_is", "clip_cov", "kl_cov"]
LN = math.log


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def run(name: str, logprob, old, adv, mask, params: LossParams = LossParams()):
    """The loss, and d(sum of masked loss)/d logprob."""
    logprob = torch.as_tensor(logprob, dtype=torch.float32).clone().requires_grad_(True)
    out = POLICY_LOSSES.get(name)(
        logprob, torch.as_tensor(old, dtype=torch.float32), torch.as_tensor(adv, dtype=torch.float32), mask, params
    )
    (torch.where(mask.bool(), out.loss, torch.zeros_like(out.loss))).sum().backward()
    return out, logprob.grad


def test_all_registered_and_geo_mean_is_gmpo():
    assert set(NEW) <= set(POLICY_LOSSES.names())
    assert POLICY_LOSSES.get("geo_mean") is POLICY_LOSSES.get("gmpo")


# --------------------------------------------------------------------------------------- SAPO


def test_sapo_by_hand():
    # (A, r): tau = 1.0 for A > 0, 1.05 for A <= 0 (verl's defaults)
    cases = [(1.0, 1.0), (-1.0, 2.0), (2.0, 0.5), (0.0, 1.5)]
    old = torch.full((1, 4), -1.0)
    lp = old + torch.tensor([[LN(r) for _, r in cases]])
    out, grad = run("sapo", lp, old, [[a for a, _ in cases]], torch.ones(1, 4))
    # A=1, r=1: gate sigmoid(0) * 4 = 2 -> loss -2, gradient -A * 4 * 1/4 * r = -1 (the plain policy gradient)
    assert out.loss[0, 0].item() == pytest.approx(-2.0, abs=1e-6)
    assert grad[0, 0].item() == pytest.approx(-1.0, abs=1e-6)
    # A=-1, r=2: gate sigmoid(1.05) * 4 / 1.05 = 2.82199 -> loss +2.82199
    assert out.loss[0, 1].item() == pytest.approx(2.82199, abs=1e-5)
    expected_loss, expected_grad = [], []
    for a, r in cases:
        tau = 1.0 if a > 0 else 1.05
        s = sigmoid(tau * (r - 1))
        expected_loss.append(-a * s * 4 / tau)
        expected_grad.append(-a * 4 * s * (1 - s) * r)  # d/d log pi of -A f(r): f'(r) * r
    close(out.loss, [expected_loss], atol=1e-5)
    close(grad, [expected_grad], atol=1e-5)
    assert not out.clipped.any()  # soft gate: nothing is hard-clipped


def test_sapo_gate_decays_but_never_cuts_the_gradient():
    old = torch.zeros(1, 3)
    lp = torch.tensor([[0.0, LN(5.0), LN(10.0)]])
    _, grad = run("sapo", lp, old, torch.ones(1, 3), torch.ones(1, 3))
    g = (-grad[0]).tolist()  # 4 s (1 - s) r: 1 at r = 1, 0.353 at r = 5, 0.0049 at r = 10
    assert g[0] > g[1] > g[2] > 0  # PPO would give 0 beyond 1.2; SAPO only damps
    assert g[2] == pytest.approx(4 * sigmoid(9) * (1 - sigmoid(9)) * 10, rel=1e-3)


def test_sapo_rejects_non_positive_tau():
    with pytest.raises(ValueError, match="sapo_tau"):
        run("sapo", torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), LossParams(sapo_tau_neg=0.0))


# --------------------------------------------------------------------------------------- GMPO


def gmpo_case():
    # sequence 0: A = +1, log-ratios 0.1 and 0.6 (0.6 clipped to 0.4 on the optimistic side)
    # sequence 1: A = -1, log-ratios -0.6 (clipped to -0.4) and 0.2
    # sequence 2: A = +1, log-ratios 0.2, [hole, -inf], 0.0
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-2.0, 0.0, -2.0]])
    lp = torch.tensor([[-0.9, -0.4, -5.0], [-1.6, -0.8, -5.0], [-1.8, float("-inf"), -2.0]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, 0.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    return lp, old, adv, mask


def test_gmpo_by_hand():
    lp, old, adv, mask = gmpo_case()
    params = LossParams(clip_ratio_low=0.4, clip_ratio_high=0.4)
    out, grad = run("gmpo", lp, old, adv, mask, params)
    r0, r1, r2 = math.exp((0.1 + 0.4) / 2), math.exp((-0.4 + 0.2) / 2), math.exp((0.2 + 0.0) / 2)
    # every token of a sequence carries the sequence's loss -A_i R_i
    close(out.loss, [[-r0] * 3, [r1] * 3, [-r2] * 3], atol=1e-5)
    close(out.ratio, [[r0] * 3, [r1] * 3, [r2] * 3], atol=1e-5)
    assert out.clipped.tolist() == [[False, True, False], [True, False, False], [False, False, False]]
    # seq-mean-token-mean gives the mean of the sequence losses (verl's torch.mean over sequences)
    agg = LOSS_AGGREGATIONS.get("seq-mean-token-mean")(out.loss, mask, Normaliser(tokens=6, sequences=3))
    assert agg.item() == pytest.approx((-r0 + r1 - r2) / 3, abs=1e-5)


def test_gmpo_gradient_is_the_papers():
    lp, old, adv, mask = gmpo_case()
    lp = lp.clone().requires_grad_(True)
    out = POLICY_LOSSES.get("gmpo")(lp, old, adv, mask, LossParams(clip_ratio_low=0.4, clip_ratio_high=0.4))
    LOSS_AGGREGATIONS.get("seq-mean-token-mean")(out.loss, mask, Normaliser(tokens=6, sequences=3)).backward()
    r0, r1, r2 = math.exp(0.25), math.exp(-0.1), math.exp(0.1)
    # dL/dlog pi_t = -(1/N) A_i R_i / |y_i| on unclipped tokens, 0 on clipped ones and on holes
    close(lp.grad, [[-r0 / 6, 0.0, 0.0], [0.0, r1 / 6, 0.0], [-r2 / 6, 0.0, -r2 / 6]], atol=1e-6)


def test_gmpo_finite_difference():
    torch.manual_seed(0)
    lp = (-torch.rand(2, 5, dtype=torch.float64) - 0.5).requires_grad_(True)
    old = lp.detach() + 0.05 * torch.randn(2, 5, dtype=torch.float64)  # well inside the 0.4 log-clip: no kinks
    adv = torch.tensor([[1.5] * 5, [-0.7] * 5], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    norm = Normaliser(tokens=7, sequences=2)

    def f(x):
        out = POLICY_LOSSES.get("gmpo")(x, old, adv, mask, LossParams(clip_ratio_low=0.4, clip_ratio_high=0.4))
        return LOSS_AGGREGATIONS.get("seq-mean-token-mean")(out.loss, mask, norm)

    assert torch.autograd.gradcheck(f, (lp,))


# --------------------------------------------------------------------------------------- DPPO


def test_dppo_tv_by_hand():
    # (A, p_old, p): thresholds 0.2 on p - p_old, cap 20
    cases = [
        (1.0, 0.5, 0.6, True),  # +0.1 <= 0.2: valid, w = 1.2
        (1.0, 0.5, 0.8, False),  # +0.3: pushed past the region
        (-1.0, 0.5, 0.2, False),  # -0.3 < -0.2
        (-1.0, 0.5, 0.9, True),  # A < 0 moving up: valid, w = 1.8
        (1.0, 0.01, 0.05, True),  # ratio 5, a PPO clip would cut it; TV +0.04 keeps it, w = 5
        (1.0, 0.001, 0.05, True),  # ratio 50: truncated to the cap 20
    ]
    old = torch.tensor([[LN(c[1]) for c in cases]])
    lp = torch.tensor([[LN(c[2]) for c in cases]])
    out, grad = run("dppo_tv", lp, old, [[c[0] for c in cases]], torch.ones(1, len(cases)))
    valid = [c[3] for c in cases]
    w = [min(c[2] / c[1], 20.0) for c in cases]
    close(out.loss, [[-c[0] * wi * v * LN(c[2]) for c, wi, v in zip(cases, w, valid)]], atol=1e-4)
    close(grad, [[-c[0] * wi * v for c, wi, v in zip(cases, w, valid)]], atol=1e-4)
    assert out.clipped.tolist() == [[not v for v in valid]]
    assert out.loss[0, 0].item() == pytest.approx(-1.2 * LN(0.6), abs=1e-5)  # 0.61299


def test_dppo_kl_by_hand():
    p_old = 0.5
    d = binary_kl(torch.tensor(0.8), torch.tensor(p_old), torch.tensor(LN(0.8)), torch.tensor(LN(p_old))).item()
    assert d == pytest.approx(0.5 * LN(0.5 / 0.8) + 0.5 * LN(0.5 / 0.2), abs=1e-6)  # 0.22314
    # (A, p): binary KL of 0.5 -> 0.8 and 0.5 -> 0.2 are both 0.22314 > 0.2
    cases = [
        (1.0, 0.8, False),  # pushed up past the threshold
        (1.0, 0.2, True),  # A > 0 but p fell: moving back is always allowed
        (-1.0, 0.2, False),  # pushed down past the threshold
        (-1.0, 0.8, True),  # A < 0 but p rose: allowed
        (1.0, 0.55, True),  # small move: KL 0.005
    ]
    old = torch.full((1, len(cases)), LN(p_old))
    lp = torch.tensor([[LN(c[1]) for c in cases]])
    out, grad = run("dppo_kl", lp, old, [[c[0] for c in cases]], torch.ones(1, len(cases)))
    assert out.clipped.tolist() == [[not c[2] for c in cases]]
    close(grad, [[-c[0] * (c[1] / p_old) * c[2] for c in cases]], atol=1e-5)
    # a looser threshold (0.25 > 0.22314) keeps them all
    out, _ = run(
        "dppo_kl", lp, old, [[c[0] for c in cases]], torch.ones(1, len(cases)), LossParams(clip_ratio_low=0.25, clip_ratio_high=0.25)
    )
    assert not out.clipped.any()


# ---------------------------------------------------------------------------------------- DRO


def test_dro_by_hand():
    lp = [[-1.0, -0.5, -2.0]]
    old = [[-1.5, -0.5, -1.0]]
    adv = [[1.0, -2.0, 0.5]]
    out, grad = run("dro", lp, old, adv, torch.ones(1, 3), LossParams(dro_beta=0.1))
    # -(A log pi - beta/2 d^2): d = 0.5, 0, -1
    close(out.loss, [[-(1.0 * -1.0 - 0.05 * 0.25), -(-2.0 * -0.5), -(0.5 * -2.0 - 0.05 * 1.0)]], atol=1e-6)  # 1.0125, -1, 1.05
    # gradient -(A - beta d): the penalty pulls d back toward 0
    close(grad, [[-(1.0 - 0.05), 2.0, -(0.5 + 0.1)]], atol=1e-6)
    assert not out.clipped.any()
    with pytest.raises(ValueError, match="dro_beta"):
        run("dro", lp, old, adv, torch.ones(1, 3), LossParams(dro_beta=0.0))


# ------------------------------------------------------------------------ REINFORCE + IS weights


def test_reinforce_is_token_level_by_hand():
    old = torch.full((1, 3), -2.0)
    lp = old + torch.tensor([[LN(1.5), LN(3.0), LN(0.2)]])
    adv = [[1.0, 1.0, -1.0]]
    out, grad = run("reinforce_is", lp, old, adv, torch.ones(1, 3), LossParams(reinforce_is_cap=2.0))
    w = [1.5, 2.0, 0.2]  # min(r, 2): no lower bound
    close(out.loss, [[-w[i] * adv[0][i] * lp[0, i].item() for i in range(3)]], atol=1e-6)
    assert out.loss[0, 0].item() == pytest.approx(1.5 * (2.0 - LN(1.5)), abs=1e-5)  # 2.39180
    close(grad, [[-1.5, -2.0, 0.2]], atol=1e-6)
    assert out.clipped.tolist() == [[False, True, False]]


def test_reinforce_is_sequence_level_by_hand():
    old = torch.full((2, 3), -2.0)
    lp = old + torch.tensor([[LN(1.5), LN(0.5), 0.0], [LN(2.0), LN(1.5), 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the unmasked 5.0 must not enter the product
    out, grad = run("reinforce_is", lp, old, torch.ones(2, 3), mask, LossParams(reinforce_is_level="sequence"))
    # products 0.75 and 3 (capped at 2), one weight per sequence
    close(grad, [[-0.75, -0.75, 0.0], [-2.0, -2.0, 0.0]], atol=1e-6)
    assert out.clipped.tolist() == [[False, False, False], [True, True, False]]


def test_reinforce_is_on_policy_is_plain_reinforce():
    lp = torch.tensor([[-0.3, -1.7]])
    out, grad = run("reinforce_is", lp, lp, [[2.0, -1.0]], torch.ones(1, 2))
    close(out.loss, [[0.6, -1.7]], atol=1e-6)  # -A log pi
    close(grad, [[-2.0, 1.0]], atol=1e-6)


# ---------------------------------------------------------------------------- Clip-Cov, KL-Cov


def cov_case():
    # A = [2, 2, -2, -2] (mean 0); log pi = [-0.5, -3, -0.5, -2.5] (mean -1.625)
    # covariance (A - 0)(log pi + 1.625) = [2.25, -2.75, -2.25, 1.75]
    lp = torch.tensor([[-0.5, -3.0, -0.5, -2.5]])
    adv = torch.tensor([[2.0, 2.0, -2.0, -2.0]])
    return lp, adv, torch.ones(1, 4)


def test_token_covariance_by_hand_and_ignores_holes():
    lp, adv, mask = cov_case()
    close(token_covariance(lp, adv, mask), [[2.25, -2.75, -2.25, 1.75]], atol=1e-6)
    # a hole with garbage changes nothing for the others, and gets 0
    lp_h = torch.tensor([[-0.5, float("nan"), -3.0, -0.5, -2.5]])
    adv_h = torch.tensor([[2.0, 100.0, 2.0, -2.0, -2.0]])
    mask_h = torch.tensor([[1.0, 0.0, 1.0, 1.0, 1.0]])
    close(token_covariance(lp_h, adv_h, mask_h), [[2.25, 0.0, -2.75, -2.25, 1.75]], atol=1e-6)


def test_clip_cov_by_hand():
    lp, adv, mask = cov_case()
    old = lp.clone()
    old[0, 3] += 0.5  # token 3: A < 0, r = e^-0.5 = 0.61 < 0.8: PPO-clipped, so not a candidate
    params = LossParams(clip_cov_ratio=0.5)  # budget max(int(0.5 * 4), 1) = 2
    out, grad = run("clip_cov", lp, old, adv, mask, params)
    # candidates: cov in (1, 5) and not PPO-clipped -> token 0 only (token 3 has 1.75 but is clipped)
    close(out.loss, [[0.0, -2.0, 2.0, -(-2.0) * 0.8]], atol=1e-6)
    close(grad, [[0.0, -2.0, 2.0, 0.0]], atol=1e-6)
    assert out.clipped.tolist() == [[True, False, False, True]]  # selected, -, -, PPO-clipped
    # with no PPO clip token 3 is a candidate too; bounds (2, 5) leave only token 0
    out, _ = run("clip_cov", lp, lp, adv, mask, LossParams(clip_cov_ratio=0.5, clip_cov_lb=2.0))
    assert out.clipped.tolist() == [[True, False, False, False]]


def test_clip_cov_draws_its_budget_at_random_among_candidates():
    cov = torch.tensor([[1.5, 2.0, 3.0, 4.0, 0.5, 6.0, 2.5, 1.2]])
    mask = torch.ones(1, 8)
    candidates = mask.bool()
    params = LossParams(clip_cov_ratio=0.25)  # budget 2 of the 6 in (1, 5)
    inside = (cov > 1) & (cov < 5)
    seen = set()
    for seed in range(20):
        sel = clip_cov_select(cov, candidates, mask, params, generator=torch.Generator().manual_seed(seed))
        assert sel.sum().item() == 2 and not (sel & ~inside).any()
        seen.add(tuple(sel.flatten().tolist()))
        again = clip_cov_select(cov, candidates, mask, params, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(sel, again)  # reproducible from the generator
    assert len(seen) > 3  # a random subset, not always the same tokens
    # a tiny ratio still selects one token (verl's max(., 1))
    assert clip_cov_select(cov, candidates, mask, LossParams(clip_cov_ratio=1e-4)).sum().item() == 1


def test_kl_cov_by_hand():
    lp, adv, mask = cov_case()
    old = lp.clone()
    old[0, 0] -= 0.3  # token 0: log r = 0.3
    out, grad = run("kl_cov", lp, old, adv, mask, LossParams(kl_cov_ratio=0.25, kl_cov_coef=0.1))  # top max(int(1), 1) = 1
    r = math.exp(0.3)
    # token 0 has the largest covariance (2.25): -A r + 0.1 |0.3|; the rest -A r with r = 1
    close(out.loss, [[-2.0 * r + 0.03, -2.0, 2.0, 2.0]], atol=1e-5)
    close(grad, [[-2.0 * r + 0.1, -2.0, 2.0, 2.0]], atol=1e-5)
    assert out.clipped.tolist() == [[True, False, False, False]]
    # top 2: tokens 0 and 3 (1.75)
    assert kl_cov_select(token_covariance(lp, adv, mask), mask, LossParams(kl_cov_ratio=0.5)).tolist() == [[True, False, False, True]]


def test_kl_cov_has_no_clip():
    old = torch.zeros(1, 2)
    lp = torch.tensor([[LN(2.0), LN(3.0)]])
    _, grad = run("kl_cov", lp, old, torch.ones(1, 2), torch.ones(1, 2), LossParams(kl_cov_coef=0.0))
    close(grad, [[-2.0, -3.0]], atol=1e-5)  # -A r beyond 1.2: not cut


# ----------------------------------------------------------------------- analytic gradients, all


def analytic_grad(name, lp, old, adv, mask, out, params):
    """d(sum_t m_t L_t)/d log pi_t from each paper's gradient formula, written independently."""
    m = mask.bool()
    d = (lp - old).clamp(-20, 20)
    r = d.exp()
    if name == "sapo":
        tau = torch.where(adv > 0, params.sapo_tau_pos, params.sapo_tau_neg)
        s = torch.sigmoid(tau * (r - 1))
        g = -adv * 4 * s * (1 - s) * r
    elif name in ("dppo_tv", "dppo_kl"):
        g = -adv * r.clamp(max=params.dppo_is_cap) * (~out.clipped).float()
    elif name == "dro":
        g = -(adv - params.dro_beta * (lp - old))
    elif name == "reinforce_is":
        g = -adv * r.clamp(max=params.reinforce_is_cap)
    elif name == "clip_cov":
        g = -adv * r * (~out.clipped).float()
    elif name == "kl_cov":
        g = -adv * r + params.kl_cov_coef * torch.sign(d) * out.clipped.float()
    return torch.where(m, g, torch.zeros_like(g))


@pytest.mark.parametrize("name", ["sapo", "dppo_tv", "dppo_kl", "dro", "reinforce_is", "clip_cov", "kl_cov"])
def test_autograd_matches_the_analytic_gradient(name):
    torch.manual_seed(1)
    lp = -torch.rand(3, 6) * 3 - 0.05
    old = lp + 0.5 * torch.randn(3, 6)
    adv = 3 * torch.randn(3, 1).expand(3, 6).clone()
    mask = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 0, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.float32)
    lp[mask == 0] = float("-inf")  # padding / tool output: must not matter
    clip = 0.02 if name == "dppo_kl" else 0.1
    params = LossParams(
        clip_ratio_low=clip, clip_ratio_high=clip, clip_cov_ratio=0.2, clip_cov_lb=0.5, kl_cov_ratio=0.2, reinforce_is_cap=1.5
    )
    out, grad = run(name, lp, old, adv, mask, params)
    assert finite(grad)
    close(grad, analytic_grad(name, lp, old, adv, mask, out, params), atol=1e-5)
    if name != "sapo" and name != "dro":  # the data reach the clip / selection / truncation branches
        assert 0 < out.clipped.sum().item() < mask.sum().item()


@pytest.mark.parametrize("name", ["sapo", "dro", "reinforce_is"])
def test_finite_difference_on_smooth_losses(name):
    torch.manual_seed(2)
    lp = (-torch.rand(2, 4, dtype=torch.float64) - 0.2).requires_grad_(True)
    old = lp.detach() + 0.1 * torch.randn(2, 4, dtype=torch.float64)
    adv = torch.randn(2, 4, dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    fn = POLICY_LOSSES.get(name)
    if name == "reinforce_is":
        # its weight is a stop-gradient: move old with x so the ratio (and the weight) stays put
        # under the finite difference too, leaving d/dx of -w A log pi
        shift = lp.detach() - old
        assert torch.autograd.gradcheck(lambda x: (fn(x, x - shift, adv, mask, LossParams()).loss * mask).sum(), (lp,))
    else:
        assert torch.autograd.gradcheck(lambda x: (fn(x, old, adv, mask, LossParams()).loss * mask).sum(), (lp,))


# ------------------------------------------------------------------------------ degenerate inputs


@pytest.mark.parametrize("name", NEW)
def test_empty_mask_gives_zero_and_no_nan(name):
    lp = torch.tensor([[float("-inf"), -1.0, float("nan")]])
    old = torch.tensor([[float("-inf"), 0.0, 1.0]])
    mask = torch.zeros(1, 3)
    out, grad = run(name, lp, old, torch.ones(1, 3), mask)
    assert finite(out.loss, grad) and (out.loss * mask).sum().item() == 0.0
    assert grad.abs().sum().item() == 0.0 and not out.clipped.any()
    for agg in ("token-mean", "seq-mean-token-mean"):
        value = LOSS_AGGREGATIONS.get(agg)(out.loss, mask, Normaliser(tokens=0, sequences=0))
        assert value.item() == 0.0


@pytest.mark.parametrize("name", NEW)
def test_padding_garbage_stays_out(name):
    # -inf / nan / 1e30 on padded positions: loss * mask and the gradient stay finite, padding gets no gradient
    lp = torch.tensor([[-1.0, float("-inf"), -0.7], [-0.5, 1e30, float("nan")]])
    old = torch.tensor([[-1.2, 0.0, -0.9], [-0.5, float("nan"), -1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    out, grad = run(name, lp, old, torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]), mask)
    assert finite(out.loss * mask, out.ratio * mask, grad)
    assert grad[mask == 0].abs().sum().item() == 0.0
    assert not out.clipped[mask == 0].any()


@pytest.mark.parametrize("name", NEW)
def test_hole_in_the_mask_is_the_same_as_no_token(name):
    """A multi-turn hole (tool output, mask 0) inside the response: the masked loss and the
    gradient equal those of the sequence with the hole cut out."""
    lp = torch.tensor([[-0.4, -9.0, -1.3, -0.8]])
    old = torch.tensor([[-0.5, 0.0, -1.0, -0.8]])
    adv = torch.tensor([[0.7, 55.0, 0.7, 0.7]])
    holed, holed_grad = run(name, lp, old, adv, torch.tensor([[1.0, 0.0, 1.0, 1.0]]))
    keep = [0, 2, 3]
    cut, cut_grad = run(name, lp[:, keep], old[:, keep], adv[:, keep], torch.ones(1, 3))
    close(holed.loss[:, keep], cut.loss, atol=1e-6)
    close(holed_grad[:, keep], cut_grad, atol=1e-6)
    assert holed_grad[0, 1].item() == 0.0


@pytest.mark.parametrize("delta", [50.0, -50.0, 1000.0, -1000.0])
@pytest.mark.parametrize("name", NEW)
def test_ratio_far_from_one_stays_finite(name, delta):
    old = torch.full((1, 2), -1.0)
    lp = old + delta
    out, grad = run(name, lp, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), LossParams(clip_cov_ratio=1.0, kl_cov_ratio=1.0))
    assert finite(out.loss, out.ratio, grad)


def test_params_come_from_the_config_by_name():
    from ratchet.config.schema import AlgorithmConfig

    alg = AlgorithmConfig(policy_loss="sapo", sapo_tau_pos=0.5, dro_beta=0.3, kl_cov_coef=0.2, reinforce_is_level="sequence")
    params = LossParams.from_algorithm(alg)
    assert (params.sapo_tau_pos, params.sapo_tau_neg, params.dro_beta, params.kl_cov_coef) == (0.5, 1.05, 0.3, 0.2)
    assert params.reinforce_is_level == "sequence" and params.clip_ratio_c == 3.0

    class Partial:  # a config view without the new fields (an older snapshot) keeps the defaults
        clip_ratio_low = 0.1

    assert LossParams.from_algorithm(Partial()) == LossParams(clip_ratio_low=0.1)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("sapo_tau_neg", 0.0, "sapo_tau_neg"),
        ("dro_beta", -1.0, "dro_beta"),
        ("clip_cov_ratio", 0.0, "clip_cov_ratio"),
        ("clip_cov_lb", 9.0, "clip_cov_lb"),
        ("kl_cov_coef", -0.1, "kl_cov_coef"),
        ("reinforce_is_level", "geometric", "reinforce_is_level"),
        ("dppo_is_cap", 0.0, "dppo_is_cap"),
    ],
)
def test_bad_hyper_parameters_name_the_field(field, value, match):
    from pydantic import ValidationError

    from ratchet.config.schema import AlgorithmConfig

    with pytest.raises(ValidationError, match=match):
        AlgorithmConfig(**{field: value})
