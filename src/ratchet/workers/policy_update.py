"""One RL update of the policy on a scored step, in plain torch.

Reading order is the algorithm's order:
1. sequence rewards, with DAPO's soft overlong penalty; with dynamic sampling, the groups
   whose rewards all agree are dropped (their tokens leave the mask and the normaliser);
2. this rank's rows; normalisers counted over the *global* batch;
3. without gradients: the policy's log-probs before the update ("old"/proximal) and, when
   the KL term is on, the reference policy's (and the per-token sum of pi^2 for the optimal
   token baseline); gathered over ranks where the whole batch needs them (KL in the reward, OTB).
   When nothing reads the old log-probs before the update (one pass, no KL in the reward, no
   OTB, an off-policy mode that weights and masks nothing), they are the update's own forward
   pass, detached: the weights do not move before its one optimizer step, so that pass sees
   the old policy. One forward pass of three saved, as TRL does with one iteration;
4. advantages over the whole batch, so groups and whitening see every sample (a rollout
   filter's dropped samples in groups of their own; Safe-RLHF: the reward's and the
   cost's, mixed by the Lagrange multiplier, workers/safety.py);
5. the off-policy correction: per-token weights and a mask from old vs rollout log-probs
   (with the old log-probs from the update itself, only its diagnostics, after the update);
6. `ppo_epochs` passes of micro-batched forward/backward: policy loss (times the
   correction weights) + KL - entropy, each aggregated by the registered mode; gradient
   clipping; one optimizer step per pass;
7. the KL controller's new coefficient (and Safe-RLHF's multiplier), returned so the
   workflow can carry them durably.

With world size > 1, on CUDA, or with bf16 mixed precision, the model is sharded with
FSDP2 (units from the model's `_no_split_modules`, workers/sharding.py); FSDP averages
gradients over ranks, so each rank's loss is multiplied by the world size to get the sum
the global normaliser expects. Every rank runs the same number of micro-batches, or the
collectives would hang.

Devices: the batch arrives on CPU; this rank's rows go to the trainer's device (CUDA or
CPU, `trainer.device`), whole-batch arithmetic (rewards, advantages) stays on CPU, and
the small collectives (counts, metric sums, flags) run on the device, as NCCL requires.
The config is read by attribute only, so this module imports no pydantic (the GPU check,
benchmarks/gpu_check.py, runs it where pydantic is not installed).

Why one module of ~480 lines: one job, a PPO-family update on one rank, read top to bottom
in `train_step` (rewards, this rank's rows, old and reference log-probs, advantages,
the off-policy correction, the update, the KL controller); the maths it calls lives in
`ratchet.algorithms`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from ratchet.algorithms import ADV_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from ratchet.algorithms.kl import AdaptiveKLController, apply_kl_in_reward, kl_penalty
from ratchet.algorithms.advantages import AdvInputs, AdvParams, response_span_lengths, sequence_rewards_to_tokens
from ratchet.algorithms.policy_losses import LossParams, entropy_from_logits
from ratchet.algorithms.aggregation import Normaliser
from ratchet.algorithms.dapo import dynamic_sampling_keep, overlong_penalty
from ratchet.algorithms.off_policy import off_policy_correction
from ratchet.algorithms.advantages_outcome import sum_pi_squared
from ratchet.algorithms.off_policy_settings import as_is_weights, as_rejection
from ratchet.errors import NonFiniteError

from .batch import TENSOR_FIELDS, RolloutBatch, ScoredStep
from .lora import adapter_disabled, load_policy, lora_settings, merged_state, trainable_parameters
from .rollout_filter import filtered_groups
from .runtime import join_process_group, resolve_device
from .safety import safe_rlhf_estimator
from .sharding import ShardingPlan, enable_activation_checkpointing, resolve_mixed_precision, shard_model

if TYPE_CHECKING:
    from ratchet.config.schema import RunConfig


_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def check_finite_weights(state: dict, what: str) -> None:
    """NonFiniteError naming the first tensors with NaN/inf values: such weights must never
    be checkpointed (a sha256 would vouch for them) or synced. One pass over the weights
    (about 1 ms for the 1M-parameter tiny model on one CPU core), paid only at checkpoints and syncs."""
    bad, on_device = [], {}
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            on_device[name] = torch.isfinite(t).all()  # queued: one wait for all of them below
            continue
        if isinstance(t, torch.Tensor) and t.dtype in _NUMPY_FLOATS:
            t = t.detach().numpy()  # a view; numpy's isfinite is ~10x faster on CPU than torch's
        finite = np.isfinite(t).all() if isinstance(t, np.ndarray) else bool(torch.isfinite(t).all())
        if not finite:
            bad.append(name)
    if on_device:
        flags = torch.stack(list(on_device.values())).tolist()
        bad += [name for name, finite in zip(on_device, flags) if not finite]
    if bad:
        raise NonFiniteError(
            f"{what} hold NaN/inf values ({len(bad)} tensors, first {', '.join(bad[:3])}); they were not saved or synced. "
            "Resume the run from its last good checkpoint with a lower trainer.lr or trainer.grad_clip"
        )


def _rows_not_finite(values: torch.Tensor) -> list[int]:
    rows = ~torch.isfinite(values)
    if rows.dim() > 1:
        rows = rows.flatten(1).any(-1)
    return torch.nonzero(rows).flatten().tolist()


def to_device(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    """The batch's tensors on `device` (the same object on CPU); samples stay as they are."""
    if device.type == "cpu":
        return batch
    moved = {name: getattr(batch, name).to(device, non_blocking=True) for name in TENSOR_FIELDS}
    return RolloutBatch(**moved, samples=batch.samples)


