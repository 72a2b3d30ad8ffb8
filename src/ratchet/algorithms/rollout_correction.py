"""The parts of verl's rollout correction beyond the single-knob modes of off_policy.py:
importance weights with asymmetric truncation or IcePop masking and batch normalisation,
rejection criteria on the ratio, k2 or k3 at token or sequence (sum, mean, max) level, and
the off-policy diagnostics. All on detached tensors, without gradient.

Notation as in off_policy.py: per token, log rho_t = old_logprob - rollout_logprob, i.e. the
log of pi_old / mu. Follows verl's verl/trainer/ppo/rollout_corr_helper.py
(`compute_rollout_correction_weights`, `compute_rollout_rejection_mask`,
`compute_offpolicy_metrics`); the differences are listed in docs/algorithms.md.

Papers: truncated IS for the rollout/trainer mismatch, Yao et al. 2025, "Your Efficient RL
Framework Secretly Brings You Off-Policy RL Training" (blog post); masking and rejection
at token and sequence level, the k-statistics and the chi-squared diagnostics, Liu, Li et
al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
Mismatch" (blog post, the basis of verl's rollout correction); IcePop, Ling Team 2025,
"Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model"
(Ring-1T), arXiv:2510.18855.

Sums and maxima go through `Totals`, which reduces them over the trainer's ranks in one
collective each, so batch normalisation and the metrics are those of the global batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .kl import kl_low_var
from .off_policy_settings import ISWeights, RejectionCriterion

LEVELS = ("token", "sequence", "geometric")
LOG_CLAMP = 1e6  # finite stand-in for +-inf log-ratios; exp() is only applied to bounded values
SAFETY_BOUND = 20.0  # verl's bound on a log-ratio before exp(): weights, k2/k3, chi-squared terms
_PPL_BOUND = 700.0  # a log-perplexity beyond this would overflow float64 in exp()


def finite_log_ratio(log_ratio: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Log-ratios as float, 0 outside `keep`, NaN -> 0 and +-inf -> +-LOG_CLAMP."""
    return torch.where(keep, log_ratio.float().nan_to_num(0.0).clamp(-LOG_CLAMP, LOG_CLAMP), 0.0)


