"""Reward worker (a Ray actor): scores a stored batch with the configured rule-based
function and/or reward model, and writes the rewards next to the batch; with Safe-RLHF
also each sample's cost (workers/safety.py), with a rollout filter its verdicts
(workers/rollout_filter.py)."""

from __future__ import annotations

import time

import torch

from ratchet.config.schema import RunConfig
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout
from ratchet.tasks.loading import load_reward_fn
from ratchet.start_up_gc import during_start_up

from .batch import HandedStep, RolloutBatch, StepScores, join_shares, score_summary
from .columns import Parts, part_name
from .hf_io import local_hf_path
from .results import ScoreResult
from .rollout_filter import RolloutFilter
from .safety import CostScorer
from .runtime import configure_worker_process
from .scoring import RewardModelScorer, check_finite_rewards, score_batch


class RewardWorker:
    @during_start_up
    def __init__(self, cfg: RunConfig, tokenizer_path: str, run_uri: str):
        configure_worker_process(cfg.resources.torch_threads, cfg.seed if cfg.deterministic else None)
        from ratchet.hf_imports import load_tokenizer  # after configure_worker_process: see hf_imports.py

        r = cfg.reward
        self.cfg = r
        self.reward_fn = load_reward_fn(r.function) if r.function else None
        self.reward_model = RewardModelScorer(r.model_path) if r.model_path else None
        self.tokenizer = load_tokenizer(local_hf_path(tokenizer_path))  # decodes only: no model registry
        self.run = ObjectStore(run_uri)
        self.costs = CostScorer(cfg.safety) if cfg.uses_safety else None
        self.filter = RolloutFilter(cfg.rollout.filter) if cfg.rollout.filter else None

    def _screened(self, batch: RolloutBatch, rewards: torch.Tensor, batch_index: int | None):
        """(rewards with a filter's replacements, costs or None, the filter's keep or None)."""
        keep = None
        if self.filter is not None:
            keep, rewards = self.filter.apply(batch, self.tokenizer, rewards, batch_index)
        costs = self.costs.score(batch, self.tokenizer, batch_index) if self.costs is not None else None
        return rewards, costs, keep

    def _rewards(self, batch: RolloutBatch, batch_index: int | None = None) -> tuple[torch.Tensor, list[dict]]:
        """function_weight * rule score + model_weight * reward-model score."""
        total = torch.zeros(len(batch))
        extras: list[dict] = [{} for _ in range(len(batch))]
        if self.reward_fn is not None:
            rule, rule_extras = score_batch(batch, self.tokenizer, self.reward_fn, batch_index)
            total += self.cfg.function_weight * rule
            extras = [{**e, "rule_score": float(s)} for e, s in zip(rule_extras, rule)]
        if self.reward_model is not None:
            rm = self.reward_model.score(batch, self.tokenizer)
            check_finite_rewards(rm, batch.samples, batch_index, "the reward model")
            total += self.cfg.model_weight * rm
            extras = [{**e, "rm_score": float(s)} for e, s in zip(extras, rm)]
        check_finite_rewards(total, batch.samples, batch_index, "the reward mix (reward.function_weight, reward.model_weight)")
        return total, extras

    def _score(self, batch: RolloutBatch, baseline: RolloutBatch | None, batch_index: int) -> StepScores:
        """One round's scores, however the batch came: read from the store (`score`) or
        handed over in memory (`score_shares`). `baseline`: ReMax's greedy responses."""
        t0 = time.perf_counter()
        rewards, extras = self._rewards(batch, batch_index)
        rewards, costs, keep = self._screened(batch, rewards, batch_index)
        base_rewards, base_extras = self._rewards(baseline, batch_index) if baseline is not None else (None, None)
        result = score_summary(rewards, batch.prompt_index, time.perf_counter() - t0)
        return StepScores(
            rewards=rewards.float(), extras=extras, result=result, baseline_rewards=base_rewards, baseline_extras=base_extras,
            costs=costs, keep=keep,
        )  # fmt: skip

    def score(self, batch_index: int, kind: str = RunLayout.BATCHES, part: int = 0) -> ScoreResult:
        """Score stored round `part` of batch `batch_index` of `kind` (batches/, evals/) and
        store the scores beside it."""
        store = BatchStore(self.run, kind)
        batch = RolloutBatch.load(store, batch_index, part_name(Parts.ROLLOUT, part))
        baseline_name = part_name(Parts.BASELINE, part)
        baseline = RolloutBatch.load(store, batch_index, baseline_name) if store.has(batch_index, baseline_name) else None
        scores = self._score(batch, baseline, batch_index)
        scores.save(store, batch_index, part)
        return scores.result

    def score_shares(self, batch_index: int, *shares) -> StepScores:
        """Score a batch handed over in memory (`results.RolloutShare`s, in order: sync
        mode's `step` activity), joined as the rollout worker stores it; nothing is written
        here: `store_handed` does."""
        batch, baseline = join_shares(list(shares))
        return self._score(batch, baseline, batch_index)

    def store_handed(self, batch_index: int, scores: StepScores, *shares) -> None:
        """Store a batch handed over in memory with its scores as batch `batch_index`
        (`HandedStep.save`: the parts recovery replays), while the trainer updates on it:
        here rather than on a trainer thread, whose serialising would hold the trainer's GIL
        (about 10 ms of a 250 ms update on the tiny model)."""
        HandedStep.from_shares(scores, list(shares)).save(BatchStore(self.run), batch_index)
