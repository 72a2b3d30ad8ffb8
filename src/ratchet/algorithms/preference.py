"""Preference losses on (chosen, rejected) pairs: DPO, IPO, SimPO. Pure torch.

Each loss takes the summed log-probabilities of each completion under the policy (and, for
DPO and IPO, under the frozen reference) plus the completions' token counts, and returns
one loss per pair and the implicit rewards TRL reports (`rewards/chosen`,
`rewards/rejected`; accuracy and margin are derived from them). The formulas are TRL's
(`DPOTrainer.dpo_loss`, `CPOTrainer.cpo_loss` for SimPO):

- `sigmoid` (DPO; Rafailov et al. 2023, arXiv:2305.18290): with
  h = (log pi(c) - log pi(r)) - (log ref(c) - log ref(r)),
  loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h);
  eps = `label_smoothing` is conservative DPO (cDPO, Mitchell 2023); eps = 0 is plain DPO.
  Rewards: beta (log pi - log ref) of each completion.
- `ipo` (Azar et al. 2023, arXiv:2310.12036): loss = (h - 1 / (2 beta))^2 with the
  log-probabilities averaged over each completion's tokens, as TRL does for IPO.
- `simpo` (Meng et al. 2024, arXiv:2405.14734): no reference; with the length-averaged
  log-probabilities, h = avg log pi(c) - avg log pi(r) - gamma / beta and
  loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h) (TRL's CPO trainer with
  loss_type=simpo; `simpo_gamma` is the target reward margin gamma). Rewards: beta avg log pi.

verl has no offline DPO trainer of its own (its DPO-style recipes call the same sigmoid
form); docs/algorithms.md ("Preference losses") lists these with their config keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefInputs:
    """Per pair [B]: summed log-probs of the chosen and rejected completions under the
    policy and the reference (None for reference-free losses), and each completion's
    number of loss tokens (for length-normalised losses)."""

    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    ref_chosen_logps: torch.Tensor | None = None
    ref_rejected_logps: torch.Tensor | None = None


@dataclass(frozen=True)
class PrefParams:
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5


@dataclass
class PrefOutput:
    losses: torch.Tensor  # [B]
    chosen_rewards: torch.Tensor  # [B], detached
    rejected_rewards: torch.Tensor  # [B], detached


def _smoothed_sigmoid(logits: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps


def _need_reference(inp: PrefInputs, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if inp.ref_chosen_logps is None or inp.ref_rejected_logps is None:
        raise ValueError(f"preference loss {name!r} needs the reference model's log-probs")
    return inp.ref_chosen_logps, inp.ref_rejected_logps


def _per_token(logps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probs averaged over a completion's tokens (a completion of none counts as one)."""
    return logps / tokens.to(logps.dtype).clamp(min=1)


def dpo_sigmoid(inp: PrefInputs, p: PrefParams) -> PrefOutput:
    ref_c, ref_r = _need_reference(inp, "sigmoid")
    logits = (inp.chosen_logps - inp.rejected_logps) - (ref_c - ref_r)
    return PrefOutput(
        _smoothed_sigmoid(logits, p.beta, p.label_smoothing),
        (p.beta * (inp.chosen_logps - ref_c)).detach(),
        (p.beta * (inp.rejected_logps - ref_r)).detach(),
    )


def ipo(inp: PrefInputs, p: PrefParams) -> PrefOutput:
    ref_c, ref_r = _need_reference(inp, "ipo")
    pc, pr = _per_token(inp.chosen_logps, inp.chosen_tokens), _per_token(inp.rejected_logps, inp.rejected_tokens)
    rc, rr = _per_token(ref_c, inp.chosen_tokens), _per_token(ref_r, inp.rejected_tokens)
    logits = (pc - pr) - (rc - rr)
    return PrefOutput((logits - 1 / (2 * p.beta)) ** 2, (p.beta * (pc - rc)).detach(), (p.beta * (pr - rr)).detach())


def simpo(inp: PrefInputs, p: PrefParams) -> PrefOutput:
    pc, pr = _per_token(inp.chosen_logps, inp.chosen_tokens), _per_token(inp.rejected_logps, inp.rejected_tokens)
    logits = (pc - pr) - p.simpo_gamma / p.beta
    return PrefOutput(_smoothed_sigmoid(logits, p.beta, p.label_smoothing), (p.beta * pc).detach(), (p.beta * pr).detach())


def preference_metrics(out: PrefOutput) -> dict[str, float]:
    """TRL's logged numbers for a batch: mean loss, rewards, accuracy (chosen reward above
    rejected, strictly) and margin."""
    c, r = out.chosen_rewards, out.rejected_rewards
    return {
        "loss": float(out.losses.detach().mean()),
        "rewards_chosen": float(c.mean()),
        "rewards_rejected": float(r.mean()),
        "reward_accuracy": float((c > r).float().mean()),
        "reward_margin": float((c - r).mean()),
    }
