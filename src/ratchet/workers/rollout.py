"""Rollout worker (a Ray actor): generates samples for a range of prompts and writes the
batch to the batch store; holds the engine and the policy version it serves.

The actor shell of one replica: its Ray-facing methods, generation (a batch, a share of
one, a share generated ahead of its request, an evaluation) and the weights it is sent.
What it serves is its weight slot (weight_slot.py): one generation at a time, weights
loaded between generations or, with partial rollouts (fully_async, an engine that
supports them), between two decode steps of the generation in flight, and in a
deterministic run the policy log a recreated worker serves an older version from.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar, Mapping

import numpy as np
import ray

from ratchet.algorithms import ADV_ESTIMATORS
from ratchet.catalog.weight_transports import WEIGHT_TRANSPORTS
from ratchet.config.schema import RunConfig
from ratchet.data.order import data_order_seed
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout
from ratchet.start_up_gc import during_start_up

from .batch import join_shares
from .columns import Parts, part_name
from ratchet.workers.engines.base import SamplingParams
from ratchet.workers.engines.build import build_engine
from .hf_io import local_hf_path
from .multi_turn import MultiTurnRollout
from .prompts import PromptSet
from .results import EvalBatchResult, GenerateResult, LoadReport, RolloutShare
from .batch_seeds import prompt_indices, sampling_seed
from .rollout_batching import generate_batch
from .runtime import configure_worker_process
from .weight_slot import WeightSlot
from .weight_sync import WeightSource, as_source

if TYPE_CHECKING:
    from .weight_sync.device_sync import EngineGroup

log = logging.getLogger(__name__)

# `policy_version` answers on a thread of its own: a step probes its replicas while they
# still generate the batch prefetched for it, and its request for that batch is queued
# right behind the generation instead of behind the probe's answer (one round trip less).
PROBE_GROUP = "probe"


class RolloutWorker:
    # Ray creates the actor with these (placement.create_actor reads them from the class).
    CONCURRENCY_GROUPS: ClassVar[dict[str, int]] = {PROBE_GROUP: 1}

    @during_start_up
    def __init__(self, cfg: RunConfig, policy_path: str, run_uri: str):
        configure_worker_process(cfg.resources.torch_threads, cfg.seed if cfg.deterministic else None)
        self.cfg = cfg
        self.policy_path = local_hf_path(policy_path)
        self.engine = build_engine(cfg, self.policy_path)
        tok = self.engine.tokenizer
        d = cfg.data
        self.train = PromptSet.from_config(d, d.train_files, tok)
        self.eval = PromptSet.from_config(d, d.eval_files, tok) if d.eval_files else None
        self.order_seed = data_order_seed(cfg)  # the training prompts' order (data.shuffle, data.seed)
        # rollout.multi_turn: tools built and every row's tools_kwargs checked before any generation.
        self.multi_turn = MultiTurnRollout.from_config(cfg, tok)
        if self.multi_turn is not None:
            self.multi_turn.check_prompts(self.train, d.train_files)
            if self.eval is not None and d.eval_files is not None:
                self.multi_turn.check_prompts(self.eval, d.eval_files)
        self.run = ObjectStore(run_uri)
        self.needs_baseline = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator).needs_baseline
        # A share generated ahead of its request (`prefetch_share`), by its request's arguments;
        # dropped whenever the weights are replaced.
        self._prefetched: tuple[tuple, RolloutShare] | None = None
        partial = cfg.uses_partial_rollouts and self.engine.supports_partial_rollout
        self.slot = WeightSlot(self.engine, cfg, self.run, self.policy_path, partial=partial, on_replace=self._drop_prefetched)
        self.engine_group: EngineGroup | None = None  # its membership of the NCCL transport's engine group

    @property
    def version(self) -> int:
        """The policy version the engine serves (TORN_VERSION: a load failed halfway)."""
        return self.slot.version

    def _drop_prefetched(self) -> None:
        self._prefetched = None

    @ray.method(concurrency_group=PROBE_GROUP)
    def policy_version(self) -> int:
        return self.version

    def generate(
        self, batch_index: int, prompt_start: int, prompt_count: int, policy_version: int, part: int = 0, exact: bool = False
    ) -> GenerateResult:
        share = self.generate_share(batch_index, prompt_start, prompt_count, policy_version, part, exact)
        return self.save_shares(batch_index, part, share)

    def generate_share(
        self, batch_index: int, prompt_start: int, prompt_count: int, policy_version: int, part: int = 0, exact: bool = False,
        position: int = 0,
    ) -> RolloutShare:  # fmt: skip
        """The samples of `prompt_count` prompts from `prompt_start`, kept in memory: the
        prompts at `position` .. of batch `batch_index` (rollout_pool.py splits a batch
        over replicas; a prompt's seed depends on its position, so the split does not
        change the samples)."""
        with self.slot.generation(swappable=True) as (version, swap):
            # Newer weights than asked for are fine (a sync landed first, or the worker was
            # recreated from the trainer): the batch records the versions it really used.
            # A deterministic run asks for exactly one version.
            if policy_version > version or (exact and policy_version != version):
                raise RuntimeError(f"rollout worker holds policy v{version}, asked for v{policy_version}")
            return self._generate(batch_index, prompt_start, prompt_count, version, part, swap, position)

    def generate_share_and_version(
        self, batch_index: int, prompt_start: int, prompt_count: int, policy_version: int, part: int = 0, exact: bool = False,
        position: int = 0,
    ) -> tuple[int, RolloutShare]:  # fmt: skip
        """`generate_share`, returned as (its policy version, the share): called with Ray's
        num_returns=2, the rollout pool waits on the small first value and hands the share
        on by reference, never fetching it (workers/actors/rollout_pool.py)."""
        key = (batch_index, prompt_start, prompt_count, policy_version, part, exact, position)
        ahead, self._prefetched = self._prefetched, None
        share = ahead[1] if ahead is not None and ahead[0] == key else self.generate_share(*key)
        return share.policy_version, share

    def prefetch_share(
        self, batch_index: int, prompt_start: int, prompt_count: int, policy_version: int, part: int = 0, exact: bool = False,
        position: int = 0,
    ) -> None:  # fmt: skip
        """Generate the share a request with these arguments will ask for, and keep it for
        that request (`generate_share_and_version`). Sync mode starts the next batch so
        right after the weight sync, while Temporal records the step and schedules the
        next one (rollout_pool.prefetch_shares). The samples are those the request would
        generate (the same seeds and weights: any weight load drops a kept share), so a
        wrong guess only costs the generation. Skipped while the worker holds an older
        version than `policy_version`: the prefetch is queued behind the load of that
        version (`load_published`), which may have had nothing to load or failed. Never
        raises: the request generates anew."""
        if self.version < policy_version:
            return
        key = (batch_index, prompt_start, prompt_count, policy_version, part, exact, position)
        try:
            share = self.generate_share(*key)
        except Exception:  # noqa: BLE001 - the request itself reports it
            log.warning("prefetching batch %d (prompts from %d) failed; its request generates it", batch_index, prompt_start, exc_info=True)
            return
        self._prefetched = (key, share)

    def save_shares(self, batch_index: int, part: int, *shares: RolloutShare) -> GenerateResult:
        """Store the shares, in the order given, as rollout part `part` of batch
        `batch_index` (one share: as generated), the same rows one worker would write."""
        store = BatchStore(self.run)
        batch, baseline = join_shares(list(shares))
        if baseline is not None:
            baseline.save(store, batch_index, part_name(Parts.BASELINE, part))
        uri = batch.save(store, batch_index, part_name(Parts.ROLLOUT, part))
        lengths = batch.response_mask.sum(-1)
        return GenerateResult(
            uri=uri,
            num_samples=len(batch),
            num_response_tokens=int(lengths.sum().item()),
            response_length_mean=float(lengths.float().mean().item()),
            # The shares ran side by side: the batch took as long as the slowest.
            generate_seconds=max(s.generate_seconds for s in shares),
            policy_version=min(s.policy_version for s in shares),
        )

    def _generate(
        self, batch_index: int, prompt_start: int, prompt_count: int, version: int, part: int, swap, position: int = 0
    ) -> RolloutShare:
        r = self.cfg.rollout
        params = SamplingParams(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            max_new_tokens=r.max_response_length,
            seed=sampling_seed(self.cfg.seed, batch_index, part),
        )
        t0 = time.perf_counter()
        indices = prompt_indices(prompt_start, prompt_count, len(self.train), self.order_seed)
        batch = generate_batch(
            self.engine, self.train, indices, params, policy_version=version, weight_swap=swap, first_position=position,
            multi_turn=self.multi_turn,
        )  # fmt: skip
        baseline = None
        if self.needs_baseline:
            # ReMax: one greedy response per prompt, scored as the baseline of its group.
            greedy = replace(params, n=1, greedy=True)
            baseline = generate_batch(
                self.engine, self.train, indices, greedy, policy_version=self.version, weight_swap=swap,
                multi_turn=self.multi_turn,
            )  # fmt: skip
        return RolloutShare(batch=batch, baseline=baseline, generate_seconds=time.perf_counter() - t0, policy_version=version)

    # -- colocated placement: the engine gives its device memory back while the trainer runs

    def sleep(self) -> bool:
        """Release the engine's device memory if it can (vLLM sleep mode, SGLang
        release_memory_occupation; nothing on CPU). Returns whether the engine has `sleep`."""
        return self._engine_call("sleep")

    def wake_up(self) -> bool:
        """Take the engine's memory back before it generates or loads weights."""
        return self._engine_call("wake_up")

    def _engine_call(self, method: str) -> bool:
        fn = getattr(self.engine, method, None)
        if fn is None:
            return False
        self.slot.between_generations(fn)
        return True

    def generate_eval(self, step: int, size: int) -> EvalBatchResult:
        """Greedy answers to the first `size` eval prompts, stored under `evals/` by the
        training step `step` they evaluate."""
        if self.eval is None:
            raise RuntimeError("no data.eval_files configured")
        params = SamplingParams(n=1, greedy=True, max_new_tokens=self.cfg.rollout.max_response_length)
        indices = list(range(min(size, len(self.eval))))
        # An evaluation measures one version: no weight swap inside it.
        with self.slot.generation(swappable=False) as (version, _):
            batch = generate_batch(self.engine, self.eval, indices, params, policy_version=version, multi_turn=self.multi_turn)
        return EvalBatchResult(uri=batch.save(BatchStore(self.run, RunLayout.EVALS), step), num_samples=len(batch), policy_version=version)

    def load_published(self, published: "WeightSource | None") -> LoadReport | None:
        """`load_weights` of the buckets trainer rank 0 published with its update, or None
        when it published none (weights in more than one bucket: the step streams them).
        Sync mode's step chains this call on the update's result, so the load starts as
        soon as the update ends, without a round trip through the activity."""
        if published is None:
            return None
        t0 = time.perf_counter()
        nbytes = self.load_weights(published)
        return LoadReport(version=self.version, bytes=nbytes, seconds=time.perf_counter() - t0)

    def load_weights(self, weights: "WeightSource | Mapping[str, np.ndarray]", version: int | None = None) -> int:
        """Serve `weights` (a weight source: a stream of buckets from the trainer, or a dict
        of arrays) as policy `version` (None: the version the source names); returns the
        bytes received. The names are checked against the model before anything is loaded.
        During a generation (partial rollouts) they are loaded at its next decode step."""
        return self.slot.load(as_source(weights, version), version)

    def receive_weights(self, transport: str, rank, sync_id: str, consumer: int) -> int:
        """`load_weights` of one relayed sync (weight_sync/transport.py): the source that
        `transport` (catalog/weight_transports.py) builds to pull it from trainer `rank`,
        this replica being that rank's receiver `consumer`; returns the bytes received."""
        return self.load_weights(WEIGHT_TRANSPORTS.get(transport).source(self, rank, sync_id, consumer))

    # -- the NCCL transport's engine group (weight_sync/device_sync.py) -------------------

    def engine_group_key(self) -> str | None:
        return self.engine_group.key if self.engine_group is not None else None

    def join_engine_group(self, key: str, host: str, port: int, rank: int, world_size: int) -> str:
        """Join the engine group for membership `key` as member `rank` (>= 1); an older one is dropped."""
        from .weight_sync.device_sync import join_engine_group

        if rank < 1:
            raise ValueError(f"engine group rank 0 is trainer rank 0; a rollout replica joins as 1 or more, not {rank}")
        self.engine_group = None
        self.engine_group = join_engine_group(key, host, port, rank, world_size)
        return key

    # -- deterministic runs: every version served is kept a while (weight_slot.py) ----------

    def serve_logged(self, version: int) -> bool:
        """Serve policy `version` from the policy log (a deterministic run asks when this
        worker holds another version); False if that version is not logged."""
        return self.slot.serve_logged(version)
