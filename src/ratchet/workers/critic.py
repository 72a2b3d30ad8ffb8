"""The critic for PPO with GAE: a value head on a causal-LM backbone, and its Ray actor.

The value of a response token is read at the position that predicts it (the same
alignment as the policy's logits), so `values[:, t]` estimates the return from response
token t on. The critic stores its values next to the batch (`values`), the trainer turns
them into advantages and returns (`advantages`), and the critic then fits the returns with
the clipped value loss. The value model's backbone starts where the policy starts
(`critic_backbone`: the warm-up model when the run has one). With `critic.warmup_steps`
(verl's `critic_warmup`) the first updates fit the critic only: the policy trainer makes
its update without an optimizer step (policy_update.py), so the workflow is unchanged.
docs/algorithms.md ("PPO with a critic, and REINFORCE++, on the copy task") compares all
this with verl's recipe and gives the measured settings.

The critic's state is part of every checkpoint (`critic/critic.safetensors`: value model
and AdamW state, tensors only; `critic/critic.json`: the update count and the optimizer's
hyper-parameters), so a lost critic is rebuilt like the trainer: the checkpoint, then its
logged updates replayed on their stored values and returns (workers/actors/recovery.py).
"""

from __future__ import annotations

import json
import math
import time

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ratchet.algorithms.aggregation import masked_mean
from ratchet.algorithms.policy_losses import value_clipped, value_loss
from ratchet.config.schema import RunConfig
from ratchet.errors import NonFiniteError
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout
from ratchet.start_up_gc import during_start_up

from .batch import RolloutBatch, load_step
from .columns import Fields, Parts
from .hf_io import local_hf_path
from .runtime import configure_worker_process


class ValueModel(torch.nn.Module):
    def __init__(self, backbone_path: str):
        super().__init__()
        from transformers import AutoModelForCausalLM

        lm = AutoModelForCausalLM.from_pretrained(backbone_path)
        self.backbone = lm.get_decoder()
        self.value_head = torch.nn.Linear(lm.config.hidden_size, 1)
        # Start from V = 0: early advantages are then plain returns, not noise.
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def response_values(self, batch: RolloutBatch) -> torch.Tensor:
        """[B, R] values of the response tokens."""
        mask = batch.attention_mask
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.backbone(input_ids=batch.input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False).last_hidden_state
        p, r = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
        return self.value_head(hidden[:, p - 1 : p - 1 + r]).squeeze(-1).float() * batch.response_mask


def critic_backbone(cfg: RunConfig, run_uri: str) -> str:
    """Where the critic's backbone starts: `critic.model_path`, else where the policy starts
    (the run's warm-up model when it has a warm-up, else `model.path`), as verl starts the
    critic from the actor's model. Not `model.path` alone: after a warm-up that is the model
    before it, whose features know nothing of the answer format the policy was taught."""
    if cfg.critic.model_path:
        return cfg.critic.model_path
    return ObjectStore(run_uri).uri(RunLayout.WARMUP_MODEL) if cfg.warmup.steps > 0 else cfg.model.path


