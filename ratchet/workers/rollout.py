"""Rollout worker (a Ray actor): generates samples for a range of prompts and writes the
batch to the batch store; holds the engine and the policy version it serves.

With partial rollouts (fully_async, an engine that supports them) the actor runs two
threads: `load_weights` may arrive while a generation runs. It then hands the weights to
the generating thread, which loads them between two decode steps, and returns once they
are served; the generation goes on with them, and each token records its version.
"""

from __future__ import annotations

import contextlib
import logging
import threading
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
        configure_worker_process(cfg.resources.torch_threads, cfg.seed if cfg.deterministic else None)
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
        self.partial = partial_rollouts(cfg) and self.engine.supports_partial_rollout
        # Guards `version`, the engine's weights and the hand-over of pending weights.
        self._cv = threading.Condition()
        self._generating = False
        self._pending: tuple[Mapping[str, np.ndarray], int] | None = None

    def policy_version(self) -> int:
        return self.version

    def generate(self, step: int, prompt_start: int, prompt_count: int, policy_version: int, part: int = 0) -> dict:
        with self._generation(swappable=True) as (version, swap):
            # Newer weights than asked for are fine (a sync landed first, or the worker was
            # recreated from the trainer): the batch records the versions it really used.
            if policy_version > version:
                raise RuntimeError(f"rollout worker holds policy v{version}, asked for v{policy_version}")
            return self._generate(step, prompt_start, prompt_count, version, part, swap)

    def _generate(self, step: int, prompt_start: int, prompt_count: int, version: int, part: int, swap) -> dict:
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
        pad = self.engine.pad_id
        batch = generate_batch(self.engine, self.train, indices, params, policy_version=version, pad_id=pad, weight_swap=swap)
        if self.needs_baseline:
            # ReMax: one greedy response per prompt, scored as the baseline of its group.
            greedy = replace(params, n=1, greedy=True)
            baseline = generate_batch(self.engine, self.train, indices, greedy, policy_version=self.version, pad_id=pad, weight_swap=swap)
            baseline.save(store, step, part_name("baseline", part))
        seconds = time.perf_counter() - t0
        uri = batch.save(store, step, part_name("rollout", part))
        lengths = batch.response_mask.sum(-1)
        tokens = batch.response_mask > 0
        return {
            "policy_version": version,  # the version it started with: the oldest of its tokens
            "policy_version_max": int(batch.policy_version[tokens].max().item()) if tokens.any() else version,
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
        # An evaluation measures one version: no weight swap inside it.
        with self._generation(swappable=False) as (version, _):
            batch = generate_batch(self.engine, self.eval, indices, params, policy_version=version, pad_id=self.engine.pad_id)
        return {"uri": batch.save(BatchStore(self.run, "evals"), step), "num_samples": len(batch), "policy_version": version}

    def load_weights(self, weights: Mapping[str, np.ndarray], version: int) -> int:
        """Serve `weights` as policy `version`; returns the bytes received. During a
        generation (partial rollouts) they are loaded at its next decode step."""
        with self._cv:
            if self._generating and self._pending_allowed:
                self._pending = (weights, version)
                self._cv.wait_for(lambda: self._pending is None or self._pending[1] != version)
            else:
                self._cv.wait_for(lambda: not self._generating)
                self._load(weights, version)
        return int(sum(np.asarray(v).nbytes for v in weights.values()))

    # -- one generation at a time, and weights that change between decode steps ----------

    _pending_allowed = False  # set while a swappable generation runs

    def _load(self, weights: Mapping[str, np.ndarray], version: int) -> None:
        self.engine.load_weights(weights)
        self.version = version

    def _swap(self) -> int | None:
        """Called by the generating thread between decode steps."""
        with self._cv:
            if self._pending is None:
                return None
            weights, version = self._pending
            self._load(weights, version)
            self._pending = None
            self._cv.notify_all()
            return version

    @contextlib.contextmanager
    def _generation(self, *, swappable: bool):
        with self._cv:
            self._cv.wait_for(lambda: not self._generating)
            self._generating = True
            self._pending_allowed = swappable and self.partial
            version = self.version
        try:
            yield version, (self._swap if self._pending_allowed else None)
        finally:
            with self._cv:
                if self._pending is not None:  # arrived after the last decode step
                    self._load(*self._pending)
                    self._pending = None
                self._generating = False
                self._pending_allowed = False
                self._cv.notify_all()


def partial_rollouts(cfg: RunConfig) -> bool:
    """Whether the config asks for weight syncs inside generations (fully_async only)."""
    return cfg.rollout.partial_rollout and cfg.loop.mode == "fully_async"
