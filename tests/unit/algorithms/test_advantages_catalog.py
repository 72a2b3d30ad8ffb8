"""The rest of verl's estimators (OPO, GPG, GRPO pass@k, optimal token baseline) and the
`token-sum` aggregation against hand-worked numbers; masks with holes for every estimator;
and no gradient through any advantage."""

from __future__ import annotations

import math

import pytest
import torch

from ratchet.algorithms import ADV_ESTIMATORS, LOSS_AGGREGATIONS
from ratchet.algorithms.advantages import AdvInputs, AdvParams, last_token_index, response_span_lengths, sequence_rewards_to_tokens
from ratchet.algorithms.aggregation import Normaliser
from ratchet.algorithms.advantages_outcome import sum_pi_squared

from ...tensor_checks import close, lengths_mask
from .helpers import finite

torch.set_num_threads(1)

EPS = 1e-6  # AdvParams.epsilon


def run(name: str, inputs: AdvInputs, params: AdvParams = AdvParams()):
    return ADV_ESTIMATORS.get(name).fn(inputs, params)


def outcome(name: str, rewards: list[float], group: list[int], mask: torch.Tensor, params: AdvParams = AdvParams()):
    r = torch.tensor(rewards)
    return run(name, AdvInputs(sequence_rewards_to_tokens(r, mask), mask, torch.tensor(group)), params)


# ------------------------------------------------------------------------------ masks with holes

# Row 0 is a two-turn response: model tokens at 0-1, tool output at 2-3 (mask 0), model
# tokens at 4; padding at 5. Row 1 has no hole; row 2 is empty.
HOLED = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0, 0.0], [0.0] * 6])


def test_last_token_is_the_last_one_not_the_count_of_ones():
    assert last_token_index(HOLED).tolist() == [4, 2, -1]  # mask.sum() - 1 would say 2 for row 0: a hole
    assert response_span_lengths(HOLED).tolist() == [5, 3, 0]
    assert last_token_index(torch.zeros(2, 0)).tolist() == [-1, -1]
    tokens = sequence_rewards_to_tokens(torch.tensor([2.0, 3.0, 9.0]), HOLED)
    close(tokens, [[0, 0, 0, 0, 2.0, 0], [0, 0, 3.0, 0, 0, 0], [0.0] * 6])  # the empty row's 9 has no token


def test_reinforce_plus_plus_baseline_with_a_hole_by_hand():
    # group 0: rows 0 (holed, score 2) and 1 (score 0): centred +1 and -1, on every model token
    # of both turns (gamma 1: the return runs across the hole). Tokens: +1 x3, -1 x3;
    # mean 0, unbiased var 6 / 5, so A = +-1 / sqrt(1.2).
    out = outcome("reinforce_plus_plus_baseline", [2.0, 0.0, 5.0], [0, 0, 1], HOLED)
    a = 1 / math.sqrt(1.2 + 1e-8)
    close(out.advantages, [[a, a, 0, 0, a, 0], [-a, -a, -a, 0, 0, 0], [0.0] * 6], atol=1e-6)


def test_reinforce_plus_plus_return_reaches_the_first_turn():
    # gamma 0.5, reward 1 at the end of row 0: G = 0.25, 0.5 on turn 1 (the hole is not a step), 1 on turn 2
    out = run("reinforce_plus_plus", AdvInputs(sequence_rewards_to_tokens(torch.tensor([1.0, 0.0, 0.0]), HOLED), HOLED, torch.arange(3)),
              AdvParams(gamma=0.5))  # fmt: skip
    close(out.returns, [[0.25, 0.5, 0, 0, 1.0, 0], [0.0] * 6, [0.0] * 6])


