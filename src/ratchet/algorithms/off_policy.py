"""Off-policy corrections for rollouts made by a policy other than the one being trained
(an older version in `one_step_off` / `fully_async`, or the same weights in an inference
engine whose numerics differ from the trainer's).

Three log-probs per token are in play: the behaviour policy mu that sampled the token
(`rollout_logprob`, stored with the batch), the proximal / "old" policy pi_old (`old_logprob`,
recomputed by the trainer before the update) and the policy being trained pi. A correction
looks only at the first two, once per batch (no gradient), and returns per-token `weights` to
multiply into the policy loss and a `mask` of the tokens kept:

    out = POLICY_LOSSES.get(name)(logprob, old_logprob, adv, mask, params)
    corr = off_policy_correction(mode, old_logprob=old, rollout_logprob=rollout, mask=mask, cap=cap, level=level)
    loss = aggregate(out.loss * corr.weights, corr.mask, norm)

The log-ratio is log w = old_logprob - rollout_logprob, at a `level`:
- "token":     log w_t                              (per token)
- "sequence":  sum_t log w_t                        (the product of the token ratios)
- "geometric": (1/|y|) sum_t log w_t                (geometric mean; length-independent)
A sequence-level weight is the same on every token of the sequence.

All of it works in log space and exponentiates only bounded values, so log-ratios of
+-1000 (or +-inf) give finite weights.

On top of the mode, verl's rollout correction (rollout_correction.py, settings in
off_policy_settings.py): explicit IS weights (`algorithm.off_policy.is_weights`: truncated
with asymmetric bounds, or IcePop-masked, optionally batch-normalised) and rejection
criteria (`algorithm.off_policy.rejection`: ratio, k2 or k3 at token, seq_sum, seq_mean or
seq_max level, all of which must pass), and the off-policy diagnostics in the metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ratchet.catalog.algorithms import OFF_POLICY
from .off_policy_settings import as_is_weights, as_rejection, is_weights_problems, mode_problems, raise_problems, rejection_problems
from .rollout_correction import LEVELS, Totals, add_diagnostics, batch_normalize, criterion_passes, finish_diagnostics
from .rollout_correction import importance_weights, level_log_ratio, ratio

__all__ = ["LEVELS", "Decision", "OffPolicyCorrection", "level_log_ratio", "off_policy_correction"]  # LEVELS, level_log_ratio: re-exported


@dataclass
class OffPolicyCorrection:
    weights: torch.Tensor  # [B, T] float, detached, 0 outside `mask`: multiply into the per-token loss
    mask: torch.Tensor  # [B, T] float: tokens kept (a subset of the input mask)
    metrics: dict[str, float] = field(default_factory=dict)
    # bypass: the trainer must use rollout_logprob as old_logprob in the policy loss (and may
    # skip recomputing old log-probs).
    use_rollout_as_old: bool = False


@dataclass
class Decision:
    """What a registered correction returns (see catalog/algorithms.py)."""

    weights: torch.Tensor  # [B, T] before masking
    keep: torch.Tensor  # [B, T] bool
    truncated: torch.Tensor | None = None  # [B, T] bool (tis)
    use_rollout_as_old: bool = False


def no_correction(log_w: torch.Tensor, keep: torch.Tensor, cap: float) -> Decision:
    """No correction: weights 1, every token kept."""
    return Decision(weights=torch.ones_like(log_w), keep=keep)


def tis(log_w: torch.Tensor, keep: torch.Tensor, cap: float) -> Decision:
    """Truncated importance sampling (Ionides, 2008; for LLM rollout/trainer mismatch Yao et
    al., 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"):
    w = min(pi_old / mu, cap) at the configured level; tokens are never dropped."""
    if not cap > 0:
        raise ValueError(f"tis needs cap > 0, got {cap}")
    log_cap = math.log(cap)
    truncated = (log_w > log_cap) & keep
    return Decision(weights=log_w.clamp(max=log_cap).exp(), keep=keep, truncated=truncated)


def decoupled(log_w: torch.Tensor, keep: torch.Tensor, cap: float) -> Decision:
    """Decoupled PPO (Hilton et al., 2022, "Batch size-invariance for policy optimization",
    arXiv:2110.00641; AReaL, Fu et al., 2025, arXiv:2505.24298): the behaviour weight
    w = pi_prox / mu multiplies the PPO loss, whose ratio is taken against the proximal
    policy `old_logprob`; tokens with w > cap are *masked out* (AReaL's behav_imp_weight_cap),
    not truncated. AReaL's level is "token"."""
    if not cap > 0:
        raise ValueError(f"decoupled needs cap > 0, got {cap}")
    log_cap = math.log(cap)
    kept = keep & (log_w <= log_cap)
    return Decision(weights=log_w.clamp(max=log_cap).exp(), keep=kept)


def bypass(log_w: torch.Tensor, keep: torch.Tensor, cap: float) -> Decision:
    """Use the behaviour policy as the old policy: PPO's ratio becomes pi / mu, whose clip
    then also bounds the rollout/trainer mismatch. Weights 1; the trainer substitutes
    old_logprob := rollout_logprob."""
    return Decision(weights=torch.ones_like(log_w), keep=keep, use_rollout_as_old=True)


def rejection(log_w: torch.Tensor, keep: torch.Tensor, cap: float) -> Decision:
    """Rejection sampling: drop what has w outside [1/cap, cap]. With level "sequence" (the
    product of token ratios) or "geometric" (their geometric mean, recommended for long
    responses: a tiny per-token mismatch compounds over thousands of tokens in the product)
    whole sequences are dropped; with "token", single tokens. Weights 1 on what is kept."""
    if not cap >= 1:
        raise ValueError(f"rejection needs cap >= 1, got {cap}")
    log_cap = math.log(cap)
    kept = keep & (log_w <= log_cap) & (log_w >= -log_cap)
    return Decision(weights=torch.ones_like(log_w), keep=kept)


def off_policy_correction(
    mode: str,
    *,
    old_logprob: torch.Tensor | None,
    rollout_logprob: torch.Tensor | None,
    mask: torch.Tensor,
    cap: float = 2.0,
    level: str = "token",
    is_weights: object | None = None,
    rejection: object | None = None,
    world_size: int = 1,
) -> OffPolicyCorrection:
    """Weights and kept mask for `mode` (`algorithm.off_policy.mode`: none, tis, decoupled,
    bypass, rejection) with `cap` and `level` (`algorithm.off_policy.{cap,level}`), then
    - `is_weights` (`algorithm.off_policy.is_weights`: an `ISWeights`, or any object or mapping
      with its fields; modes none and rejection only): weights pi_old / mu, truncated or
      IcePop-masked, optionally batch-normalised (rollout_correction.py);
    - `rejection` (`algorithm.off_policy.rejection`: a list of `RejectionCriterion`s or
      objects/mappings with their fields): a token is kept only if every criterion passes.
    `world_size` > 1: the trainer's ranks each call this on their rows, and batch
    normalisation and the metrics are reduced over all of them (collectives: every rank
    must call it).

    `old_logprob` may be None for "bypass", `rollout_logprob` may be None for "none" (then
    the rollout/trainer metrics are left out). Metrics are python floats of the global batch
    (means over the input `mask` tokens unless said otherwise):
      is_weight_mean, is_weight_max, ess: of the weights applied, over the kept tokens (ess:
        (sum w)^2 / (n sum w^2), in (0, 1], 1 when all are equal);
      frac_truncated (tis, truncate), frac_zeroed (icepop), frac_masked (tokens dropped),
      frac_seq_masked (of non-empty sequences, those with a token dropped),
      rs_<statistic>_<level>_frac_masked: tokens each rejection criterion drops,
      batch_norm_factor: the mean the weights were divided by;
      diagnostics (rollout_correction.finish_diagnostics): ppo_kl (= rollout_trainer_k1, the
        mean of log mu - log pi_old), rollout_trainer_kl (k3), training_ppl, rollout_ppl,
        their logs, log_ppl_diff, ppl_ratio, chi2_token, chi2_seq, ess_raw.
    """
    fn = OFF_POLICY.get(mode)
    spec, criteria = as_is_weights(is_weights), as_rejection(rejection)
    raise_problems(mode_problems(mode, spec, criteria), "algorithm.off_policy")
    if spec is not None:
        raise_problems(is_weights_problems(spec), "algorithm.off_policy.is_weights")
    raise_problems(rejection_problems(criteria), "algorithm.off_policy.rejection")
    keep = mask.bool()
    m = keep.float()
    if old_logprob is not None and rollout_logprob is not None:
        log_ratio = old_logprob.detach().float() - rollout_logprob.detach().float()
    elif mode in ("none", "bypass") and spec is None and not criteria:
        log_ratio = torch.zeros_like(m)
    else:
        raise ValueError(f"off-policy mode {mode!r} (with its is_weights and rejection) needs both old_logprob and rollout_logprob")
    with torch.no_grad():
        decision = fn(level_log_ratio(log_ratio, keep, level), keep, cap)
        kept = decision.keep & keep
        weights = decision.weights.float()
        passes = {c.name: criterion_passes(log_ratio, keep, c) for c in criteria}
        for p in passes.values():
            kept = kept & p
        totals = Totals(m.device, world_size)
        norm_factor = None
        if spec is not None:
            is_out = importance_weights(log_ratio, keep, spec)
            weights = weights * is_out.weights
            if spec.batch_normalize:
                weights, norm_factor = batch_normalize(weights, kept, spec.level, world_size)
            totals.add("truncated", (is_out.truncated & keep).sum())
            totals.add("zeroed", (is_out.zeroed & kept).sum())
        weights = torch.where(kept, weights, torch.zeros_like(m))
        if decision.truncated is not None:
            totals.add("truncated", (decision.truncated & keep).sum())
        totals.add("tokens", m.sum())
        totals.add("kept", kept.sum())
        totals.add("w", weights.sum())
        totals.add("w2", weights.double().square().sum())
        totals.max("w_max", weights[kept])
        has = keep.any(-1)
        totals.add("seqs", has.sum())
        totals.add("seqs_masked", (has & (keep & ~kept).any(-1)).sum())
        for name, p in passes.items():
            totals.add(f"rs_{name}", (keep & ~p).sum())
        add_diagnostics(totals, old_logprob, rollout_logprob, keep)
        t = totals.reduce()
    n, n_kept = t["tokens"], t["kept"]
    metrics = {
        "is_weight_mean": ratio(t["w"], n_kept),
        "is_weight_max": t["w_max"],
        "ess": ratio(t["w"] ** 2, n_kept * t["w2"]),
        "frac_truncated": ratio(t.get("truncated", 0.0), n),
        "frac_masked": ratio(n - n_kept, n),
        "frac_seq_masked": ratio(t["seqs_masked"], t["seqs"]),
    }
    if spec is not None:
        metrics["frac_zeroed"] = ratio(t["zeroed"], n)
    if norm_factor is not None:
        metrics["batch_norm_factor"] = norm_factor
    metrics.update({f"rs_{name}_frac_masked": ratio(t[f"rs_{name}"], n) for name in passes})
    metrics.update(finish_diagnostics(t, n))
    return OffPolicyCorrection(weights=weights, mask=kept.float(), metrics=metrics, use_rollout_as_old=decision.use_rollout_as_old)