def level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Token log-ratios [B, T] -> log-weights [B, T] at `level` (token: log rho_t; sequence:
    sum_t log rho_t, the product of the ratios; geometric: the mean, their geometric mean);
    the same on every token of a sequence, 0 outside the mask."""
    if level not in LEVELS:
        raise ValueError(f"unknown off-policy level {level!r}; one of: {', '.join(LEVELS)}")
    keep = mask.bool()
    lr = finite_log_ratio(log_ratio, keep)
    if level == "token":
        return lr
    per_seq = lr.sum(-1)
    if level == "geometric":
        per_seq = per_seq / keep.sum(-1).clamp(min=1).to(per_seq.dtype)
    return torch.where(keep, per_seq.unsqueeze(-1).expand_as(lr), 0.0)


class Totals:
    """Named sums and maxima of this rank, reduced over `world_size` ranks (one all_reduce
    each; every rank must call `reduce` with the same names, as the trainer's ranks do)."""

    def __init__(self, device: torch.device, world_size: int = 1):
        self.device, self.world_size = device, world_size
        self.sums: dict[str, torch.Tensor] = {}
        self.maxima: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor | float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + torch.as_tensor(value, dtype=torch.float64, device=self.device)

    def max(self, name: str, values: torch.Tensor) -> None:
        """Max of `values` (an empty tensor gives -inf, which `reduce` reports as 0)."""
        top = values.double().max() if values.numel() else torch.tensor(-math.inf, dtype=torch.float64, device=self.device)
        self.maxima[name] = top.to(self.device)

    def reduce(self) -> dict[str, float]:
        out = {}
        for table, op in ((self.sums, "sum"), (self.maxima, "max")):
            names = sorted(table)
            if not names:
                continue
            t = torch.stack([table[n].reshape(()) for n in names])
            if self.world_size > 1:
                dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
            out.update({n: (v if math.isfinite(v) else 0.0) for n, v in zip(names, t.tolist())})
        return out


def ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


# ----------------------------------------------------------------------------- IS weights


@dataclass
class ISResult:
    weights: torch.Tensor  # [B, T] float, 0 outside the mask
    truncated: torch.Tensor  # [B, T] bool: clamped at low or high (truncate)
    zeroed: torch.Tensor  # [B, T] bool: outside [low, high], weight 0 (icepop)


def importance_weights(log_ratio: torch.Tensor, keep: torch.Tensor, spec: ISWeights) -> ISResult:
    """w = pi_old / mu at `spec.level`, then
    - truncate: clamped into [low, high] (TIS; low None: no lower clamp). verl clamps only
      from above (`rollout_is_threshold`); the lower clamp is the asymmetric extension;
    - icepop: w where low <= w <= high, else 0 (IcePop's mask M(k); verl's "lower_upper"
      `rollout_is_threshold`). The token stays in the mask, so it still counts in the loss
      normaliser, as in the paper's 1/|y_i| and in verl.
    Bounds are compared in log space, so extreme log-ratios give finite weights."""
    log_w = level_log_ratio(log_ratio, keep, spec.level)
    log_low = math.log(spec.low) if spec.low is not None else -math.inf
    log_high = math.log(spec.high) if spec.high is not None else math.inf
    below, above = (log_w < log_low) & keep, (log_w > log_high) & keep
    nothing = torch.zeros_like(keep)
    if spec.kind == "icepop":
        inside = keep & ~below & ~above
        weights = torch.where(inside, log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp(), 0.0)
        return ISResult(weights=weights, truncated=nothing, zeroed=below | above)
    weights = log_w.clamp(max(log_low, -SAFETY_BOUND), min(log_high, SAFETY_BOUND)).exp()
    return ISResult(weights=torch.where(keep, weights, 0.0), truncated=below | above, zeroed=nothing)


def batch_normalize(weights: torch.Tensor, kept: torch.Tensor, level: str, world_size: int = 1) -> tuple[torch.Tensor, float]:
    """Weights divided by their mean over the kept tokens of the global batch (token level),
    or over the sequences with a kept token (sequence and geometric: one weight per
    sequence), so they average 1 (verl's `rollout_is_batch_normalize`). Returns the weights
    and the factor divided by (1.0 when the mean is ~0, which is then left alone)."""
    totals = Totals(weights.device, world_size)
    m = kept.to(weights.dtype)
    if level == "token":
        totals.add("sum", (weights * m).sum())
        totals.add("count", m.sum())
    else:
        n = m.sum(-1)
        has = n > 0
        per_seq = (weights * m).sum(-1) / n.clamp(min=1)
        totals.add("sum", per_seq[has].sum())
        totals.add("count", has.sum())
    t = totals.reduce()
    mean = ratio(t["sum"], t["count"])
    if mean <= 1e-8:
        return weights, 1.0
    return weights / mean, mean


# ----------------------------------------------------------------------------- rejection


def token_statistic(log_ratio: torch.Tensor, keep: torch.Tensor, statistic: str) -> torch.Tensor:
    """Per token: ratio -> log rho (bounds are compared in log space); k2 -> (log rho)^2 / 2;
    k3 -> rho - 1 - log rho (verl's token_k2 / token_k3, with log rho bounded to +-20)."""
    lr = finite_log_ratio(log_ratio, keep)
    if statistic == "ratio":
        return lr
    safe = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if statistic == "k2":
        return 0.5 * safe.square()
    if statistic == "k3":
        return safe.exp() - 1.0 - safe
    raise ValueError(f"unknown rejection statistic {statistic!r}; one of: ratio, k2, k3")


def criterion_passes(log_ratio: torch.Tensor, keep: torch.Tensor, spec: RejectionCriterion) -> torch.Tensor:
    """[B, T] bool: whether each token passes `spec` (at seq_* levels the sequence's verdict
    on every token). Sequence statistics read only the tokens in `keep`, so a hole in a
    multi-turn mask (a tool's output) counts neither in the sum nor in the mean or max."""
    value = token_statistic(log_ratio, keep, spec.statistic)
    if spec.level != "token":
        m = keep.to(value.dtype)
        if spec.level == "seq_sum":
            per_seq = (value * m).sum(-1)
        elif spec.level == "seq_mean":
            per_seq = (value * m).sum(-1) / m.sum(-1).clamp(min=1)
        elif spec.level == "seq_max":
            per_seq = torch.where(keep, value, -math.inf).max(-1).values.clamp(min=0.0) if value.shape[-1] else value.sum(-1)
        else:
            raise ValueError(f"unknown rejection level {spec.level!r}; one of: token, seq_sum, seq_mean, seq_max")
        value = per_seq.unsqueeze(-1).expand_as(value)
    low, high = spec.low, spec.high
    if spec.statistic == "ratio":
        low = math.log(low) if low is not None else None
        high = math.log(high) if high is not None else None
    passes = torch.ones_like(keep)
    if low is not None:
        passes &= value >= low
    if high is not None:
        passes &= value <= high
    return passes


# ----------------------------------------------------------------------------- diagnostics


def add_diagnostics(totals: Totals, old: torch.Tensor | None, rollout: torch.Tensor | None, keep: torch.Tensor) -> None:
    """Sums for `finish_diagnostics`, over the tokens in `keep` (the mask before any rejection,
    as verl's `compute_offpolicy_metrics`). `old` or `rollout` may be None (left out)."""
    m = keep.double()
    n = m.sum(-1)
    has = n > 0
    totals.add("diag_seqs", has.sum())

    def mean_logprob(lp: torch.Tensor) -> torch.Tensor:  # per non-empty sequence
        safe = torch.where(keep, lp.double().nan_to_num(0.0).clamp(-LOG_CLAMP, LOG_CLAMP), 0.0)
        return ((safe * m).sum(-1) / n.clamp(min=1))[has]

    means = {}
    for name, lp in (("training", old), ("rollout", rollout)):
        if lp is None:
            continue
        means[name] = mean_logprob(lp)
        log_ppl = (-means[name]).clamp(-_PPL_BOUND, _PPL_BOUND)
        totals.add(f"{name}_log_ppl", log_ppl.sum())
        totals.add(f"{name}_ppl", log_ppl.exp().sum())
    if old is None or rollout is None:
        return
    lr = finite_log_ratio(old.detach() - rollout.detach(), keep).double()
    safe = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    totals.add("diag_k1", (-lr * m).sum())
    k3 = kl_low_var(torch.where(keep, rollout.detach().double(), 0.0), torch.where(keep, old.detach().double(), 0.0))
    totals.add("diag_k3", (k3.nan_to_num(0.0) * m).sum())
    totals.add("diag_rho", (safe.exp() * m).sum())
    totals.add("diag_rho2", ((2 * safe).exp() * m).sum())
    seq_lr = (lr * m).sum(-1)[has].clamp(-SAFETY_BOUND, SAFETY_BOUND)
    totals.add("diag_rho2_seq", (2 * seq_lr).exp().sum())
    diff = means["rollout"] - means["training"]  # log(training ppl / rollout ppl) per sequence
    totals.add("diag_log_ppl_diff", diff.sum())
    totals.add("diag_ppl_ratio", diff.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().sum())


def finish_diagnostics(t: dict[str, float], tokens: float) -> dict[str, float]:
    """The diagnostics from the reduced sums of `add_diagnostics` (`tokens`: the mask's count)."""
    seqs = t.get("diag_seqs", 0.0)
    out = {}
    for name in ("training", "rollout"):
        if f"{name}_ppl" in t:
            out[f"{name}_ppl"] = ratio(t[f"{name}_ppl"], seqs)
            out[f"{name}_log_ppl"] = ratio(t[f"{name}_log_ppl"], seqs)
    if "diag_k1" not in t:
        return out
    rho, rho2 = t["diag_rho"], t["diag_rho2"]
    out.update(
        ppo_kl=ratio(t["diag_k1"], tokens),
        rollout_trainer_k1=ratio(t["diag_k1"], tokens),
        rollout_trainer_kl=ratio(t["diag_k3"], tokens),
        log_ppl_diff=ratio(t["diag_log_ppl_diff"], seqs),
        ppl_ratio=ratio(t["diag_ppl_ratio"], seqs),
        chi2_token=ratio(rho2, tokens) - 1.0 if tokens > 0 else 0.0,
        chi2_seq=ratio(t["diag_rho2_seq"], seqs) - 1.0 if seqs > 0 else 0.0,
        ess_raw=ratio(rho * rho, tokens * rho2),
    )
    return out
