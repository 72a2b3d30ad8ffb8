"""verl's rollout correction on top of the off-policy modes, by hand: IS weights (truncated
with asymmetric bounds, IcePop, batch-normalised), rejection on the ratio, k2 and k3 at
token / seq_sum / seq_mean / seq_max level, several criteria and IS + rejection together,
the off-policy diagnostics, gradients, masks with holes, +-inf padding, and 2 gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch

from ratchet.algorithms import LOSS_AGGREGATIONS, POLICY_LOSSES
from ratchet.algorithms.policy_losses import LossParams
from ratchet.algorithms.aggregation import Normaliser
from ratchet.algorithms.off_policy import off_policy_correction
from ratchet.algorithms.off_policy_settings import ISWeights, RejectionCriterion
from ratchet.platform.services import free_ports

from ...tensor_checks import close, lengths_mask
from .helpers import finite

torch.set_num_threads(1)

LN2, LN4, LN1_5, LN6 = math.log(2.0), math.log(4.0), math.log(1.5), math.log(6.0)

# Row 0 length 3, row 1 length 2. Token ratios rho = pi_old / mu: [2, 1, 1/2] and [4, 3/2]
# (row products 1 and 6, geometric means 1 and sqrt 6); padding holds -inf / nan garbage.
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.3, float("-inf")]])
OLD = ROLLOUT + torch.tensor([[LN2, 0.0, -LN2], [LN4, LN1_5, 0.0]])
OLD[1, 2] = float("nan")
MASK = lengths_mask([3, 2], 3)

# Per-token statistics, by hand: k2 = (ln rho)^2 / 2, k3 = rho - 1 - ln rho
K2 = [[LN2**2 / 2, 0.0, LN2**2 / 2], [LN4**2 / 2, LN1_5**2 / 2]]  # 0.2402, 0, 0.2402 | 0.9609, 0.0822
K3 = [[1 - LN2, 0.0, LN2 - 0.5], [3 - LN4, 0.5 - LN1_5]]  # 0.3069, 0, 0.1931 | 1.6137, 0.0945


def correct(mode="none", is_weights=None, rejection=(), old=OLD, rollout=ROLLOUT, mask=MASK, **kw):
    return off_policy_correction(
        mode, old_logprob=old, rollout_logprob=rollout, mask=mask, is_weights=is_weights, rejection=list(rejection), **kw
    )


def rs(statistic, level="token", low=None, high=None):
    return RejectionCriterion(statistic=statistic, level=level, low=low, high=high)


def test_hand_numbers_are_what_the_comments_say():
    assert K2[0][0] == pytest.approx(0.2402, abs=1e-4) and K2[1][0] == pytest.approx(0.9609, abs=1e-4)
    assert K3[0][0] == pytest.approx(0.3069, abs=1e-4) and K3[1][0] == pytest.approx(1.6137, abs=1e-4)


# ----------------------------------------------------------------------------------- IS weights


def test_is_weights_truncate_asymmetric_token():
    # [low, high] = [0.75, 3]: 1/2 -> 0.75 (lower clamp), 4 -> 3 (upper clamp)
    corr = correct(is_weights=ISWeights(level="token", low=0.75, high=3.0))
    close(corr.weights, [[2.0, 1.0, 0.75], [3.0, 1.5, 0.0]], atol=1e-5)
    close(corr.mask, MASK)
    m = corr.metrics
    assert m["frac_truncated"] == pytest.approx(2 / 5) and m["frac_zeroed"] == 0.0 and m["frac_masked"] == 0.0
    assert m["is_weight_mean"] == pytest.approx((2 + 1 + 0.75 + 3 + 1.5) / 5, abs=1e-6)
    assert m["is_weight_max"] == pytest.approx(3.0)
    s1, s2 = 2 + 1 + 0.75 + 3 + 1.5, 4 + 1 + 0.5625 + 9 + 2.25
    assert m["ess"] == pytest.approx(s1**2 / (5 * s2), abs=1e-6)
    # no lower bound: 1/2 stays
    close(correct(is_weights=ISWeights(high=3.0)).weights, [[2.0, 1.0, 0.5], [3.0, 1.5, 0.0]], atol=1e-5)


def test_is_weights_sequence_and_geometric_levels():
    close(correct(is_weights=ISWeights(level="sequence", low=0.5, high=3.0)).weights, [[1.0] * 3, [3.0, 3.0, 0.0]], atol=1e-5)
    r6 = math.sqrt(6)
    close(correct(is_weights=ISWeights(level="geometric", high=3.0)).weights, [[1.0] * 3, [r6, r6, 0.0]], atol=1e-5)
    # a lower clamp above 1 lifts row 0 too
    close(correct(is_weights=ISWeights(level="geometric", low=1.2, high=2.0)).weights, [[1.2] * 3, [2.0, 2.0, 0.0]], atol=1e-5)


def test_icepop_zeroes_weights_outside_bounds_and_keeps_the_tokens():
    # [0.6, 3]: 1/2 and 4 fall outside -> weight 0, but the tokens stay in the mask (normaliser)
    corr = correct(is_weights=ISWeights(kind="icepop", low=0.6, high=3.0))
    close(corr.weights, [[2.0, 1.0, 0.0], [0.0, 1.5, 0.0]], atol=1e-5)
    close(corr.mask, MASK)
    m = corr.metrics
    assert m["frac_zeroed"] == pytest.approx(2 / 5) and m["frac_masked"] == 0.0 and m["frac_truncated"] == 0.0
    assert m["is_weight_mean"] == pytest.approx(4.5 / 5, abs=1e-6)
    assert m["ess"] == pytest.approx(4.5**2 / (5 * (4 + 1 + 2.25)), abs=1e-6)  # 0.5586
    # the paper's bounds [0.5, 5] keep every token here (bounds inclusive)
    close(correct(is_weights=ISWeights(kind="icepop", low=0.5, high=5.0)).weights, [[2.0, 1.0, 0.5], [4.0, 1.5, 0.0]], atol=1e-5)
    # sequence level: row 1's product 6 > 5 zeroes the whole row
    close(correct(is_weights=ISWeights(kind="icepop", level="sequence", low=0.5, high=5.0)).weights, [[1.0] * 3, [0.0] * 3], atol=1e-5)


def test_batch_normalize_token_and_sequence():
    corr = correct(is_weights=ISWeights(high=3.0, batch_normalize=True))
    # truncated weights [2, 1, .5 | 3, 1.5]: token mean 8 / 5 = 1.6
    close(corr.weights, torch.tensor([[2.0, 1.0, 0.5], [3.0, 1.5, 0.0]]) / 1.6, atol=1e-5)
    assert corr.metrics["batch_norm_factor"] == pytest.approx(1.6)
    assert corr.metrics["is_weight_mean"] == pytest.approx(1.0)
    # sequence level: one weight per sequence, 1 and 3 -> mean 2 (a token-weighted mean would be 9 / 5)
    corr = correct(is_weights=ISWeights(level="sequence", high=3.0, batch_normalize=True))
    close(corr.weights, [[0.5] * 3, [1.5, 1.5, 0.0]], atol=1e-5)
    assert corr.metrics["batch_norm_factor"] == pytest.approx(2.0)
    # icepop zeros count in the mean: [2, 1, 0 | 0, 1.5] -> mean 0.9
    corr = correct(is_weights=ISWeights(kind="icepop", low=0.6, high=3.0, batch_normalize=True))
    close(corr.weights, torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.5, 0.0]]) / 0.9, atol=1e-5)
    # all weights zero: left alone, factor 1
    corr = correct(is_weights=ISWeights(kind="icepop", low=10.0, high=20.0, batch_normalize=True))
    assert corr.weights.abs().sum().item() == 0.0 and corr.metrics["batch_norm_factor"] == 1.0


# ----------------------------------------------------------------------------------- rejection

REJECTION_CASES = {
    # ratio bounds are on rho = pi_old / mu (product at seq_sum, geometric mean at seq_mean)
    "ratio token [0.6, 3]": (rs("ratio", "token", 0.6, 3.0), [[1, 1, 0], [0, 1, 0]]),
    "ratio token low only": (rs("ratio", "token", low=0.9), [[1, 1, 0], [1, 1, 0]]),
    "ratio seq_sum high 3": (rs("ratio", "seq_sum", high=3.0), [[1, 1, 1], [0, 0, 0]]),
    "ratio seq_sum low 2": (rs("ratio", "seq_sum", low=2.0), [[0, 0, 0], [1, 1, 0]]),
    "ratio seq_mean [0.9, 2]": (rs("ratio", "seq_mean", 0.9, 2.0), [[1, 1, 1], [0, 0, 0]]),
    "ratio seq_mean [0.9, 2.5]": (rs("ratio", "seq_mean", 0.9, 2.5), [[1, 1, 1], [1, 1, 0]]),
    "k2 token high .2": (rs("k2", "token", high=0.2), [[0, 1, 0], [0, 1, 0]]),
    "k2 seq_sum high .5": (rs("k2", "seq_sum", high=0.5), [[1, 1, 1], [0, 0, 0]]),  # 0.4805 | 1.0431
    "k2 seq_mean high .2": (rs("k2", "seq_mean", high=0.2), [[1, 1, 1], [0, 0, 0]]),  # 0.1602 | 0.5216
    "k2 seq_max high .5": (rs("k2", "seq_max", high=0.5), [[1, 1, 1], [0, 0, 0]]),  # 0.2402 | 0.9609
    "k2 seq_max high .2": (rs("k2", "seq_max", high=0.2), [[0, 0, 0], [0, 0, 0]]),
    "k3 token high .25": (rs("k3", "token", high=0.25), [[0, 1, 1], [0, 1, 0]]),
    "k3 token [.1, .35]": (rs("k3", "token", 0.1, 0.35), [[1, 0, 1], [0, 0, 0]]),  # asymmetric: drops k3 = 0
    "k3 seq_sum high .6": (rs("k3", "seq_sum", high=0.6), [[1, 1, 1], [0, 0, 0]]),  # 0.5 | 1.7082
    "k3 seq_mean high .2": (rs("k3", "seq_mean", high=0.2), [[1, 1, 1], [0, 0, 0]]),  # 0.1667 | 0.8541
    "k3 seq_mean high .9": (rs("k3", "seq_mean", high=0.9), [[1, 1, 1], [1, 1, 0]]),
    "k3 seq_max [.31, 2]": (rs("k3", "seq_max", 0.31, 2.0), [[0, 0, 0], [1, 1, 0]]),  # 0.3069 | 1.6137
}


@pytest.mark.parametrize("case", sorted(REJECTION_CASES))
def test_rejection_criterion_by_hand(case):
    criterion, expected = REJECTION_CASES[case]
    corr = correct(rejection=[criterion])
    close(corr.mask, [[float(v) for v in row] for row in expected])
    close(corr.weights, corr.mask)  # no IS weights: 1 on what is kept
    dropped = 5 - sum(map(sum, expected))
    assert corr.metrics["frac_masked"] == pytest.approx(dropped / 5)
    assert corr.metrics[f"rs_{criterion.name}_frac_masked"] == pytest.approx(dropped / 5)
    seqs_hit = sum(1 for row, n in zip(expected, (3, 2)) if sum(row) < n)
    assert corr.metrics["frac_seq_masked"] == pytest.approx(seqs_hit / 2)


def test_several_criteria_all_must_pass():
    # k3 token <= 0.35 drops the 4 (k3 1.61); the geometric mean <= 2 drops row 1 (sqrt 6)
    criteria = [rs("k3", "token", high=0.35), rs("ratio", "seq_mean", high=2.0)]
    corr = correct(rejection=criteria)
    close(corr.mask, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    m = corr.metrics
    assert m["rs_k3_token_frac_masked"] == pytest.approx(1 / 5)
    assert m["rs_ratio_seq_mean_frac_masked"] == pytest.approx(2 / 5)
    assert m["frac_masked"] == pytest.approx(2 / 5) and m["frac_seq_masked"] == pytest.approx(1 / 2)
    # order does not matter
    close(correct(rejection=criteria[::-1]).mask, corr.mask)
    # with the legacy rejection mode too: cap 1.8 keeps rho in [0.556, 1.8] -> only the two 1-ish tokens
    close(correct("rejection", rejection=criteria, cap=1.8).mask, [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])


def test_is_weights_and_rejection_together():
    corr = correct(is_weights=ISWeights(high=3.0), rejection=[rs("k3", "token", high=0.35)])
    close(corr.mask, [[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    close(corr.weights, [[2.0, 1.0, 0.5], [0.0, 1.5, 0.0]], atol=1e-5)
    # batch normalisation averages over the kept tokens only: (2 + 1 + .5 + 1.5) / 4 = 1.25
    corr = correct(is_weights=ISWeights(high=3.0, batch_normalize=True), rejection=[rs("k3", "token", high=0.35)])
    close(corr.weights, torch.tensor([[2.0, 1.0, 0.5], [0.0, 1.5, 0.0]]) / 1.25, atol=1e-5)
    assert corr.metrics["is_weight_mean"] == pytest.approx(1.0)
    # IcePop + sequence rejection + the legacy rejection mode
    corr = correct("rejection", cap=3.0, is_weights=ISWeights(kind="icepop", low=0.6, high=3.0), rejection=[rs("k2", "seq_max", high=0.5)])
    close(corr.mask, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    close(corr.weights, [[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]], atol=1e-5)


# ----------------------------------------------------------------------------------- diagnostics


def test_diagnostics_by_hand():
    m = correct().metrics
    # verl's ppo_kl with pi_old in the place of pi and mu in the place of pi_old: mean(log mu - log pi_old)
    assert m["ppo_kl"] == pytest.approx(-LN6 / 5, abs=1e-6) and m["rollout_trainer_k1"] == m["ppo_kl"]
    k3 = sum(map(sum, K3)) / 5
    assert m["rollout_trainer_kl"] == pytest.approx(k3, abs=1e-6)
    # per-sequence mean log-probs: old -3.5/3, (-2 + ln 6)/2; rollout -3.5/3, -1
    old_means, roll_means = [-3.5 / 3, (-2 + LN6) / 2], [-3.5 / 3, -1.0]
    assert m["training_log_ppl"] == pytest.approx(-sum(old_means) / 2, abs=1e-6)
    assert m["training_ppl"] == pytest.approx(sum(math.exp(-x) for x in old_means) / 2, abs=1e-5)
    assert m["rollout_log_ppl"] == pytest.approx(-sum(roll_means) / 2, abs=1e-6)
    assert m["rollout_ppl"] == pytest.approx(sum(math.exp(-x) for x in roll_means) / 2, abs=1e-5)
    assert m["log_ppl_diff"] == pytest.approx(-LN6 / 4, abs=1e-6)  # (0 + (-ln 6 / 2)) / 2
    assert m["ppl_ratio"] == pytest.approx((1 + 1 / math.sqrt(6)) / 2, abs=1e-6)  # 1 / geometric IS, per sequence
    assert m["chi2_token"] == pytest.approx((4 + 1 + 0.25 + 16 + 2.25) / 5 - 1, abs=1e-5)  # 3.7
    assert m["chi2_seq"] == pytest.approx((1 + 36) / 2 - 1, abs=1e-4)  # 17.5
    assert m["ess_raw"] == pytest.approx(9.0**2 / (5 * 23.5), abs=1e-6)  # 0.6894
    assert m["ess"] == pytest.approx(1.0)  # no weights applied


def test_diagnostics_on_policy_are_neutral():
    # the same log-probs on both sides (a group whose samples are all alike, or the sync loop)
    corr = correct(old=ROLLOUT.clone(), rejection=[rs("k3", "seq_max", high=0.0), rs("ratio", "token", 1.0, 1.0)])
    close(corr.mask, MASK)  # k3 = 0 and rho = 1 pass even the tightest bounds
    m = corr.metrics
    for name in ("ppo_kl", "rollout_trainer_kl", "log_ppl_diff", "chi2_token", "chi2_seq"):
        assert m[name] == pytest.approx(0.0, abs=1e-6), name
    for name in ("ppl_ratio", "ess_raw", "ess"):
        assert m[name] == pytest.approx(1.0, abs=1e-6), name
    assert m["training_ppl"] == pytest.approx(m["rollout_ppl"])


def test_diagnostics_without_one_side():
    bypass = off_policy_correction("bypass", old_logprob=None, rollout_logprob=ROLLOUT, mask=MASK)
    assert bypass.metrics["rollout_log_ppl"] == pytest.approx((3.5 / 3 + 1.0) / 2, abs=1e-6)
    assert "training_ppl" not in bypass.metrics and "ppo_kl" not in bypass.metrics
    only_old = off_policy_correction("none", old_logprob=OLD, rollout_logprob=None, mask=MASK)
    assert "training_ppl" in only_old.metrics and "chi2_token" not in only_old.metrics


# ----------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_weights_are_detached_and_scale_the_base_gradient(agg):
    torch.manual_seed(0)
    old = OLD.nan_to_num(0.0).clone().requires_grad_(True)  # even a graph-carrying input gives detached weights
    corr = correct(old=old, is_weights=ISWeights(low=0.75, high=3.0, batch_normalize=True), rejection=[rs("k3", "token", high=0.35)])
    assert not corr.weights.requires_grad and corr.weights.grad_fn is None and not corr.mask.requires_grad
    logprob = (old.detach() + 0.1 * torch.randn(2, 3)).requires_grad_(True)
    adv = torch.tensor([[1.0, -0.5, 2.0], [-1.0, 0.5, 0.0]])
    mm = MASK * corr.mask
    norm = Normaliser(tokens=mm.sum().item(), sequences=(mm.sum(-1) > 0).sum().item(), max_response_length=3)
    out = POLICY_LOSSES.get("ppo_clip")(logprob, old.detach(), adv, mm, LossParams())
    aggregate = LOSS_AGGREGATIONS.get(agg)
    (weighted,) = torch.autograd.grad(aggregate(out.loss * corr.weights, mm, norm), logprob, retain_graph=True)
    # the gradient of each token's base loss, aggregated the same way
    (base,) = torch.autograd.grad(aggregate(out.loss, mm, norm), logprob)
    close(weighted, corr.weights * base, atol=1e-6)
    assert weighted[1, 0].item() == 0.0  # the rejected token has no gradient
    assert base.abs().sum().item() > 0


# ----------------------------------------------------------------------------------- masks


def test_a_hole_in_the_mask_counts_nowhere():
    # Row [a, hole, b, c]: the hole (a tool's output, mask 0) holds a wild log-ratio (+50)
    # and garbage log-probs; everything must equal the row without the hole, [a, b, c].
    compact_roll = torch.tensor([[-1.0, -2.0, -2.0]])  # ratios 2, 1/2, 4: k3 up to 1.61
    compact_old = compact_roll + torch.tensor([[LN2, -LN2, LN4]])
    holed_roll = torch.tensor([[-1.0, -300.0, -2.0, -2.0]])
    holed_old = torch.tensor([[compact_old[0, 0].item(), -250.0, compact_old[0, 1].item(), compact_old[0, 2].item()]])
    holed_mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    settings = [
        dict(is_weights=ISWeights(level="sequence", high=10.0, batch_normalize=True)),
        dict(is_weights=ISWeights(level="geometric", kind="icepop", low=0.5, high=5.0)),
        dict(rejection=[rs("k3", "seq_max", high=2.0)]),  # the hole's k3 would be ~19
        dict(rejection=[rs("k2", "seq_mean", high=0.5), rs("ratio", "seq_sum", high=5.0)]),
    ]
    for kw in settings:
        compact = correct(old=compact_old, rollout=compact_roll, mask=torch.ones(1, 3), **kw)
        holed = correct(old=holed_old, rollout=holed_roll, mask=holed_mask, **kw)
        close(holed.weights[:, [0, 2, 3]], compact.weights, atol=1e-5)
        close(holed.mask, [[compact.mask[0, 0].item(), 0.0, compact.mask[0, 1].item(), compact.mask[0, 2].item()]])
        assert holed.weights[0, 1].item() == 0.0
        for name, value in compact.metrics.items():
            assert holed.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), (kw, name)
    # the compacted row passes the k3 seq_max criterion, so the hole really was ignored
    assert correct(old=holed_old, rollout=holed_roll, mask=holed_mask, rejection=[rs("k3", "seq_max", high=2.0)]).mask.sum().item() == 3


def test_inf_and_nan_padding_change_nothing():
    clean_roll, clean_old = ROLLOUT.clone(), OLD.clone()
    clean_roll[1, 2], clean_old[1, 2] = 0.0, 0.0
    dirty_roll, dirty_old = ROLLOUT.clone(), OLD.clone()
    dirty_roll[1, 2], dirty_old[1, 2] = float("-inf"), float("inf")
    kw = dict(is_weights=ISWeights(level="sequence", high=3.0, batch_normalize=True), rejection=[rs("k3", "seq_sum", high=2.0)])
    clean, dirty = correct(old=clean_old, rollout=clean_roll, **kw), correct(old=dirty_old, rollout=dirty_roll, **kw)
    assert finite(dirty.weights, dirty.mask)
    close(dirty.weights, clean.weights)
    close(dirty.mask, clean.mask)
    assert dirty.metrics == pytest.approx(clean.metrics)


def test_extreme_and_empty_inputs_stay_finite():
    rollout = torch.zeros(3, 3)
    old = torch.tensor([[1000.0, 1000.0, 0.0], [-1000.0, 0.0, 0.0], [float("inf"), float("-inf"), 0.0]])
    kw = dict(is_weights=ISWeights(level="sequence", kind="icepop", low=0.5, high=5.0, batch_normalize=True))
    for rejection in ([], [rs("k3", "seq_sum", high=5.0)], [rs("ratio", "token", 0.5, 2.0), rs("k2", "seq_max", high=1.0)]):
        corr = correct(old=old, rollout=rollout, mask=torch.ones(3, 3), rejection=rejection, **kw)
        assert finite(corr.weights, corr.mask)
        assert all(math.isfinite(v) for v in corr.metrics.values()), corr.metrics
        empty = correct(old=old, rollout=rollout, mask=torch.zeros(3, 3), rejection=rejection, **kw)
        assert empty.mask.sum().item() == 0.0 and empty.weights.abs().sum().item() == 0.0
        assert all(v == 0.0 for k, v in empty.metrics.items() if k != "batch_norm_factor"), empty.metrics
    # a zero-width response
    zero = correct(old=torch.zeros(2, 0), rollout=torch.zeros(2, 0), mask=torch.zeros(2, 0), rejection=[rs("k2", "seq_max", high=1.0)])
    assert zero.weights.shape == (2, 0)


# ----------------------------------------------------------------------------------- settings


def test_settings_accept_mappings_and_config_sections():
    from ratchet.config.schema import OffPolicyConfig

    cfg = OffPolicyConfig.model_validate(
        {"is_weights": {"kind": "icepop", "low": 0.6, "high": 3.0}, "rejection": [{"statistic": "k3", "level": "token", "high": 0.35}]}
    )
    by_config = correct(is_weights=cfg.is_weights, rejection=cfg.rejection)
    by_dict = correct(is_weights={"kind": "icepop", "low": 0.6, "high": 3.0}, rejection=[{"statistic": "k3", "high": 0.35}])
    close(by_config.weights, by_dict.weights)
    close(by_config.weights, [[2.0, 1.0, 0.0], [0.0, 1.5, 0.0]], atol=1e-5)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(mode="tis", is_weights=ISWeights()), "is_weights: mode 'tis' already weights"),
        (dict(mode="bypass", rejection=[rs("k3", high=1.0)]), "rejection: mode 'bypass'"),
        (dict(is_weights=ISWeights(kind="icepop", high=5.0)), "is_weights.low: icepop needs both bounds"),
        (dict(is_weights=ISWeights(low=3.0, high=2.0)), "is_weights.low: 3.0 is above high"),
        (dict(is_weights=ISWeights(high=None)), "is_weights.high: must be set"),
        (dict(is_weights=ISWeights(level="batch")), "is_weights.level: expected one of"),
        (dict(rejection=[rs("ratio", "seq_max", high=2.0)]), r"rejection.0.level: the ratio has no seq_max"),
        (dict(rejection=[rs("k2", high=1.0), rs("k9", high=1.0)]), r"rejection.1.statistic"),
        (dict(rejection=[rs("ratio", low=0.0, high=2.0)]), r"rejection.0.low: must be > 0"),
        (dict(rejection=[rs("k3", low=-1.0)]), r"rejection.0.low: must be >= 0"),
        (dict(rejection=[rs("k3")]), r"rejection.0.high: set low, high or both"),
        (dict(rejection=[rs("k3", high=1.0), rs("k3", high=2.0)]), r"rejection.1: repeats statistic k3"),
    ],
)
def test_bad_settings_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        correct(**kw)


# ----------------------------------------------------------------------------------- ranks


def _gloo_rank(rank: int, world: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows = torch.arange(rank, GLOO_OLD.shape[0], world)  # strided rows, as the trainer
        corr = correct(old=GLOO_OLD[rows], rollout=GLOO_ROLL[rows], mask=GLOO_MASK[rows], world_size=world, **GLOO_KW)
        weights = [torch.zeros_like(corr.weights) for _ in range(world)]
        dist.all_gather(weights, corr.weights)
        if rank == 0:
            torch.save({"weights": torch.stack(weights, 1).reshape(-1, GLOO_OLD.shape[1]), "metrics": corr.metrics}, out_path)
    finally:
        dist.destroy_process_group()


_g = torch.Generator().manual_seed(3)
GLOO_ROLL = -torch.rand(6, 5, generator=_g) * 3
GLOO_OLD = GLOO_ROLL + torch.randn(6, 5, generator=_g) * 0.7
GLOO_MASK = torch.tensor(
    [[1, 1, 1, 1, 1], [1, 0, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 1, 1]], dtype=torch.float
)
GLOO_KW = dict(is_weights=ISWeights(level="sequence", high=3.0, batch_normalize=True), rejection=[rs("k3", "token", high=0.5)])


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="no gloo")
def test_two_gloo_ranks_normalise_and_report_the_global_batch(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "rank0.pt"
    # spawn, not fork: a test process that loaded vLLM earlier (same xdist worker) cannot fork safely
    mp.start_processes(_gloo_rank, args=(2, free_ports(1)[0], str(out)), nprocs=2, join=True, start_method="spawn")
    got = torch.load(out)
    full = correct(old=GLOO_OLD, rollout=GLOO_ROLL, mask=GLOO_MASK, **GLOO_KW)
    assert 0 < full.metrics["frac_masked"] < 1 and full.metrics["batch_norm_factor"] != 1.0  # the case is not trivial
    close(got["weights"], full.weights, atol=1e-5)
    assert got["metrics"] == pytest.approx(full.metrics, rel=1e-5, abs=1e-6)