def test_gae_and_remax_with_a_hole_by_hand():
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    # GAE, gamma = lam = 0.5: t=2: delta = 1 - 0.5 = 0.5, A = 0.5; the hole (its 9 and 7 ignored)
    # carries V_2 = 0.5 and A = 0.5 back to t=0: delta = 0 + 0.5 * 0.5 - 0.5 = -0.25,
    # A = -0.25 + 0.25 * 0.5 = -0.125. Returns A + V = 0.375, 1.0. Whitened over the two
    # tokens: mean 0.1875, deviations -+0.3125, unbiased var 2 * 0.3125^2 = 0.1953125.
    out = run("gae", AdvInputs(torch.tensor([[0.0, 9.0, 1.0]]), mask, torch.zeros(1, dtype=torch.long),
                               values=torch.tensor([[0.5, 7.0, 0.5]])), AdvParams(gamma=0.5, lam=0.5))  # fmt: skip
    close(out.returns, [[0.375, 0.0, 1.0]])
    w = 0.3125 / math.sqrt(0.1953125 + 1e-8)
    close(out.advantages, [[-w, 0.0, w]], atol=1e-6)
    # ReMax: a per-token KL penalty -0.1 on both model tokens, reward 1 on the last; baseline 0.3
    # G_2 = 0.9, G_0 = -0.1 + 0.9 = 0.8 (across the hole); A = G - 0.3
    out = run("remax", AdvInputs(torch.tensor([[-0.1, 5.0, 0.9]]), mask, torch.zeros(1, dtype=torch.long),
                                 baseline_rewards=torch.tensor([0.3])))  # fmt: skip
    close(out.returns, [[0.8, 0.0, 0.9]])
    close(out.advantages, [[0.5, 0.0, 0.6]])


def _compact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's response-token values moved left (holes dropped), zero-padded."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        vals = x[i][mask[i].bool()]
        out[i, : len(vals)] = vals
    return out


def _holed_batch(seed: int):
    """Random responses with holes in 2 groups of 3, and the same batch with the holes removed."""
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    mask = torch.zeros(B, T)
    for i in range(B):
        n = int(torch.randint(3, T + 1, (1,), generator=g))
        mask[i, :n] = 1.0
        if i % 2 == 0:  # a tool output inside the response
            start = int(torch.randint(1, max(n - 1, 2), (1,), generator=g))
            mask[i, start : min(start + 2, n - 1)] = 0.0
    rewards = torch.rand(B, generator=g).round(decimals=1)
    garbage = torch.full((B, T), 99.0)
    kl_like = torch.where(mask > 0, -0.01 * torch.rand(B, T, generator=g), garbage)  # per-token rewards, garbage in holes
    token_rewards = sequence_rewards_to_tokens(rewards, mask) + kl_like
    values = torch.where(mask > 0, torch.rand(B, T, generator=g), garbage)
    old = torch.where(mask > 0, -torch.rand(B, T, generator=g), garbage)
    pi2 = torch.where(mask > 0, 0.2 + 0.5 * torch.rand(B, T, generator=g), garbage)
    group, base = torch.tensor([0, 0, 0, 1, 1, 1]), torch.rand(B, generator=g)
    holed = AdvInputs(token_rewards, mask, group, values=values, baseline_rewards=base, old_logprob=old, sum_pi_squared=pi2)
    cm = _compact(mask, mask)
    compact = AdvInputs(
        _compact(token_rewards, mask), cm, group, values=_compact(values, mask), baseline_rewards=base,
        old_logprob=_compact(old, mask), sum_pi_squared=_compact(pi2, mask),
    )  # fmt: skip
    return holed, compact


@pytest.mark.parametrize("name", ADV_ESTIMATORS.names())
@pytest.mark.parametrize("seed", [0, 1])
def test_a_hole_is_invisible_to_every_estimator(name, seed):
    """Tool output inside the response (mask 0, anything in it) changes nothing: the model's
    tokens get exactly the advantages and returns they get with the hole cut out."""
    holed, compact = _holed_batch(seed)
    params = AdvParams(gamma=0.9, lam=0.8)
    out_h, out_c = run(name, holed, params), run(name, compact, params)
    keep = holed.response_mask.bool()
    assert finite(out_h.advantages, out_h.returns)
    assert out_h.advantages[~keep].abs().sum() == 0 and out_h.returns[~keep].abs().sum() == 0
    close(_compact(out_h.advantages, holed.response_mask), out_c.advantages, atol=1e-5)
    close(_compact(out_h.returns, holed.response_mask), out_c.returns, atol=1e-5)
    assert out_c.advantages.abs().sum() > 0


# ------------------------------------------------------------------------------------------- OPO


