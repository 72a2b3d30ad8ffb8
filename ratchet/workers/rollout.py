"""Rollout worker (a Ray actor): generates samples for a range of prompts and writes the
batch to the batch store; holds the engine and the policy version it serves."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Mapping

import numpy as np

from ratchet.algorithms import ADV_ESTIMATORS
from ratchet.config.schema import RunConfig
from ratchet.storage import BatchStore, ObjectStore

from .batch import part_name
from .engines import ENGINES, SamplingParams
from .hf_io import local_hf_path
from .prompts import PromptSet
from .rollout_batching import generate_batch, prompt_indices
from .runtime import configure_worker_process

log = logging.getLogger(__name__)


class RolloutWorker:
    def __init__(self, cfg: RunConfig, policy_path: str, run_uri: str):
        configure_worker_process(cfg.resources.torch_threads)
        self.cfg = cfg
        self.engine = ENGINES[cfg.rollout.engine](local_hf_path(policy_path), dtype=cfg.model.dtype)
        tok = self.engine.tokenizer
        d = cfg.data
        self.train = PromptSet(d.train_files, tok, prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length)
        self.eval = (
            PromptSet(d.eval_files, tok, prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length) if d.eval_files else None
        )
        self.run = ObjectStore(run_uri)
        self.version = 0
        self.needs_baseline = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator).needs_baseline

    def policy_version(self) -> int:
        return self.version

    def generate(self, step: int, prompt_start: int, prompt_count: int, policy_version: int, part: int = 0) -> dict:
        if policy_version != self.version:
            raise RuntimeError(f"rollout worker holds policy v{self.version}, asked for v{policy_version}")
        r = self.cfg.rollout
        params = SamplingParams(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            max_new_tokens=r.max_response_length,
            # Seeded per (run seed, step): a retried rollout produces the same samples.
            seed=(self.cfg.seed * 1_000_003 + step) * 101 + part,
        )
        t0 = time.perf_counter()
        store = BatchStore(self.run)
        indices = prompt_indices(prompt_start, prompt_count, len(self.train))
        batch = generate_batch(self.engine, self.train, indices, params, policy_version=self.version, pad_id=self.engine.pad_id)
        if self.needs_baseline:
            # ReMax: one greedy response per prompt, scored as the baseline of its group.
            greedy = replace(params, n=1, greedy=True)
            baseline = generate_batch(self.engine, self.train, indices, greedy, policy_version=self.version, pad_id=self.engine.pad_id)
            baseline.save(store, step, part_name("baseline", part))
        seconds = time.perf_counter() - t0
        uri = batch.save(store, step, part_name("rollout", part))
        lengths = batch.response_mask.sum(-1)
        return {
            "uri": uri,
            "num_samples": len(batch),
            "num_response_tokens": int(lengths.sum().item()),
            "response_length_mean": float(lengths.float().mean().item()),
            "generate_seconds": seconds,
        }

    def generate_eval(self, step: int, size: int) -> dict:
        """Greedy answers to the first `size` eval prompts, stored under `evals/`."""
        if self.eval is None:
            raise RuntimeError("no data.eval_files configured")
        params = SamplingParams(n=1, greedy=True, max_new_tokens=self.cfg.rollout.max_response_length)
        indices = list(range(min(size, len(self.eval))))
        batch = generate_batch(self.engine, self.eval, indices, params, policy_version=self.version, pad_id=self.engine.pad_id)
        return {"uri": batch.save(BatchStore(self.run, "evals"), step), "num_samples": len(batch)}

    def load_weights(self, weights: Mapping[str, np.ndarray], version: int) -> int:
        """Serve `weights` as policy `version`; returns the bytes received."""
        self.engine.load_weights(weights)
        self.version = version
        return int(sum(np.asarray(v).nbytes for v in weights.values()))
