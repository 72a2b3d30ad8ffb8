"""Reward worker (a Ray actor): scores a stored batch with the configured function and
writes the rewards next to it."""

from __future__ import annotations

import time

from ratchet.config.schema import RunConfig
from ratchet.storage import BatchStore, ObjectStore
from ratchet.tasks.loading import load_reward_fn

from .batch import RolloutBatch, save_scores
from .hf_io import local_hf_path
from .runtime import configure_worker_process
from .scoring import score_batch


class RewardWorker:
    def __init__(self, cfg: RunConfig, tokenizer_path: str, run_uri: str):
        from transformers import AutoTokenizer

        configure_worker_process(cfg.resources.torch_threads)
        self.reward_fn = load_reward_fn(cfg.reward.function)
        self.tokenizer = AutoTokenizer.from_pretrained(local_hf_path(tokenizer_path))
        self.run = ObjectStore(run_uri)

    def score(self, step: int, kind: str = "batches") -> dict:
        t0 = time.perf_counter()
        store = BatchStore(self.run, kind)
        batch = RolloutBatch.load(store, step)
        rewards, extras = score_batch(batch, self.tokenizer, self.reward_fn)
        save_scores(store, step, rewards, extras)
        return {
            "reward_mean": float(rewards.mean().item()),
            "reward_std": float(rewards.std().item()) if len(rewards) > 1 else 0.0,
            "num_samples": len(rewards),
            "seconds": time.perf_counter() - t0,
        }