def test_opo_length_weighted_baseline_by_hand():
    # group 0: lengths 2, 1, 3 (row 2 with a hole: 3 model tokens over 4 positions), scores 1, 0, 4
    #   b = (2*1 + 1*0 + 3*4) / (2 + 1 + 3) = 14/6 = 7/3  (the plain mean would be 5/3)
    #   A = 1 - 7/3 = -4/3, 0 - 7/3 = -7/3, 4 - 7/3 = 5/3
    # group 1: row 3 alone keeps its score 2 (verl); group 2: rows 4, 5 both empty -> 0
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 0, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]])
    out = outcome("opo", [1.0, 0.0, 4.0, 2.0, 3.0, 3.0], [0, 0, 0, 1, 2, 2], mask)
    close(
        out.advantages,
        [[-4 / 3, -4 / 3, 0, 0], [-7 / 3, 0, 0, 0], [5 / 3, 0, 5 / 3, 5 / 3], [2.0] * 4, [0.0] * 4, [0.0] * 4],
        atol=1e-6,
    )
    close(out.returns, out.advantages)


def test_opo_equal_lengths_is_dr_grpo_and_equal_scores_give_zero():
    mask = lengths_mask([3, 3, 3, 2, 4], 4)
    rewards, group = [1.0, 0.0, 0.5, 0.7, 0.7], [0, 0, 0, 1, 1]
    dr_grpo = outcome("grpo", rewards, group, mask, AdvParams(norm_adv_by_std=False)).advantages
    close(outcome("opo", rewards, group, mask).advantages, dr_grpo)  # equal lengths: the plain group mean
    assert outcome("opo", rewards, group, mask).advantages[3:].abs().max() < 1e-6  # equal scores, unequal lengths


# ------------------------------------------------------------------------------------------- GPG


def test_gpg_by_hand():
    # scores 1, 0, 0 | 1, 1 | 0.5 alone | an empty (masked-out) row alone
    # B = 6 non-empty responses, M = 4 non-zero scores: alpha = 6 / 4 = 1.5
    # group 0: mean 1/3 -> 1.5 * 2/3 = 1, 1.5 * -1/3 = -0.5 (twice); group 1: 0, 0
    # the singleton: baseline 0 -> 1.5 * 0.5 = 0.75; the empty row: nothing
    mask = lengths_mask([2, 2, 2, 2, 2, 2, 0], 2)
    out = outcome("gpg", [1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 7.0], [0, 0, 0, 1, 1, 2, 3], mask)
    close(out.advantages[:, 0], [1.0, -0.5, -0.5, 0.0, 0.0, 0.75, 0.0])
    close(out.advantages[:, 1], out.advantages[:, 0])


def test_gpg_all_zero_rewards_and_empty_batch_are_finite_zero():
    out = outcome("gpg", [0.0, 0.0, 0.0], [0, 0, 1], lengths_mask([1, 2, 1], 2))
    assert out.advantages.abs().sum() == 0 and finite(out.advantages)
    out = outcome("gpg", [1.0, 2.0], [0, 0], torch.zeros(2, 3))
    assert out.advantages.abs().sum() == 0 and finite(out.advantages)


# ---------------------------------------------------------------------------------- GRPO pass@k


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_only_the_best_learns_by_hand(norm):
    # group 0: 0.2, 0.9, 0.5, 0.1: best row 1 by 0.9 - 0.5 = 0.4; mean 0.425, unbiased var
    #   (0.050625 + 0.225625 + 0.005625 + 0.105625) / 3 = 0.3875 / 3
    # group 1: a tie 1, 1 -> margin 0 (the first row would get it); group 2: alone -> 0
    mask = lengths_mask([2, 3, 1, 2, 2, 2, 1], 3)
    out = outcome("grpo_passk", [0.2, 0.9, 0.5, 0.1, 1.0, 1.0, 5.0], [0, 0, 0, 0, 1, 1, 2], mask, AdvParams(norm_adv_by_std=norm))
    best = 0.4 / (math.sqrt(0.3875 / 3) + EPS) if norm else 0.4
    expected = torch.zeros(7, 3)
    expected[1] = best
    close(out.advantages, expected * mask, atol=1e-5)
    if norm:
        assert out.advantages[1, 0].item() == pytest.approx(1.11297, abs=1e-4)  # 0.4 / 0.359398


