"""One RL update of the policy on a scored rollout batch, in plain torch.

Reading order is the algorithm's order:
1. advantages from the sequence rewards (registered estimator, over the whole batch so
   groups stay intact);
2. this rank's rows; normalisers counted over the *global* batch;
3. old log-probs (the policy before the update) and, when the KL term is on, the
   reference policy's log-probs, both without gradients;
4. `ppo_epochs` passes of micro-batched forward/backward: policy loss + KL - entropy,
   each aggregated by the registered mode; gradient clipping; one optimizer step per pass.

With world size > 1 the model is sharded with FSDP2; FSDP averages gradients over ranks,
so each rank's loss is multiplied by the world size to get the sum the global normaliser
expects. Every rank runs the same number of micro-batches, or the collectives would hang.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ratchet.algorithms import (
    ADV_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    AdvInputs,
    AdvParams,
    LossParams,
    Normaliser,
    kl_penalty,
    sequence_rewards_to_tokens,
)
from ratchet.config.schema import RunConfig

from .batch import RolloutBatch


def response_logits(model: torch.nn.Module, batch: RolloutBatch, temperature: float) -> torch.Tensor:
    """Logits [B, R, V] that predicted each response token, divided by the sampling temperature."""
    mask = batch.attention_mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=position_ids).logits
    prompt_len = batch.prompt_ids.shape[1]
    response_len = batch.response_ids.shape[1]
    return logits[:, prompt_len - 1 : prompt_len - 1 + response_len].float() / temperature


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = logits.log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


@dataclass
class MetricSums:
    """Numerators and denominators summed over ranks, so metrics are global, not rank 0's."""

    values: dict[str, float]
    tokens: float = 0.0

    def reduce(self, world_size: int) -> dict[str, float]:
        names = sorted(self.values)
        t = torch.tensor([self.values[n] for n in names] + [self.tokens], dtype=torch.float64)
        if world_size > 1:
            dist.all_reduce(t)
        total_tokens = max(t[-1].item(), 1.0)
        return {n: t[i].item() / total_tokens for i, n in enumerate(names)}


class PolicyTrainer:
    """Owns the policy, its optimizer and (if KL is on) the frozen reference policy."""

    def __init__(self, model_path: str, cfg: RunConfig, *, rank: int = 0, world_size: int = 1):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        torch.manual_seed(cfg.seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, cfg.model.dtype))
        self.reference = None
        if cfg.algorithm.kl.coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        if world_size > 1:
            self._shard()
        t = cfg.trainer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
        self.version = 0

    def _shard(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (self.world_size,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        if self.reference is not None:
            for layer in self.reference.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.reference, mesh=mesh)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.full_state().values())

    def full_state(self) -> dict[str, torch.Tensor]:
        """Unsharded weights by HF name (a collective when sharded: every rank must call it)."""
        out = {}
        for name, tensor in self.model.state_dict().items():
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            out[name] = tensor.detach()
        return out

    def state_numpy(self) -> dict[str, np.ndarray]:
        # numpy arrays move through Ray's object store 2-3x faster than torch tensors.
        return {k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy() for k, v in self.full_state().items()}

    def _micro_batches(self, shard: RolloutBatch) -> list[RolloutBatch]:
        size = self.cfg.trainer.micro_batch_size
        count = math.ceil(len(shard) / size)
        return [shard.select(slice(i * size, (i + 1) * size)) for i in range(count)]

    def train_step(self, batch: RolloutBatch, rewards: torch.Tensor) -> dict[str, float]:
        alg, temperature = self.cfg.algorithm, self.cfg.rollout.temperature
        estimator = ADV_ESTIMATORS.get(alg.adv_estimator)
        inputs = AdvInputs(sequence_rewards_to_tokens(rewards, batch.response_mask), batch.response_mask, batch.prompt_index)
        advantages = estimator.fn(inputs, AdvParams(norm_adv_by_std=alg.norm_adv_by_std)).advantages
        norm = Normaliser(
            tokens=batch.response_mask.sum().item(),
            sequences=float(len(batch)),
            max_response_length=self.cfg.rollout.max_response_length,
        )
        rows = torch.arange(self.rank, len(batch), self.world_size)
        shard = batch.select(rows)
        shard_adv = advantages[rows]
        micro = self._micro_batches(shard)
        offsets = np.cumsum([0] + [len(m) for m in micro])
        old_logprobs, ref_logprobs = [], []
        with torch.no_grad():
            self.model.eval()
            for m in micro:
                old_logprobs.append(token_logprobs(response_logits(self.model, m, temperature), m.response_ids))
                if self.reference is not None:
                    ref_logprobs.append(token_logprobs(response_logits(self.reference, m, temperature), m.response_ids))
        self.model.train()
        policy_loss_fn = POLICY_LOSSES.get(alg.policy_loss)
        aggregate = LOSS_AGGREGATIONS.get(alg.loss_agg_mode)
        loss_params = LossParams(alg.clip_ratio_low, alg.clip_ratio_high)
        sums = MetricSums(values={"pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip_frac": 0.0, "logprob_diff": 0.0})
        grad_norms = []
        for _ in range(self.cfg.trainer.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for i, m in enumerate(micro):
                mask = m.response_mask
                logits = response_logits(self.model, m, temperature)
                logprob = token_logprobs(logits, m.response_ids)
                adv = shard_adv[offsets[i] : offsets[i + 1]]
                out = policy_loss_fn(logprob, old_logprobs[i], adv, mask, loss_params)
                loss = aggregate(out.loss, mask, norm)
                entropy = token_entropy(logits)
                if alg.entropy_coeff > 0:
                    loss = loss - alg.entropy_coeff * aggregate(entropy, mask, norm)
                kl = torch.zeros_like(logprob)
                if self.reference is not None:
                    kl = kl_penalty(alg.kl.type, logprob, ref_logprobs[i])
                    loss = loss + alg.kl.coef * aggregate(kl, mask, norm)
                (loss * self.world_size).backward()
                with torch.no_grad():
                    sums.values["pg_loss"] += (out.loss * mask).sum().item()
                    sums.values["kl"] += (kl * mask).sum().item()
                    sums.values["entropy"] += (entropy * mask).sum().item()
                    sums.values["clip_frac"] += (out.clipped.float() * mask).sum().item()
                    sums.values["logprob_diff"] += ((logprob - m.rollout_logprobs).abs() * mask).sum().item()
                    sums.tokens += mask.sum().item()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            grad_norms.append(float(grad_norm))
            self.optimizer.step()
        self.version += 1
        metrics = sums.reduce(self.world_size)
        metrics["grad_norm"] = float(np.mean(grad_norms))
        metrics["adv_abs_mean"] = (advantages.abs().sum() / batch.response_mask.sum().clamp(min=1)).item()
        metrics["response_length"] = batch.response_mask.sum(-1).float().mean().item()
        return metrics
