"""Advantage estimators. All share one signature so the trainer can call any of them:

    fn(inputs: AdvInputs, params: AdvParams) -> AdvOutput   # advantages and returns, [B, T]

`token_rewards` holds each sequence's reward on its last response token (plus any
per-token KL penalty when the KL is in the reward); outcome estimators use its sum.
Each estimator is registered, with the inputs it needs, by its line in catalog/algorithms.py.

Masks may have holes: in a multi-turn rollout the tool output inside the response is
mask 0. Nothing here treats the mask as a prefix: the last response token is the last 1
(`last_token_index`), not `mask.sum() - 1`, and returns-to-go run across holes.
Advantages are constants for the policy loss: every estimator detaches its inputs, so no
gradient flows back into rewards, values or log-probs through them.
More estimators (OPO, GPG, pass@k, optimal token baseline) are in advantages_outcome.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdvParams:
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    epsilon: float = 1e-6


@dataclass
class AdvInputs:
    token_rewards: torch.Tensor  # [B, T]
    response_mask: torch.Tensor  # [B, T] float
    group: torch.Tensor  # [B] int64: samples of the same prompt share a group
    values: torch.Tensor | None = None  # [B, T] critic values (GAE)
    baseline_rewards: torch.Tensor | None = None  # [B] reward of a baseline response (ReMax)
    old_logprob: torch.Tensor | None = None  # [B, T] the policy's log-probs before the update (OTB)
    sum_pi_squared: torch.Tensor | None = None  # [B, T] sum over the vocabulary of pi^2 per token (OTB)

    @property
    def scores(self) -> torch.Tensor:
        """One scalar per sequence (detached: advantages carry no gradient)."""
        return (self.token_rewards.detach() * self.response_mask).sum(-1)


@dataclass
class AdvOutput:
    advantages: torch.Tensor  # [B, T], zero outside the response mask
    returns: torch.Tensor  # [B, T], the value target where a critic is trained


def group_stats(values: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, group mean and unbiased group std (0 for a group of one)."""
    _, inverse, counts = torch.unique(group, return_inverse=True, return_counts=True)
    counts_f = counts.to(values.dtype)
    mean = torch.zeros_like(counts_f).index_add_(0, inverse, values) / counts_f
    sq = torch.zeros_like(counts_f).index_add_(0, inverse, (values - mean[inverse]).square())
    std = torch.where(counts > 1, (sq / (counts_f - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return counts[inverse], mean[inverse], std[inverse]


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> AdvOutput:
    adv = per_seq.unsqueeze(-1) * mask
    return AdvOutput(advantages=adv, returns=adv)


def grpo(inputs: AdvInputs, params: AdvParams) -> AdvOutput:
    """GRPO (Shao et al., 2024): A = (r - mean_group) / (std_group + eps).

    With `norm_adv_by_std=False` this is Dr. GRPO (Liu et al., 2025): A = r - mean_group.
    A group of one, or a group whose rewards are all equal, has advantage 0: it carries no
    signal about which sample was better.
    """
    scores = inputs.scores.float()
    count, mean, std = group_stats(scores, inputs.group)
    adv = scores - mean
    if params.norm_adv_by_std:
        adv = adv / (std + params.epsilon)
    return _broadcast(torch.where(count > 1, adv, torch.zeros_like(adv)), inputs.response_mask)


def rloo(inputs: AdvInputs, params: AdvParams) -> AdvOutput:
    """RLOO (Ahmadian et al., 2024): baseline is the mean of the *other* samples of the group,
    A_i = r_i - (sum_group - r_i) / (n - 1) = n / (n - 1) * (r_i - mean_group).
    A group of one has advantage 0."""
    scores = inputs.scores.float()
    count, mean, _ = group_stats(scores, inputs.group)
    n = count.to(scores.dtype)
    adv = torch.where(count > 1, n / (n - 1).clamp(min=1) * (scores - mean), torch.zeros_like(mean))
    return _broadcast(adv, inputs.response_mask)


def remax_baselines(prompt_index: torch.Tensor, greedy_prompt_index: torch.Tensor, greedy_scores: torch.Tensor) -> torch.Tensor:
    """ReMax: [B] baseline of each sample, the score of the greedy response to its prompt
    (`greedy_*`: one row per greedy response; a prompt seen twice keeps its last score)."""
    by_prompt = dict(zip(greedy_prompt_index.tolist(), greedy_scores.tolist()))
    return torch.tensor([by_prompt[i] for i in prompt_index.tolist()])


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """[B] int64: the position of each row's last 1 in `mask` [B, T], -1 for an empty row.

    This, not `mask.sum() - 1`, is the last response token: a multi-turn mask has holes
    (tool output inside the response is 0), so the count of 1s falls short of it."""
    keep = mask.bool()
    if keep.shape[-1] == 0:
        return torch.full(keep.shape[:-1], -1, dtype=torch.long, device=mask.device)
    pos = torch.arange(keep.shape[-1], device=mask.device).expand_as(keep)
    return torch.where(keep, pos, -1).amax(-1)


def response_span_lengths(mask: torch.Tensor) -> torch.Tensor:
    """[B] int64: positions up to and including each row's last response token, holes
    (tool output) included; the prefix of `response_ids` that is the trajectory. Equals
    `mask.sum(-1)` when the mask has no holes."""
    return last_token_index(mask) + 1


def sequence_rewards_to_tokens(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] rewards placed on each sequence's last response token (the last 1 of its mask,
    after any hole), [B, T]. An empty response gets no reward: it has no token to hold it."""
    token_rewards = torch.zeros_like(response_mask, dtype=torch.float32)
    last = last_token_index(response_mask)
    rows = torch.nonzero(last >= 0).flatten()
    token_rewards[rows, last[rows]] = rewards.detach().float().to(token_rewards.device)[rows]
    return token_rewards


# --------------------------------------------------------------------------- token-level helpers

WHITEN_EPS = 1e-8  # added to the variance, as verl's masked_whiten


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = WHITEN_EPS) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with mean and *unbiased* variance over the tokens where
    `mask` is 1 (verl's `masked_whiten`, shift_mean=True). Zero outside the mask.

    Finite in every corner: an empty mask, a single token, or a constant `x` (over the mask)
    give exactly zero; padded positions may hold anything, NaN included (a NaN on a masked-in
    token gives NaN: garbage in real data is not hidden). Statistics are
    taken in float64 so a constant float32 input centres to exactly 0.
    """
    keep = mask.bool()
    m = keep.to(torch.float64)
    xd = torch.where(keep, x.to(torch.float64), 0.0)
    n = m.sum()
    mean = xd.sum() / n.clamp(min=1.0)
    centered = (xd - mean) * m
    var = centered.square().sum() / (n - 1.0).clamp(min=1.0)
    out = centered * torch.rsqrt(var + eps)
    if x.numel():  # exactly 0 for a constant (over the mask) or empty input
        spread = torch.where(keep, xd, -math.inf).max() - torch.where(keep, xd, math.inf).min()
        out = torch.where(spread == 0, 0.0, out)  # NaN on a real token stays visible
    out_dtype = x.dtype if x.is_floating_point() else torch.float32
    return out.to(out_dtype)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go G_t = r_t + gamma * G_{t'} over response tokens, [B, T] float32, where
    t' is the next response token (mask 1) after t.

    A hole in a multi-turn mask (tool output) is skipped, not a reset: the reward at the end
    of the conversation reaches the tokens of every earlier turn, and gamma discounts per
    response token (the observation tokens are not the model's actions), as GAE carries V
    and A across holes. Padding after the last response token holds no reward, so the
    return there stays 0 (verl's "reset after EOS"); G is 0 outside the mask.
    """
    keep = mask.bool()
    m = keep.to(torch.float32)
    r = torch.where(keep, token_rewards.detach().float(), 0.0)
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in reversed(range(r.shape[1])):
        running = torch.where(keep[:, t], r[:, t] + gamma * running, running)
        out[:, t] = running * m[:, t]
    return out


def _masked_scores(inputs: AdvInputs) -> torch.Tensor:
    """Like `AdvInputs.scores`, but padding is never read (NaN there cannot leak: nan * 0 = nan)."""
    keep = inputs.response_mask.bool()
    return torch.where(keep, inputs.token_rewards.detach().float(), 0.0).sum(-1)


def _require(inputs: AdvInputs, field: str, estimator: str) -> torch.Tensor:
    value = getattr(inputs, field)
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs AdvInputs.{field}")
    return value


# --------------------------------------------------------------------------- critic / token-level


def gae(inputs: AdvInputs, params: AdvParams) -> AdvOutput:
    """Generalised Advantage Estimation (Schulman et al., 2016, arXiv:1506.02438), as in PPO:

        delta_t = r_t + gamma * V_{t+1} - V_t,    A_t = delta_t + gamma * lam * A_{t+1},
        returns_t = A_t + V_t  (the critic's target, before whitening),

    then the advantages are whitened over all masked tokens of the batch (masked mean and
    unbiased std, `masked_whiten`), always (verl). V after the last response token is 0;
    masked-out positions are skipped (V and A carry through them, verl's multi-turn rule).
    Uses `inputs.values` [B, T], `params.gamma`, `params.lam`; both outputs are zero outside
    the mask. A batch whose raw advantages are all equal gets advantages 0.
    """
    values = _require(inputs, "values", "gae")
    keep = inputs.response_mask.bool()
    m = keep.to(torch.float32)
    v = torch.where(keep, values.detach().float(), 0.0)
    r = torch.where(keep, inputs.token_rewards.detach().float(), 0.0)
    B, T = r.shape
    next_value = torch.zeros(B, dtype=torch.float32, device=r.device)
    last = torch.zeros_like(next_value)
    adv = torch.zeros_like(r)
    for t in reversed(range(T)):
        delta = r[:, t] + params.gamma * next_value - v[:, t]
        a_t = delta + params.gamma * params.lam * last
        next_value = v[:, t] * m[:, t] + (1.0 - m[:, t]) * next_value
        last = a_t * m[:, t] + (1.0 - m[:, t]) * last
        adv[:, t] = last
    returns = (adv + v) * m
    return AdvOutput(advantages=masked_whiten(adv, m) * m, returns=returns)


def reinforce_plus_plus(inputs: AdvInputs, params: AdvParams) -> AdvOutput:
    """REINFORCE++ (Hu et al., 2025, arXiv:2501.03262):

        G_t = sum_{s >= t} gamma^(s - t) r_s   (reset at the end of each response),
        A = whiten(G) over all masked tokens of the batch (global, not per group).

    `returns` are the unwhitened G. Equal returns everywhere (e.g. all rewards equal and
    gamma = 1) whiten to exactly 0.
    """
    returns = discounted_returns(inputs.token_rewards, inputs.response_mask, params.gamma)
    m = inputs.response_mask.to(torch.float32)
    return AdvOutput(advantages=masked_whiten(returns, m) * m, returns=returns)


def reinforce_plus_plus_baseline(inputs: AdvInputs, params: AdvParams) -> AdvOutput:
    """REINFORCE++-baseline (Hu et al., 2025, arXiv:2501.03262; verl's
    `compute_reinforce_plus_plus_baseline_outcome_advantage`):

        s_i' = s_i - mean_{j in group(i)} s_j          (s = sum of token rewards),
        G_t = return-to-go of s_i' placed on the last response token (gamma; with the
              default gamma = 1 every response token carries s_i', exactly as verl),
        A = returns = whiten(G) over all masked tokens of the batch.

    As in verl, a group of one keeps its raw score (baseline 0). Because the whitening is
    over the batch, a group whose rewards are all equal gets -mean/std, not 0; a batch with
    one score everywhere gets 0.
    """
    scores = _masked_scores(inputs)
    count, mean, _ = group_stats(scores, inputs.group)
    centered = scores - torch.where(count > 1, mean, torch.zeros_like(mean))
    token = sequence_rewards_to_tokens(centered, inputs.response_mask)
    rtg = discounted_returns(token, inputs.response_mask, params.gamma)
    m = inputs.response_mask.to(torch.float32)
    adv = masked_whiten(rtg, m) * m
    return AdvOutput(advantages=adv, returns=adv)


def remax(inputs: AdvInputs, params: AdvParams) -> AdvOutput:
    """ReMax (Li et al., 2024, arXiv:2310.10505): the baseline is the reward b_i of a greedy
    response to the same prompt (`inputs.baseline_rewards`, [B]):

        G_t = sum_{s >= t} r_s   (undiscounted, reset at the end of the response),
        A_t = G_t - b_i on response tokens;  returns = G.

    No normalisation (verl). `params.gamma` is not used.
    """
    baseline = _require(inputs, "baseline_rewards", "remax")
    returns = discounted_returns(inputs.token_rewards, inputs.response_mask, 1.0)
    m = inputs.response_mask.to(torch.float32)
    return AdvOutput(advantages=returns - baseline.detach().float().unsqueeze(-1) * m, returns=returns)