def test_grpo_passk_tie_goes_to_the_first_row():
    out = outcome("grpo_passk", [0.0, 1.0, 1.0, 0.0], [0, 0, 0, 0], torch.ones(4, 1), AdvParams(norm_adv_by_std=False))
    close(out.advantages[:, 0], [0.0, 0.0, 0.0, 0.0])  # margin 0
    out = outcome("grpo_passk", [0.0, 1.0, 1.0, 3.0], [5, 5, 5, 7], torch.ones(4, 1), AdvParams(norm_adv_by_std=False))
    close(out.advantages[:, 0], [0.0, 0.0, 0.0, 0.0])  # row 3 alone


# ------------------------------------------------------------------------ optimal token baseline


def otb_inputs(mask, rewards, pi, pi2, group):
    return AdvInputs(
        sequence_rewards_to_tokens(torch.tensor(rewards), mask), mask, torch.tensor(group),
        old_logprob=torch.tensor(pi).log(), sum_pi_squared=torch.tensor(pi2),
    )  # fmt: skip


def test_optimal_token_baseline_by_hand():
    # row a: 3 tokens, pi = 0.5, sum pi^2 = 0.5: w = 1 - 1 + 0.5 = 0.5, W = 0.5, 1.0, 1.5; reward 1: G = 1, 1, 1
    # row b: 2 tokens, pi = 0.25, sum pi^2 = 0.25: w = 1 - 0.5 + 0.25 = 0.75, W = 0.75, 1.5; reward 0: G = 0, 0
    # B_0 = (1 * 0.5 + 0) / (0.5 + 0.75) = 0.4;  B_1 = (1 * 1.0 + 0) / (1.0 + 1.5) = 0.4
    # token 2: only a is left; the zero tail sets its baseline to 0: A = G = 1
    mask = lengths_mask([3, 2], 3)
    inputs = otb_inputs(mask, [1.0, 0.0], [[0.5, 0.5, 0.5], [0.25, 0.25, 0.9]], [[0.5] * 3, [0.25, 0.25, 0.9]], [0, 0])
    out = run("optimal_token_baseline", inputs)
    close(out.advantages, [[0.6, 0.6, 1.0], [-0.4, -0.4, 0.0]], atol=1e-6)
    close(out.returns, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    # the same with a tool output between a's first and second token: token k still lines up with k
    holed = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    inputs = otb_inputs(
        holed, [1.0, 0.0], [[0.5, 0.01, 0.5, 0.5], [0.25, 0.25, 1.0, 1.0]], [[0.5, 3.0, 0.5, 0.5], [0.25, 0.25, 1.0, 1.0]], [0, 0]
    )
    out = run("tir_optimal_token_baseline", inputs)
    close(out.advantages, [[0.6, 0.0, 0.6, 1.0], [-0.4, -0.4, 0.0, 0.0]], atol=1e-6)


def _verl_single_turn_otb(inputs: AdvInputs) -> torch.Tensor:
    """verl's `compute_optimal_token_baseline_advantage` transcribed position by position
    (the reference for prefix masks)."""
    m = inputs.response_mask
    returns = (inputs.token_rewards * m).flip(-1).cumsum(-1).flip(-1)
    w_cum = ((1 - 2 * inputs.old_logprob.exp() + inputs.sum_pi_squared) * m).cumsum(-1)
    baselines = torch.zeros_like(returns)
    for g in inputs.group.unique().tolist():
        idx = torch.nonzero(inputs.group == g).flatten()
        if len(idx) == 1:
            continue
        num = (returns[idx] * w_cum[idx] * m[idx]).sum(0)
        den = (w_cum[idx] * m[idx]).sum(0) + 1e-8
        baselines[idx] = num / den
        lengths = m[idx].sum(-1)
        srt = torch.sort(lengths).values
        mx, second = int(srt[-1]), int(srt[-2])
        at = torch.nonzero(lengths == mx).flatten()
        if at.numel() == 1 and mx > second:
            baselines[idx[at[0]], second:] = 0.0
    return (returns - baselines) * m


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_optimal_token_baseline_matches_verl_on_prefix_masks(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 8, 7
    mask = lengths_mask(torch.randint(1, T + 1, (B,), generator=g).tolist(), T)
    logits = torch.randn(B, T, 5, generator=g)
    tokens = torch.randint(0, 5, (B, T), generator=g)
    old = logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    inputs = AdvInputs(
        sequence_rewards_to_tokens(torch.rand(B, generator=g), mask), mask, torch.tensor([0, 0, 0, 1, 1, 1, 1, 2]),
        old_logprob=old, sum_pi_squared=sum_pi_squared(logits),
    )  # fmt: skip
    close(run("optimal_token_baseline", inputs).advantages, _verl_single_turn_otb(inputs), atol=1e-5)


def test_optimal_token_baseline_degenerate_cases():
    mask = lengths_mask([2, 2, 2, 0, 3], 3)
    pi, pi2 = torch.full((5, 3), 0.5).tolist(), torch.full((5, 3), 0.4).tolist()
    # equal rewards and lengths in group 0: B_k = G_k W / (W + 1e-8), so A ~ 0; the empty row 3
    # does not count, which leaves row 4 alone in group 1: A = G (no baseline)
    out = run("optimal_token_baseline", otb_inputs(mask, [1.0, 1.0, 1.0, 5.0, 2.0], pi, pi2, [0, 0, 0, 1, 1]))
    assert out.advantages[:3].abs().max() < 1e-6 and out.advantages[3].abs().sum() == 0
    close(out.advantages[4], [2.0, 2.0, 2.0])
    # a deterministic policy (pi = 1, sum pi^2 = 1): w = 0, B = 0 / (0 + 1e-8) = 0: A = G, finite
    ones = torch.ones(5, 3).tolist()
    out = run("optimal_token_baseline", otb_inputs(mask, [1.0, 0.0, 1.0, 5.0, 2.0], ones, ones, [0, 0, 0, 1, 1]))
    assert finite(out.advantages)
    close(out.advantages[:3, 0], [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="old_logprob"):
        run("optimal_token_baseline", AdvInputs(torch.zeros(2, 2), torch.ones(2, 2), torch.zeros(2, dtype=torch.long)))


def test_sum_pi_squared_by_hand_and_finite_for_huge_logits():
    # logits ln 1, ln 2, ln 3: pi = 1/6, 2/6, 3/6, sum pi^2 = 14/36
    logits = torch.tensor([[math.log(1), math.log(2), math.log(3)], [1000.0, -1000.0, 0.0]])
    close(sum_pi_squared(logits), [14 / 36, 1.0])
    assert not sum_pi_squared(logits.requires_grad_()).requires_grad


# -------------------------------------------------------------------- no gradient through advantages


@pytest.mark.parametrize("name", ADV_ESTIMATORS.names())
def test_advantages_carry_no_gradient(name):
    """Advantages and returns are constants for the policy loss: a reward, value or log-prob
    that requires grad (a reward model's output, the critic's values) must not leak a graph."""
    holed, _ = _holed_batch(3)
    leaves = {
        f: getattr(holed, f).clone().requires_grad_(True)
        for f in ("token_rewards", "values", "baseline_rewards", "old_logprob", "sum_pi_squared")
    }
    inputs = AdvInputs(response_mask=holed.response_mask, group=holed.group, **leaves)
    out = run(name, inputs, AdvParams(gamma=0.9, lam=0.8))
    assert not out.advantages.requires_grad and not out.returns.requires_grad
    assert out.advantages.grad_fn is None and out.returns.grad_fn is None


# ------------------------------------------------------------------------------------- token-sum


def test_token_sum_by_hand_with_analytic_gradient_and_micro_batches():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])  # a hole, an empty row
    agg = LOSS_AGGREGATIONS.get("token-sum")
    norm = Normaliser(tokens=4.0, sequences=2.0, max_response_length=3)
    value = agg(loss, mask, norm)
    assert value.item() == 1 + 3 + 7 + 8  # 19: no normaliser
    value.backward()
    close(loss.grad, mask)  # d/d loss_ij = m_ij
    # micro-batches of one row add up to the whole; the normaliser's counts do not matter
    parts = sum(agg(loss[i : i + 1].detach(), mask[i : i + 1], Normaliser(1.0, 1.0)) for i in range(3))
    assert parts.item() == 19.0
    assert agg(loss.detach(), torch.zeros(3, 3), norm).item() == 0.0
