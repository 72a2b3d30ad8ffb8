"""More advantage estimators from verl's catalogue, with the shared signature of advantages.py:
OPO (length-weighted group baseline), GPG (batch-rescaled group baseline), GRPO pass@k
(only each group's best sample learns) and the optimal token baseline (OTB, a per-token
group baseline weighted by the policy's accumulated uncertainty).

Formulas follow verl's `verl/trainer/ppo/core_algos.py`; each docstring names the verl
function and the paper, and docs/algorithms.md lists where ratchet deliberately differs.
Like every estimator, these detach their inputs (advantages are constants for the loss)
and handle masks with holes (multi-turn tool output is mask 0 inside the response).
"""

from __future__ import annotations

import torch

from .advantages import AdvInputs, AdvOutput, AdvParams, _broadcast, _masked_scores, _require, group_stats

OTB_EPS = 1e-8  # verl's epsilon in the OTB baseline's denominator


def _group_sum(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Per sample: the sum of `values` over its group."""
    _, inverse = torch.unique(group, return_inverse=True)
    sums = torch.zeros(int(inverse.max().item()) + 1 if inverse.numel() else 0, dtype=values.dtype, device=values.device)
    return sums.index_add_(0, inverse, values)[inverse]


def opo(inputs: AdvInputs, params: AdvParams) -> AdvOutput:
    """OPO, on-policy RL with the optimal reward baseline (Hao et al., 2025, arXiv:2505.23585;
    verl's `compute_opo_outcome_advantage`): the baseline is the group's length-weighted
    mean score, the variance-minimising baseline when a sequence's gradient norm grows with
    its length,

        b_g = sum_{j in g} |y_j| s_j / sum_{j in g} |y_j|,    A_i = s_i - b_g  (no std),

    broadcast on the response. |y| counts response tokens (mask 1s; tool output in a hole is
    not the model's). A group of one keeps its raw score (baseline 0, as verl); a group whose
    responses are all empty has baseline 0 (verl would divide 0 by 0).
    """
    scores = _masked_scores(inputs)
    lengths = inputs.response_mask.bool().sum(-1).to(scores.dtype)
    count, _, _ = group_stats(scores, inputs.group)
    weighted, total = _group_sum(lengths * scores, inputs.group), _group_sum(lengths, inputs.group)
    baseline = torch.where((count > 1) & (total > 0), weighted / total.clamp(min=1.0), torch.zeros_like(scores))
    return _broadcast(scores - baseline, inputs.response_mask)


def gpg(inputs: AdvInputs, params: AdvParams) -> AdvOutput:
    """GPG, group policy gradient (Chu et al., 2025, arXiv:2504.02546; verl's
    `compute_gpg_outcome_advantage`): the group mean baseline, no std, rescaled by how few
    samples carry a reward,

        alpha = B / max(M, 1),    A_i = alpha * (s_i - mean_g) / F_norm,   F_norm = 1,

    with B the number of responses and M the number of non-zero scores in the batch (verl's
    `count_nonzero`). B counts non-empty responses: rows that dynamic sampling masked out
    are not in the batch verl would see. A group of one has baseline 0 (verl): A = alpha * s.
    verl pairs it with its `gpg` loss (-A log pi, no ratio); any registered loss works here.
    """
    scores = _masked_scores(inputs)
    responses = inputs.response_mask.bool().any(-1).sum().to(scores.dtype)
    alpha = responses / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    count, mean, _ = group_stats(scores, inputs.group)
    baseline = torch.where(count > 1, mean, torch.zeros_like(mean))
    return _broadcast(alpha * (scores - baseline), inputs.response_mask)


def grpo_passk(inputs: AdvInputs, params: AdvParams) -> AdvOutput:
    """GRPO for pass@k (Walder & Karkhanis, 2025, "Pass@K Policy Optimization",
    arXiv:2503.19595; verl's `compute_grpo_passk_outcome_advantage`): in each group only the
    best sample learns, by its margin over the runner-up,

        A_best = (s_max - s_second) / (std_g + eps)   (no division with norm_adv_by_std=False),
        A_other = 0.

    Ties go to the first row (deterministic; the margin of a tie is 0 anyway). A group of
    one gets 0: verl raises instead, and the config already demands rollout.n >= 2.
    """
    scores = _masked_scores(inputs)
    _, _, std = group_stats(scores, inputs.group)
    adv = torch.zeros_like(scores)
    for g in torch.unique(inputs.group).tolist():
        rows = torch.nonzero(inputs.group == g).flatten()
        if rows.numel() < 2:
            continue
        order = torch.sort(scores[rows], descending=True, stable=True).indices
        best = rows[order[0]]
        margin = scores[best] - scores[rows[order[1]]]
        adv[best] = margin / (std[best] + params.epsilon) if params.norm_adv_by_std else margin
    return _broadcast(adv, inputs.response_mask)


def sum_pi_squared(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] sum over the vocabulary of pi^2, in log space (verl's
    `calculate_sum_pi_squared_from_logits`): exp(logsumexp(2 z) - 2 logsumexp(z))."""
    z = logits.detach().float()
    return torch.exp(torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1))


def optimal_token_baseline(inputs: AdvInputs, params: AdvParams) -> AdvOutput:
    """Optimal token baseline, OTB (Li et al., 2026, "The Optimal Token Baseline: Variance
    Reduction for Long-Horizon LLM-RL", arXiv:2602.07078; verl's
    `compute_multi_turn_optimal_token_baseline_advantage`, which equals its single-turn
    `compute_optimal_token_baseline_advantage` when the mask has no holes).

    Per response token k (the k-th token with mask 1, so holes are skipped) of each group:

        G_k = sum of the rewards from token k on (undiscounted, across holes),
        w_j = 1 - 2 pi_j + sum_v pi_v^2   (the logit-gradient proxy of ||grad log pi_j||^2),
        W_k = sum_{j <= k} w_j            (the "realized energy" up to token k),
        B_k = sum_i G_k^i W_k^i / (sum_i W_k^i + 1e-8)   over the group's responses long
              enough to have a token k,
        A_k = G_k - B_k;   returns = G.

    pi_j = exp(`inputs.old_logprob`), sum pi^2 = `inputs.sum_pi_squared` (the trainer
    computes both in one forward pass when the catalog flags `needs_sum_pi_squared`).
    A group of one (empty responses do not count) gets baseline 0: A = G. verl's zero tail:
    where a group's single longest response runs past the second longest, its baseline is 0
    (only it would be left, and B_k = G_k would zero its advantage). No whitening, no std,
    and gamma is not used (verl). ratchet does not rescale w by the squared rollout IS
    weights as verl does when rollout IS is on: the off-policy correction runs after the
    advantages here.
    """
    old_logprob = _require(inputs, "old_logprob", "optimal_token_baseline").detach()
    pi2 = _require(inputs, "sum_pi_squared", "optimal_token_baseline").detach()
    keep = inputs.response_mask.bool()
    m = keep.to(torch.float32)
    r = torch.where(keep, inputs.token_rewards.detach().float(), 0.0)
    returns = r.flip(-1).cumsum(-1).flip(-1) * m
    w = torch.where(keep, 1.0 - 2.0 * old_logprob.float().exp() + pi2.float(), 0.0)
    energy = w.cumsum(-1)
    # Compact each row to its response tokens: token k of every response lines up, holes skipped.
    lengths = keep.sum(-1)
    width = int(lengths.max().item()) if lengths.numel() else 0
    rows, cols = torch.nonzero(keep, as_tuple=True)
    k = (keep.cumsum(-1) - 1)[rows, cols]
    g_c = torch.zeros(keep.shape[0], width, dtype=torch.float32, device=r.device)
    w_c = torch.zeros_like(g_c)
    g_c[rows, k], w_c[rows, k] = returns[rows, cols], energy[rows, cols]
    baseline = torch.zeros_like(g_c)
    for g in torch.unique(inputs.group[lengths > 0]).tolist():
        members = torch.nonzero((inputs.group == g) & (lengths > 0)).flatten()
        if members.numel() < 2:
            continue
        b = (g_c[members] * w_c[members]).sum(0) / (w_c[members].sum(0) + OTB_EPS)
        baseline[members] = b.to(baseline.dtype)
        member_lengths = lengths[members]
        top2 = torch.topk(member_lengths, 2).values.tolist()
        if top2[0] > top2[1] and int((member_lengths == top2[0]).sum()) == 1:
            baseline[members[member_lengths.argmax()], top2[1] :] = 0.0
    adv = torch.zeros_like(r)
    adv[rows, cols] = g_c[rows, k] - baseline[rows, k]
    return AdvOutput(advantages=adv, returns=returns)
