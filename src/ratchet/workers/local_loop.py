"""The same RL step as the workflow, in one process: no Temporal, no Ray, no storage.

It calls the very pieces the Ray workers call (engine, reward scoring, `PolicyTrainer`,
`CriticTrainer`), so benchmarks can measure the bare algorithm and compare estimators
quickly. It is not durable and does no dynamic-sampling refills; use the workflow for
real runs.

It imports no pydantic, omegaconf or pyarrow itself: the config is read by attribute, so
the GPU check (benchmarks/gpu_check.py) can drive it on a machine with torch and
transformers only.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from ratchet.algorithms import ADV_ESTIMATORS
from ratchet.algorithms.advantages import remax_baselines
from ratchet.data.order import data_order_seed
from ratchet.tasks.loading import load_reward_fn

from .batch import ScoredStep
from ratchet.workers.engines.base import Engine, SamplingParams
from ratchet.workers.engines.build import build_engine
from .policy_update import PolicyTrainer
from .prompts import PromptSet
from .rollout_filter import RolloutFilter
from .multi_turn import MultiTurnRollout
from .batch_seeds import prompt_indices, sampling_seed
from .rollout_batching import generate_batch
from .runtime import configure_worker_process
from .safety import CostScorer, safety_on
from .scoring import score_batch
from .lora import sync_view
from .weight_sync import local_source

if TYPE_CHECKING:
    from ratchet.config.schema import RunConfig


class LocalLoop:
    def __init__(self, cfg: RunConfig, policy_path: str | None = None, *, engine: Engine | None = None):
        """`engine`: one already serving `policy_path`'s weights (tests share one across
        loops; the GPU check hands in one on CUDA); by default the config's
        (`rollout.engine` with its options section, engines/build.py)."""
        configure_worker_process(cfg.resources.torch_threads)
        path = policy_path or cfg.model.path
        self.cfg = cfg
        self.engine = engine if engine is not None else build_engine(cfg, path)
        self.trainer = PolicyTrainer(path, cfg)
        self.critic = None
        if cfg.uses_critic:
            from .critic import CriticTrainer

            self.critic = CriticTrainer(cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": path})}))
        d = cfg.data
        self.prompts = PromptSet.from_config(d, d.train_files, self.engine.tokenizer)
        self.eval_prompts = PromptSet.from_config(d, d.eval_files, self.engine.tokenizer) if d.eval_files else None
        self.order_seed = data_order_seed(cfg)  # the workflow's prompt order (data.shuffle, data.seed)
        self.multi_turn = MultiTurnRollout.from_config(cfg, self.engine.tokenizer)  # None unless rollout.multi_turn.enabled
        if cfg.reward.function is None:
            raise ValueError("the local loop scores with reward.function only; set it")
        self.reward_fn = load_reward_fn(cfg.reward.function)
        self.needs_baseline = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator).needs_baseline
        self.kl_coef = cfg.algorithm.kl.coef
        # Safe-RLHF's cost and multiplier, and the rollout filter, as the reward worker and the workflow hold them.
        safety = cfg.safety
        self.costs = CostScorer(safety) if safety_on(safety) else None
        self.safe_lambda = safety.lambda_init if self.costs is not None else None
        self.filter = RolloutFilter(cfg.rollout.filter) if cfg.rollout.filter else None

    def _sampling(self, step: int) -> SamplingParams:
        """Step `step` samples as the workflow's batch `step` does (one round: part 0)."""
        r = self.cfg.rollout
        seed = sampling_seed(self.cfg.seed, step)
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_response_length, seed=seed)

    def step(self, step: int) -> dict[str, float]:
        """One step: generate, score, (values), train, (critic), sync. Returns metrics with phase seconds."""
        t = [time.perf_counter()]
        per = self.cfg.loop.prompts_per_step
        indices = prompt_indices(step * per, per, len(self.prompts), self.order_seed)
        params = self._sampling(step)
        batch = generate_batch(self.engine, self.prompts, indices, params, policy_version=self.trainer.version, multi_turn=self.multi_turn)
        baseline = None
        if self.needs_baseline:
            greedy = generate_batch(
                self.engine, self.prompts, indices, replace(params, n=1, greedy=True), policy_version=0,
                multi_turn=self.multi_turn,
            )  # fmt: skip
            base_scores, _ = score_batch(greedy, self.engine.tokenizer, self.reward_fn)
            baseline = remax_baselines(batch.prompt_index, greedy.prompt_index, base_scores)
        t.append(time.perf_counter())
        rewards, _ = score_batch(batch, self.engine.tokenizer, self.reward_fn)
        keep = costs = None
        if self.filter is not None:
            keep, rewards = self.filter.apply(batch, self.engine.tokenizer, rewards, step)
        if self.costs is not None:
            costs = self.costs.score(batch, self.engine.tokenizer, step)
        t.append(time.perf_counter())
        values = self.critic.values(batch) if self.critic else None
        data = ScoredStep(batch, rewards, baseline, costs=costs, keep=keep)
        result = self.trainer.train_step(data, kl_coef=self.kl_coef, values=values, safe_lambda=self.safe_lambda)
        self.kl_coef, self.safe_lambda = result.kl_coef, result.safe_lambda
        metrics = dict(result.metrics)
        if self.critic:
            metrics.update(self.critic.update(batch, values, result.returns))
        t.append(time.perf_counter())
        # Bucket by bucket, gathered as the engine loads them (weight_sync): no model copy.
        source = local_source(
            sync_view(self.trainer.model),
            engine_dtype=self.cfg.model.dtype,
            bucket_mb=self.cfg.trainer.sync_bucket_mb,
            version=self.trainer.version,
        )
        self.engine.load_weights(source.pairs())
        t.append(time.perf_counter())
        metrics.update(
            reward_mean=rewards.mean().item(),
            generate_seconds=t[1] - t[0],
            score_seconds=t[2] - t[1],
            train_seconds=t[3] - t[2],
            sync_seconds=t[4] - t[3],
        )
        return metrics

    def evaluate(self, size: int | None = None) -> float:
        """Mean greedy reward on the eval prompts."""
        if self.eval_prompts is None:
            raise ValueError("data.eval_files is not set")
        n = min(size or self.cfg.data.eval_size, len(self.eval_prompts))
        params = SamplingParams(n=1, greedy=True, max_new_tokens=self.cfg.rollout.max_response_length)
        batch = generate_batch(
            self.engine, self.eval_prompts, list(range(n)), params, policy_version=0,
            multi_turn=self.multi_turn,
        )  # fmt: skip
        return score_batch(batch, self.engine.tokenizer, self.reward_fn)[0].mean().item()