def response_logits(model: torch.nn.Module, batch: RolloutBatch, temperature: float) -> torch.Tensor:
    """Logits [B, R, V] that predicted each response token, divided by the sampling temperature."""
    mask = batch.attention_mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
    prompt_len = batch.prompt_ids.shape[1]
    response_len = batch.response_ids.shape[1]
    return logits[:, prompt_len - 1 : prompt_len - 1 + response_len].float() / temperature


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def keep_informative_groups(rewards: torch.Tensor, group: torch.Tensor, max_groups: int) -> torch.Tensor:
    """DAPO dynamic sampling: rows of the first `max_groups` groups whose rewards differ."""
    keep = dynamic_sampling_keep(rewards, group)
    kept_groups: list[int] = []
    for g in group[keep].tolist():
        if g not in kept_groups and len(kept_groups) < max_groups:
            kept_groups.append(g)
    return torch.isin(group, torch.tensor(kept_groups, dtype=group.dtype)) & keep


def token_staleness_histogram(lag: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Fraction of trained tokens sampled k policy versions behind the one being updated
    (`staleness_tokens/k`); a partial rollout spreads one sample over several k."""
    lags = lag[mask > 0]
    if lags.numel() == 0:
        return {}
    counts = torch.bincount(lags.clamp(min=0))
    out = {f"staleness_tokens/{k}": c.item() / lags.numel() for k, c in enumerate(counts) if c > 0}
    out["staleness_tokens/max"] = float(lags.max().item())
    return out


@dataclass
class MetricSums:
    """Numerators summed over ranks and divided by the global token count, so metrics are
    global, not rank 0's."""

    values: dict[str, float]
    tokens: float = 0.0

    def add(self, name: str, per_token: torch.Tensor, mask: torch.Tensor) -> None:
        self.values[name] = self.values.get(name, 0.0) + (per_token.detach() * mask).sum().item()

    def reduce(self, world_size: int, device: torch.device | None = None) -> dict[str, float]:
        names = sorted(self.values)
        t = torch.tensor([self.values[n] for n in names] + [self.tokens], dtype=torch.float64, device=device)
        if world_size > 1:
            dist.all_reduce(t)
        total_tokens = max(t[-1].item(), 1.0)
        return {n: t[i].item() / total_tokens for i, n in enumerate(names)}


@dataclass
class StepResult:
    metrics: dict[str, float]
    kl_coef: float
    advantages: torch.Tensor  # [B, R], for the record and the critic
    returns: torch.Tensor  # [B, R], the critic's targets
    safe_lambda: float | None = None  # Safe-RLHF: the multiplier for the next update (workers/safety.py)


class PolicyTrainer:
    """Owns the policy, its optimizer and (if KL is on) the frozen reference policy."""

    def __init__(self, model_path: str, cfg: RunConfig, *, rank: int = 0, world_size: int = 1, shard: bool | None = None):
        """`shard`: wrap with FSDP2 (None: when world size > 1, on CUDA, or with bf16 mixed
        precision, which FSDP2 provides). Ranks > 1 must have joined their process group;
        one rank that shards joins a group of its own here."""
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        t = cfg.trainer
        self.device = resolve_device(t.device, rank)
        self.plan = ShardingPlan(
            mixed_precision=resolve_mixed_precision(t.mixed_precision, self.device),
            activation_checkpointing=t.activation_checkpointing,
        )
        self.lora = lora_settings(cfg)  # None: the whole policy trains
        # QLoRA's 4-bit base is not sharded with FSDP2: one rank, unwrapped (the config refuses more ranks).
        qlora = self.lora is not None and self.lora.quantize is not None
        self.sharded = (
            shard if shard is not None else (not qlora and (world_size > 1 or self.device.type == "cuda" or self.plan.mixed_precision))
        )
        if world_size > 1 and not self.sharded:
            raise ValueError("a trainer of more than one rank must be sharded")
        torch.manual_seed(cfg.seed)
        # With trainer.lora the policy is the base wrapped in adapters (workers/lora.py), and
        # the reference is that base with the adapters off: no second copy.
        self.model = load_policy(model_path, cfg, self.device)
        self.reference = None
        if cfg.algorithm.kl.coef > 0 and self.lora is None:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.units: list[str] = []
        if self.sharded:
            self._shard()
        else:
            if self.plan.activation_checkpointing:
                enable_activation_checkpointing(self.model)
            self.model.to(self.device)
            if self.reference is not None:
                self.reference.to(self.device)
        self.optimizer = torch.optim.AdamW(trainable_parameters(self.model), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
        self.version = 0

    def _shard(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            if self.world_size > 1:
                raise RuntimeError(f"trainer rank {self.rank} of {self.world_size}: join the process group before building the trainer")
            join_process_group(self.device, 0, 1)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        self.units = shard_model(self.model, mesh, self.plan)
        if self.reference is not None:
            shard_model(self.reference, mesh, self.plan, trainable=False)

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device) if t.device != self.device else t

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.full_state().values())

    def full_state(self) -> dict[str, torch.Tensor]:
        """Unsharded weights by HF name (a collective when sharded: every rank must call it);
        with LoRA the base and adapters merged, as the engines load them."""
        if self.lora is not None:
            return merged_state(self.model)
        out = {}
        for name, tensor in self.model.state_dict().items():
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            out[name] = tensor.detach()
        return out

    def state_numpy(self) -> dict[str, np.ndarray]:
        # numpy arrays move through Ray's object store 2-3x faster than torch tensors.
        out = {}
        for k, v in self.full_state().items():
            v = v.cpu()
            out[k] = v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
        return out

    def _micro_batches(self, shard: RolloutBatch) -> list[slice]:
        size = self.cfg.trainer.micro_batch_size
        return [slice(i * size, (i + 1) * size) for i in range(math.ceil(len(shard) / size))]

    def _gather_rows(self, local: torch.Tensor, total_rows: int) -> torch.Tensor:
        """Rank r holds global rows r, r + W, r + 2W, ...; rebuild the [B, ...] tensor on every rank."""
        if self.world_size == 1:
            return local
        out = torch.empty((self.world_size, *local.shape), dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(out, local.contiguous())
        return out.transpose(0, 1).reshape(total_rows, *local.shape[1:])

    def _global_normaliser(self, loss_mask: torch.Tensor) -> Normaliser:
        """Tokens and sequences that carry loss, over every rank: corrections that mask
        tokens out (decoupled, rejection) and dropped groups leave the denominator too."""
        counts = torch.tensor([loss_mask.sum().item(), (loss_mask.sum(-1) > 0).sum().item()], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(counts)
        return Normaliser(tokens=counts[0].item(), sequences=counts[1].item(), max_response_length=self.cfg.rollout.max_response_length)

    @torch.no_grad()
    def _logprobs(self, model, shard: RolloutBatch, micro: list[slice]) -> torch.Tensor:
        t = self.cfg.rollout.temperature
        return torch.cat([token_logprobs(response_logits(model, shard.select(s), t), shard.response_ids[s]) for s in micro])

    @torch.no_grad()
    def _logprobs_and_sum_pi_squared(self, shard: RolloutBatch, micro: list[slice]) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's log-probs and per-token sum of pi^2 over the vocabulary (the optimal
        token baseline's inputs), from one forward pass."""
        t, logprobs, pi2 = self.cfg.rollout.temperature, [], []
        for s in micro:
            logits = response_logits(self.model, shard.select(s), t)
            logprobs.append(token_logprobs(logits, shard.response_ids[s]))
            pi2.append(sum_pi_squared(logits))
        return torch.cat(logprobs), torch.cat(pi2)

    def uses_reference(self) -> bool:
        return self.cfg.algorithm.kl.coef > 0

    def _reference_logprobs(self, shard: RolloutBatch, micro: list[slice]) -> torch.Tensor | None:
        """The reference policy's log-probs (None when the KL term is off): the frozen copy,
        or with LoRA the policy itself with its adapters off."""
        if self.reference is not None:
            return self._logprobs(self.reference, shard, micro)
        if self.lora is None or not self.uses_reference():
            return None
        with adapter_disabled(self.model) as base:
            return self._logprobs(base, shard, micro)

    def _check_finite_update(self, grad_norm: float, bad_loss: float | None, epoch: int) -> None:
        flag = torch.tensor([0.0 if bad_loss is None else 1.0], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(flag)
        if flag.item() == 0 and math.isfinite(grad_norm):
            return
        if bad_loss is not None:
            loss_text = f"loss {bad_loss}"
        else:
            loss_text = "a non-finite loss on another rank" if flag.item() else "the loss finite"
        raise NonFiniteError(
            f"non-finite update in PPO epoch {epoch}: {loss_text}, gradient norm {grad_norm}; the optimizer step was "
            "skipped, so the weights stay finite. Lower trainer.lr, check the rewards and rollout log-probs, or "
            "set trainer.grad_clip"
        )

    def old_logprobs_from_the_update(self, needs_sum_pi_squared: bool, actor_frozen: bool) -> bool:
        """Whether the old log-probs can be the update's own forward pass (module docstring,
        step 3): one pass (so one optimizer step, after every micro-batch's forward), and no
        reader before it: KL in the reward and the optimal token baseline use them for the
        advantages, and an off-policy correction other than `none` (or with IS weights or
        rejection criteria) for the weights and mask the loss needs. A frozen actor (the
        critic's warm-up) makes no pass to take them from."""
        alg, off = self.cfg.algorithm, self.cfg.algorithm.off_policy
        reweights = off.mode != "none" or as_is_weights(off.is_weights) is not None or bool(as_rejection(off.rejection))
        return self.cfg.trainer.ppo_epochs == 1 and not (alg.kl.in_reward or needs_sum_pi_squared or reweights or actor_frozen)

    def _off_policy(self, old: torch.Tensor | None, shard: RolloutBatch, shard_mask: torch.Tensor):
        off = self.cfg.algorithm.off_policy
        return off_policy_correction(
            off.mode,
            old_logprob=old,
            rollout_logprob=shard.rollout_logprobs,
            mask=shard_mask,
            cap=off.cap,
            level=off.level,
            is_weights=off.is_weights,
            rejection=off.rejection,
            world_size=self.world_size,
        )

    def train_step(
        self, data: ScoredStep, *, kl_coef: float, values: torch.Tensor | None = None, safe_lambda: float | None = None
    ) -> StepResult:
        alg, batch = self.cfg.algorithm, data.batch
        # 1. rewards, overlong penalty, dynamic sampling
        rewards = data.rewards.float()
        bad = _rows_not_finite(rewards)
        if bad:
            raise NonFiniteError(
                f"rewards of rows {bad[:5]} are not finite ({[float(rewards[r]) for r in bad[:5]]}); nothing was updated. "
                "Fix the reward function or reward model so it returns finite numbers"
            )
        lengths = response_span_lengths(batch.response_mask)  # up to the last response token, holes included
        if alg.overlong.buffer_len > 0:
            rewards = rewards + overlong_penalty(
                lengths, self.cfg.rollout.max_response_length, alg.overlong.buffer_len, alg.overlong.penalty_factor
            )
        # A rollout filter's dropped samples leave the mask and, in groups of their own, the group statistics.
        kept = torch.ones(len(batch), dtype=torch.bool) if data.keep is None else data.keep.bool()
        group = filtered_groups(batch.prompt_index, data.keep)
        if alg.dynamic_sampling:
            kept = keep_informative_groups(rewards, group, self.cfg.loop.prompts_per_step) & kept
        mask = batch.response_mask * kept.unsqueeze(-1)
        # 2. this rank's rows
        rows = torch.arange(self.rank, len(batch), self.world_size)
        shard, shard_mask = to_device(batch.select(rows), self.device), self._on_device(mask[rows])
        micro = self._micro_batches(shard)
        # 3. old (proximal) and reference log-probs
        self.model.eval()
        estimator, pi2 = ADV_ESTIMATORS.get(alg.adv_estimator), None
        # verl's critic_warmup: the first critic.warmup_steps updates fit the critic only.
        actor_frozen = values is not None and self.version < self.cfg.critic.warmup_steps
        # The old log-probs: the update's own when nothing reads them before it
        # (old_logprobs_from_the_update); bypass uses the behaviour log-probs instead, unless
        # KL in the reward needs the policy's anyway; else a forward pass now.
        from_update = self.old_logprobs_from_the_update(estimator.needs_sum_pi_squared, actor_frozen)
        recompute_old = not from_update and (alg.off_policy.mode != "bypass" or alg.kl.in_reward)
        if estimator.needs_sum_pi_squared:  # the optimal token baseline: both from one forward pass
            old, pi2 = self._logprobs_and_sum_pi_squared(shard, micro)
        else:
            old = self._logprobs(self.model, shard, micro) if recompute_old else None
        ref = self._reference_logprobs(shard, micro)
        # 4. advantages over the whole batch
        token_rewards = sequence_rewards_to_tokens(rewards, mask)
        kl_in_reward = 0.0
        if alg.kl.in_reward and ref is not None:
            full_old, full_ref = self._gather_rows(old, len(batch)).cpu(), self._gather_rows(ref, len(batch)).cpu()
            token_rewards, mean_kl = apply_kl_in_reward(token_rewards, full_old, full_ref, mask, kl_coef, alg.kl.type)
            kl_in_reward = float(mean_kl)
        if values is not None:
            bad = _rows_not_finite(torch.where(mask > 0, values, 0.0))
            if bad:
                raise NonFiniteError(f"critic values of rows {bad[:5]} are not finite; nothing was updated. Lower critic.lr")
        otb = {}
        if pi2 is not None:
            otb = {"old_logprob": self._gather_rows(old, len(batch)).cpu(), "sum_pi_squared": self._gather_rows(pi2, len(batch)).cpu()}
        safe = safe_rlhf_estimator(self.cfg, estimator.fn, data.costs, safe_lambda)  # None without a safety section
        adv_out = (safe or estimator.fn)(
            AdvInputs(token_rewards, mask, group, values=values, baseline_rewards=data.baseline_rewards, **otb),
            AdvParams(norm_adv_by_std=alg.norm_adv_by_std, gamma=alg.gamma, lam=alg.lam),
        )
        bad = _rows_not_finite(torch.where(mask > 0, adv_out.advantages, 0.0))
        if bad:
            raise NonFiniteError(
                f"advantages ({alg.adv_estimator}) of rows {bad[:5]} are not finite; nothing was updated. "
                "Check the critic's values and the rewards of those rows"
            )
        shard_adv = self._on_device(adv_out.advantages[rows])
        # 5. off-policy correction (with the old log-probs from the update: weights 1 and
        # nothing masked, so it waits for them and gives its diagnostics after the update)
        correction = None if from_update else self._off_policy(old, shard, shard_mask)
        if correction is not None and correction.use_rollout_as_old:
            old = shard.rollout_logprobs
        loss_mask = shard_mask if correction is None else shard_mask * correction.mask
        norm = self._global_normaliser(loss_mask)
        # 6. the update
        loss_fn = POLICY_LOSSES.get(alg.policy_loss)
        aggregate = LOSS_AGGREGATIONS.get(alg.loss_agg_mode)
        params = LossParams.from_algorithm(alg)
        sums = MetricSums(values={})
        grad_norms, own_logprobs = [], []
        self.model.train()
        for epoch in range(0 if actor_frozen else self.cfg.trainer.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            bad_loss = None  # this rank's first non-finite micro-batch loss
            for s in micro:
                m, mm = shard.select(s), loss_mask[s]
                logits = response_logits(self.model, m, self.cfg.rollout.temperature)
                logprob = token_logprobs(logits, m.response_ids)
                old_s = logprob.detach() if from_update else old[s]
                if from_update:
                    own_logprobs.append(old_s)
                out = loss_fn(logprob, old_s, shard_adv[s], mm, params)
                loss = aggregate(out.loss if correction is None else out.loss * correction.weights[s], mm, norm)
                entropy = entropy_from_logits(logits)
                if alg.entropy_coeff > 0:
                    loss = loss - alg.entropy_coeff * aggregate(entropy, mm, norm)
                if ref is not None:
                    kl = kl_penalty(alg.kl.type, logprob, ref[s])
                    if not alg.kl.in_reward:
                        loss = loss + kl_coef * aggregate(kl, mm, norm)
                    sums.add("kl", kl, mm)
                if bad_loss is None and not math.isfinite(loss.item()):
                    bad_loss = loss.item()
                (loss * self.world_size).backward()
                sums.add("pg_loss", out.loss, mm)
                sums.add("entropy", entropy, mm)
                sums.add("clip_frac", out.clipped.float(), mm)
                sums.add("logprob_diff", (logprob - m.rollout_logprobs).abs(), mm)
                sums.tokens += mm.sum().item()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            grad_norms.append(float(grad_norm))
            # Before optimizer.step(): the weights stay finite. The grad norm is global, and
            # the loss flag is summed over ranks, so every rank raises alike (no hung collective).
            self._check_finite_update(float(grad_norm), bad_loss, epoch)
            self.optimizer.step()
        if correction is None:  # its diagnostics, from the log-probs the update's pass saw
            correction = self._off_policy(torch.cat(own_logprobs), shard, shard_mask)
        staleness = token_staleness_histogram(self.version - batch.policy_version, mask)
        self.version += 1
        metrics = sums.reduce(self.world_size, self.device)
        # 7. the KL controller
        new_coef = kl_coef
        if alg.kl.target is not None and ref is not None:
            controller = AdaptiveKLController(init_coef=kl_coef, target=alg.kl.target, horizon=alg.kl.horizon)
            new_coef = controller.update(kl_in_reward if alg.kl.in_reward else metrics.get("kl", 0.0), n_steps=len(batch))
        metrics.update(
            grad_norm=float(np.mean(grad_norms)) if grad_norms else 0.0,
            adv_abs_mean=(adv_out.advantages.abs().sum() / mask.sum().clamp(min=1)).item(),
            response_length=lengths.float().mean().item(),
            kl_coef=kl_coef,
            kept_fraction=kept.float().mean().item(),
            **({"rollout_filter/dropped": float((~data.keep.bool()).sum().item())} if data.keep is not None else {}),
            **(safe.metrics if safe is not None else {}),
            **staleness,
            **{f"off_policy/{k}": v for k, v in correction.metrics.items()},
        )
        if alg.kl.in_reward:
            metrics["kl_in_reward"] = kl_in_reward
        safe_lambda = safe.lam if safe is not None else safe_lambda
        return StepResult(
            metrics=metrics, kl_coef=new_coef, advantages=adv_out.advantages, returns=adv_out.returns, safe_lambda=safe_lambda
        )