class CriticTrainer:
    def __init__(self, cfg: RunConfig, backbone: str | None = None):
        """`backbone`: the causal LM the value model is built on (default
        `critic.model_path`, else `model.path`; the Ray worker passes `critic_backbone`)."""
        self.cfg = cfg.critic
        torch.manual_seed(cfg.seed)
        self.model = ValueModel(local_hf_path(backbone or cfg.critic.model_path or cfg.model.path))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.critic.lr, weight_decay=0.0)
        self.micro_batch_size = cfg.trainer.micro_batch_size
        self.grad_clip = cfg.trainer.grad_clip

    @torch.no_grad()
    def values(self, batch: RolloutBatch) -> torch.Tensor:
        self.model.eval()
        size = self.micro_batch_size
        return torch.cat([self.model.response_values(batch.select(slice(i, i + size))) for i in range(0, len(batch), size)])

    def update(self, batch: RolloutBatch, old_values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
        self.model.train()
        tokens = batch.response_mask.sum().clamp(min=1.0)
        size = self.micro_batch_size
        loss_sum = clipped_sum = 0.0
        for _ in range(self.cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for i in range(0, len(batch), size):
                rows = slice(i, i + size)
                m = batch.select(rows)
                mask = m.response_mask
                values = self.model.response_values(m)
                args = (values, old_values[rows], returns[rows], mask, self.cfg.cliprange_value)
                loss = value_loss(*args)
                # Token-mean over the whole batch: micro-batching does not change the gradient.
                (loss.sum() / tokens).backward()
                loss_sum += loss.sum().item()
                clipped_sum += value_clipped(*args).float().sum().item()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            if not math.isfinite(float(grad_norm)):  # before the step: the critic's weights stay finite
                raise NonFiniteError(
                    f"critic update: gradient norm {float(grad_norm)} (value loss {loss_sum}); the step was skipped. "
                    "Check the rewards, or lower critic.lr"
                )
            self.optimizer.step()
        denom = tokens.item() * self.cfg.ppo_epochs
        return {
            "vf_loss": loss_sum / denom,
            "vf_clip_frac": clipped_sum / denom,
            "vf_grad_norm": float(grad_norm),
            "values_mean": masked_mean(old_values, batch.response_mask).item(),
            "returns_mean": masked_mean(returns, batch.response_mask).item(),
        }

    def state_files(self, version: int) -> dict[str, bytes]:
        """The value model and AdamW state as checkpoint files (no pickle)."""
        tensors = {f"model/{k}": v.detach().clone().contiguous() for k, v in self.model.state_dict().items()}
        opt = self.optimizer.state_dict()
        for idx, entry in opt["state"].items():
            for key, t in entry.items():
                tensors[f"optim/{idx}/{key}"] = t.detach().clone().contiguous()
        meta = {"format": CRITIC_FORMAT, "version": version, "param_groups": opt["param_groups"]}
        return {RunLayout.CRITIC_STATE: st_save(tensors), RunLayout.CRITIC_META: json.dumps(meta, sort_keys=True).encode()}

    def load_state_files(self, files: dict[str, bytes]) -> int:
        """Restore what `state_files` wrote; returns the update count it holds."""
        meta = json.loads(files[RunLayout.CRITIC_META])
        if meta.get("format") != CRITIC_FORMAT:
            raise ValueError(f"{RunLayout.CRITIC_META}: not a {CRITIC_FORMAT} file (format {meta.get('format')!r})")
        tensors = st_load(files[RunLayout.CRITIC_STATE])
        self.model.load_state_dict({k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")})
        state: dict[int, dict[str, torch.Tensor]] = {}
        for k, v in tensors.items():
            if k.startswith("optim/"):
                _, idx, key = k.split("/", 2)
                state.setdefault(int(idx), {})[key] = v
        self.optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        for group in self.optimizer.param_groups:  # the run's config owns it (a resume may change it)
            group["lr"] = self.cfg.lr
        return int(meta["version"])


CRITIC_FORMAT = "ratchet-critic-state/1"


class CriticWorker:
    """Ray actor around `CriticTrainer`, reading and writing the batch store."""

    @during_start_up
    def __init__(self, cfg: RunConfig, run_uri: str):
        configure_worker_process(cfg.resources.torch_threads, cfg.seed if cfg.deterministic else None)
        self.trainer = CriticTrainer(cfg, critic_backbone(cfg, run_uri))
        self.run = ObjectStore(run_uri)
        # A retried train activity must not fit the critic twice on one batch: (batch index, metrics).
        self._updated: tuple[int, dict[str, float]] | None = None
        self.version = 0  # updates done: equal to the policy version it goes with

    def policy_version(self) -> int:
        return self.version

    def state_files(self) -> dict[str, bytes]:
        return self.trainer.state_files(self.version)

    def load_state_files(self, files: dict[str, bytes]) -> int:
        self.version = self.trainer.load_state_files(files)
        self._updated = None
        return self.version

    def compute_values(self, batch_index: int, parts: int) -> str:
        store = BatchStore(self.run)
        if self._updated is not None and self._updated[0] >= batch_index:
            return self.run.uri(store.key(batch_index, Parts.VALUES))  # kept: these values trained the policy
        batch = load_step(store, batch_index, parts).batch
        return store.write(batch_index, Parts.VALUES, {Fields.VALUES: self.trainer.values(batch)}, {})

    def update(self, batch_index: int, parts: int) -> dict[str, float]:
        if self._updated is not None and self._updated[0] == batch_index:
            return self._updated[1]
        t0 = time.perf_counter()
        store = BatchStore(self.run)
        batch = load_step(store, batch_index, parts).batch
        old_values = store.read(batch_index, Parts.VALUES)[0][Fields.VALUES]
        returns = store.read(batch_index, Parts.ADVANTAGES)[0][Fields.RETURNS]
        metrics = self.trainer.update(batch, old_values, returns)
        metrics["critic_seconds"] = time.perf_counter() - t0
        self._updated = (batch_index, metrics)
        self.version += 1
        return metrics
