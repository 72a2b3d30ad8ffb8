"""Trainer worker (a Ray actor, one per rank): runs `PolicyTrainer` on stored batches and
hands out its weights for the rollout engines. Ranks > 1 form a gloo process group and
the policy is sharded with FSDP2.

Every update is logged (`train_log/v<version>.json`: which stored batch, how many parts,
the KL coefficient), so a lost trainer is rebuilt from the last checkpoint plus a replay
of the updates after it (workers/actors/recovery.py). Checkpoints are taken without stalling
training for the upload: a snapshot of the state is copied to memory, and a background
thread on every rank writes its shard (torch.distributed.checkpoint) into a folder of its
own and uploads it; rank 0 also exports the policy in Hugging Face format and, once every
rank's upload is done, commits the manifest last (storage/checkpoint_store.py). A restore
has every rank fetch the state from the object store itself (`restore_from_store`), so no
rank needs a disk shared with another, or with the node that wrote the checkpoint.

The actor shell of one rank: its Ray-facing methods, set-up (the process group, the
policy), the update with its retry cache (a retried activity's update answered, not made
twice). The jobs behind it are objects of their own: the update itself
(policy_update.py), the checkpoints, restores and export (rank_checkpoints.py), and the
sending side of every weight sync (weight_sync/sender.py), whose receivers call the
`sync_*` methods here.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import ray

from ratchet.config.schema import RunConfig
from ratchet.errors import NonFiniteError
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout
from ratchet.start_up_gc import during_start_up

from .background import BackgroundCall
from .batch import HandedStep, HandedSummary, ScoredStep, StepScores, load_step
from .columns import Fields, Parts
from .hf_io import local_hf_path
from .policy_update import PolicyTrainer
from .rank_checkpoints import RankCheckpoints
from .results import CheckpointOutcome, CheckpointStarted, SetupInfo, TrainResult, WarmupResult
from .runtime import configure_worker_process, free_port, node_address
from .weight_sync.protocol import SYNC_GROUP, SYNC_GROUP_THREADS, StreamReport
from .weight_sync.ray_transport import PublishedSource
from .weight_sync.sender import WeightSender

if TYPE_CHECKING:
    from .checkpointing import StoreRestore

log = logging.getLogger(__name__)


class TrainerWorker:
    # Ray creates the actor with these (placement.create_actor reads them from the class):
    # `published_weights` answers from a thread of its own, while an update runs; the
    # `sync_*` methods hand buckets to the rollout replicas while the main thread gathers them.
    CONCURRENCY_GROUPS: ClassVar[dict[str, int]] = {"published": 1, SYNC_GROUP: SYNC_GROUP_THREADS}

    @during_start_up
    def __init__(self, cfg: RunConfig, policy_path: str, run_uri: str, rank: int, world_size: int):
        configure_worker_process(cfg.resources.torch_threads, cfg.seed if cfg.deterministic else None)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self._policy_uri = policy_path
        self._policy_path: str | None = None
        self.run_uri = run_uri
        self.run = ObjectStore(run_uri)
        self.trainer: PolicyTrainer | None = None
        # The retry cache: a retried activity's update answered, not made twice.
        self._last: tuple | None = None  # ((batch index, version it trained), StepResult) of the latest update
        self._handed: tuple[tuple[int, int], HandedStep] | None = None  # the batch handed in memory for it (train_handed)
        self.weights = WeightSender(cfg, rank, world_size, lambda: self.policy)  # weight_sync/sender.py
        self.checkpoints = RankCheckpoints(cfg, rank, world_size, self.run, lambda: self.policy, lambda: self.policy_path, self.restore)
        self._num_parameters = 0
        self.process_group_inits = 0  # init_process_group calls in this actor (once, or a retry broke it)

    @property
    def policy(self) -> PolicyTrainer:
        """The rank's policy trainer, made by `setup` (a RuntimeError naming the rank before)."""
        if self.trainer is None:
            raise RuntimeError(f"trainer rank {self.rank} is not set up: `setup` comes first")
        return self.trainer

    @property
    def policy_path(self) -> str:
        """The policy's local folder, found on first use: rank 0 is made before the warm-up
        (it runs it: `warm_up`), with the address of a warm-up model that does not exist yet."""
        if self._policy_path is None:
            self._policy_path = local_hf_path(self._policy_uri)
        return self._policy_path

    def warm_up(self, base_model_path: str) -> WarmupResult:
        """The run's supervised warm-up (workers/warmup.py), in this process, before `setup`.
        The process that trains next has then imported torch and transformers and warmed
        up its kernels already: the warm-up costs no process of its own, which was about 7 s
        of every run's start-up. Python's, numpy's and torch's global generators are left as
        they were, so the rank sets up exactly as one that never warmed up (a rank rebuilt
        from a checkpoint does not)."""
        import random

        import numpy as np
        import torch

        from .warmup import warmup_policy

        if self.trainer is not None:
            raise RuntimeError(f"trainer rank {self.rank} is set up already: the warm-up comes first")
        py_state, np_state = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[]):
                return warmup_policy(self.cfg, base_model_path, self.run_uri)
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)

    def rendezvous_address(self) -> tuple[str, int]:
        """(host, port) for the process group's rendezvous, asked of rank 0: its node's
        address in the Ray cluster (127.0.0.1 outside Ray) and a port free there. The
        other ranks, maybe on other nodes, pass it to `setup`."""
        host = node_address()
        return host, free_port(host)

    @during_start_up
    def setup(self, master_port: int, master_addr: str | None = None) -> int:
        """Join the process group (all ranks at once) and load the policy; returns parameter
        count. `master_addr`/`master_port`: rank 0's `rendezvous_address` (no address:
        127.0.0.1, every rank on one machine). A rank already set up answers at once: a
        retried start_workers must not initialise the process group a second time."""
        if self.trainer is not None:
            return self._num_parameters
        if self.world_size > 1:
            import torch.distributed as dist

            from .runtime import join_process_group, resolve_device

            if dist.is_initialized():
                raise RuntimeError(f"trainer rank {self.rank}: process group joined but the set-up failed; recreate the ranks")
            # NCCL on CUDA, gloo on CPU (trainer.device); one rank on CUDA joins a group of
            # its own inside PolicyTrainer (FSDP2 needs one).
            device = resolve_device(self.cfg.trainer.device, self.rank)
            join_process_group(device, self.rank, self.world_size, master_port, master_addr or "127.0.0.1", node_address())
            self.process_group_inits += 1
        trainer = PolicyTrainer(self.policy_path, self.cfg, rank=self.rank, world_size=self.world_size)
        self._num_parameters = trainer.num_parameters()  # a collective: every rank is here
        self.trainer = trainer
        return self._num_parameters

    def setup_info(self) -> SetupInfo:
        """Whether this rank is set up, in which world; for a retried start_workers."""
        return SetupInfo(
            ready=self.trainer is not None,
            world_size=self.world_size,
            num_parameters=self._num_parameters,
            process_group_inits=self.process_group_inits,
            policy_uri=self._policy_uri,
        )

    def policy_version(self) -> int:
        """The version held; -1 before `setup` finished (a half-built rank is rebuilt)."""
        return self.trainer.version if self.trainer is not None else -1

    # -- weight sync (weight_sync/sender.py; the driver and the table of transports:
    # weight_sync/transport.py). The receivers call the `sync_*` methods.

    @ray.method(concurrency_group="published")
    def published_weights(self) -> tuple[int, PublishedSource] | None:
        """The latest published (version, its buckets as a weight source), or None."""
        return self.weights.published

    def send_weights(self, sync_id: str, transport: str, consumers: int) -> StreamReport:
        """Send the weights by `transport` to the `consumers` rollout replicas this rank
        serves (0: it only joins the gathers, which are collectives)."""
        return self.weights.send(sync_id, transport, consumers)

    @ray.method(concurrency_group=SYNC_GROUP)
    def sync_manifest(self, sync_id: str):
        return self.weights.relays.get(sync_id).manifest()

    @ray.method(concurrency_group=SYNC_GROUP)
    def sync_take(self, sync_id: str, consumer: int, index: int):
        """Bucket `index` as the transport hands it (an ObjectRef, an IPC handle, a ready
        signal; None past the last); the receiver is done with the ones before it."""
        return self.weights.relays.get(sync_id).take(consumer, index)

    @ray.method(concurrency_group=SYNC_GROUP)
    def sync_leave(self, sync_id: str, consumer: int, error: str | None = None) -> None:
        if error:
            log.warning("weight sync %s: receiver %d stopped: %s", sync_id, consumer, error)
        self.weights.relays.get(sync_id, timeout_s=0).leave(consumer)

    @ray.method(concurrency_group=SYNC_GROUP)
    def sync_abort(self, sync_id: str, reason: str) -> None:
        self.weights.relays.get(sync_id, timeout_s=0).fail(reason)

    def sync_device(self):
        return self.weights.sync_device()

    # -- the NCCL transport's engine group (weight_sync/device_sync.py) -------------------

    def engine_group_key(self) -> str | None:
        """The membership this rank's engine group was made for (None: none)."""
        return self.weights.engine_group.key if self.weights.engine_group is not None else None

    def engine_group_address(self) -> tuple[str, int]:
        """(host, port) for the engine group's TCPStore, which rank 0 hosts on its node."""
        host = node_address()
        return host, free_port(host)

    def join_engine_group(self, key: str, host: str, port: int, rank: int, world_size: int) -> str:
        return self.weights.join_engine_group(key, host, port, rank, world_size)

    # -- the update ------------------------------------------------------------------------

    def train(
        self, batch_index: int, policy_version: int, kl_coef: float, parts: int = 1, optimizer: dict | None = None,
        data: ScoredStep | None = None, live: dict | None = None, safe_lambda: float | None = None,
        write_behind: list | None = None,
    ) -> TrainResult:  # fmt: skip
        """Update policy v`policy_version` on stored batch `batch_index`. A retried activity
        whose first attempt already updated the policy gets that update's result instead of
        a second update. `optimizer` (lr, betas, weight_decay): the settings a logged update
        used, for a replay; by default the run's config (which a resume may have changed).
        `live`: hyper-parameters set while the run trains (config/live_keys.py), over the
        config for this update only; logged with it, so a replay uses them again.
        `safe_lambda`: Safe-RLHF's multiplier in force (None: safety.lambda_init), logged
        like `kl_coef`. `write_behind`: rank 0 writes the update's log and advantages on a
        thread it appends there, for the caller to join before it reports the update."""
        from ratchet.config.live_keys import live_config

        from .checkpointing import apply_optimizer_hyperparameters, config_hyperparameters

        t0 = time.perf_counter()
        cfg = live_config(self.cfg, live or {})
        hyper = optimizer or config_hyperparameters(cfg)
        store = BatchStore(self.run)
        if self._last is not None and self._last[0] == (batch_index, policy_version) and self.policy.version == policy_version + 1:
            result = self._last[1]
        else:
            if policy_version != self.policy.version:
                raise RuntimeError(f"trainer holds policy v{self.policy.version}, asked to train v{policy_version}")
            data = data if data is not None else load_step(store, batch_index, parts)  # in memory: train_handed
            apply_optimizer_hyperparameters(self.policy, hyper)
            values = store.read(batch_index, Parts.VALUES)[0][Fields.VALUES] if store.has(batch_index, Parts.VALUES) else None
            self.policy.cfg = cfg  # the loss weights, clip bounds and epochs it reads per update
            try:
                result = self.policy.train_step(data, kl_coef=kl_coef, values=values, safe_lambda=safe_lambda)
            except NonFiniteError as e:
                raise NonFiniteError(f"batch {batch_index} (policy v{policy_version}): {e}") from None
            finally:
                self.policy.cfg = self.cfg
            self._last = ((batch_index, policy_version), result)
            if self.cfg.uses_partial_rollouts:
                self.weights.publish()
        if self.rank == 0:
            log_entry = {
                "batch": batch_index, "parts": parts, "kl_coef": kl_coef, "optimizer": hyper, "live": dict(live or {}),
                **({"safe_lambda": safe_lambda} if safe_lambda is not None else {}),
            }  # fmt: skip

            def write() -> None:
                store.write(batch_index, Parts.ADVANTAGES, {Fields.ADVANTAGES: result.advantages, Fields.RETURNS: result.returns}, {})
                self.run.put_json(RunLayout.train_log(policy_version), log_entry)

            if write_behind is None:
                write()
            else:
                write_behind.append(BackgroundCall(write, "write-update-log"))
        result.metrics["train_seconds"] = time.perf_counter() - t0
        result.metrics["lr"] = float(hyper["lr"])  # the learning rate this update used (live or the config's)
        return TrainResult(
            policy_version=self.policy.version, metrics=result.metrics, kl_coef=result.kl_coef, safe_lambda=result.safe_lambda
        )

    def train_handed(
        self, batch_index: int, policy_version: int, kl_coef: float, scores: StepScores | None = None, *shares,
        live: dict | None = None, safe_lambda: float | None = None, publish: bool = False,
    ) -> tuple[TrainResult, HandedSummary, PublishedSource | None]:  # fmt: skip
        """`train` on a batch handed over in memory (sync mode's `step` activity): the
        rollout shares (`results.RolloutShare`) and their scores, through Ray's object store.
        The reward worker stores them as batch `batch_index` while the update runs
        (`RewardWorker.store_handed`; recovery replays the stored batch, and the activity
        completes only once both are done). A retried call whose first try already updated
        stores and reports the batch that update used: kept here, or (kept by a trainer that
        no longer holds it) read back from the store.

        `publish`: also return the new weights as a `PublishedSource` when they fit in one
        sync bucket (small models), so the step's sync is a single load on each replica
        rather than a stream of round trips; the peak is the same one bucket. None otherwise.
        The step calls this with num_returns=3 and chains each replica's load on the third
        value, so the replicas load while the other two come back."""
        key = (batch_index, policy_version)
        repeat = self._last is not None and self._last[0] == key and self.policy.version == policy_version + 1
        if repeat and self._handed is not None and self._handed[0] == key:
            step = self._handed[1]
        elif repeat or scores is None:
            step = HandedStep.load(BatchStore(self.run), batch_index)
        else:
            step = HandedStep.from_shares(scores, list(shares))
        writes: list[BackgroundCall] = []
        if self.rank == 0 and (repeat or scores is None):  # a first try's batch is the reward worker's to store
            writes.append(BackgroundCall(lambda: step.save(BatchStore(self.run), batch_index), "store-handed-batch"))
        try:
            result = self.train(
                batch_index, policy_version, kl_coef, data=step.scored_step(), live=live, safe_lambda=safe_lambda, write_behind=writes
            )
            self._handed = (key, step)
            # The update's log is written while the new weights are put out for the sync.
            published = self.weights.one_bucket() if publish else None
        finally:
            for w in writes:
                w.join()
        for w in writes:
            if w.error is not None:
                raise w.error
        return result, step.summary(), published

    # -- checkpoints (rank_checkpoints.py) --------------------------------------------------

    def start_checkpoint(
        self, step: int, run_state: dict, extra_files: dict[str, bytes] | None = None, foreground: bool = False
    ) -> CheckpointStarted:
        """Snapshot the state (the only stall), then write, export and upload it in the
        background (with `foreground`, before returning). Every rank calls."""
        return self.checkpoints.start(step, run_state, extra_files, foreground)

    def redo_checkpoint(self) -> CheckpointOutcome:
        """Take the latest checkpoint again if it failed on any rank (every rank calls)."""
        return self.checkpoints.redo()

    def wait_checkpoint(self) -> CheckpointOutcome:
        """The latest checkpoint's outcome, once it is committed or failed."""
        return self.checkpoints.wait()

    def restore_from_store(self, name: str) -> StoreRestore:
        """Load checkpoint `name`'s trainer state from the run's object store (every rank
        calls; a collective)."""
        return self.checkpoints.restore_from_store(name)

    def restore(self, local_dir: str) -> int:
        """Load a downloaded checkpoint's trainer state (any world size; every rank calls, a
        collective); the version it holds. `local_dir` must be on this rank's node and hold
        every rank's files: `restore_from_store` is the way for ranks on several nodes."""
        from .checkpointing import load_trainer_state

        load_trainer_state(self.policy, Path(local_dir) / RunLayout.TRAINER_STATE)
        self._last = None  # a retry cache of the replaced state must not answer for the new one
        self.weights.published = None
        return self.policy.version

    def export(self, key: str) -> str | None:
        """Save the policy in Hugging Face format under the run folder (every rank calls:
        unsharding is a collective; rank 0 writes)."""
        return self.checkpoints.export(key)
