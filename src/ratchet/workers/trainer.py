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

Long (over 500 lines) but one job: the Ray-facing methods of one rank. The work behind
them lives elsewhere (policy_update.py, checkpointing.py, weight_sync/); what stays here is
the ordering between them on a rank's threads, which is clearest in one place.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import ray

from ratchet.catalog.weight_transports import WEIGHT_TRANSPORTS
from ratchet.config.schema import RunConfig
from ratchet.errors import NonFiniteError
from ratchet.storage import BatchStore, CheckpointStore, ObjectStore, RunLayout
from ratchet.start_up_gc import during_start_up

from .background import BackgroundCall
from .batch import HandedStep, HandedSummary, ScoredStep, StepScores, load_step
from .columns import Fields, Parts
from .hf_io import local_hf_path, upload_hf_folder, write_hf_folder
from .local_paths import restore_dir, staging_dir
from .lora import adapter_state, sync_view, write_adapter_folder
from .policy_update import PolicyTrainer, check_finite_weights
from .results import CheckpointOutcome, CheckpointStarted, SetupInfo, TrainResult, WarmupResult
from .runtime import configure_worker_process, free_port, node_address
from .weight_sync.protocol import SYNC_GROUP, SYNC_GROUP_THREADS, RelayRegistry, StreamReport
from .weight_sync.ray_transport import PublishedSource
from .weight_sync.relay import BucketRelay
from .weight_sync.trainer_side import check_finite_shards, gather_and_offer, sync_plan

if TYPE_CHECKING:
    from .checkpointing import StoreRestore
    from .weight_sync.device_sync import EngineGroup

log = logging.getLogger(__name__)
# Building a Hugging Face model for an export: one thread of the process at a time (_write_hf).
_HF_BUILD_LOCK = threading.Lock()


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
        self._last: tuple | None = None  # ((batch index, version it trained), StepResult) of the latest update
        self._checkpointing: threading.Thread | None = None  # the background write and upload
        # (version, its buckets in the object store) after each update, on rank 0, when syncs
        # overlap updates (partial rollouts): a sync need not wait for the update in flight.
        self._published: tuple[int, PublishedSource] | None = None
        self._relays = RelayRegistry()  # a rank with receivers: the syncs it serves
        self.engine_group: EngineGroup | None = None  # rank 0: its membership of the NCCL transport's engine group
        # The outcome of the latest checkpoint (None: committed or none yet), kept until a
        # later checkpoint replaces it, so a failed upload is always reported.
        self._checkpoint_error: str | None = None
        self._checkpoint_request: tuple | None = None  # (step, run_state, extra files, version) of the latest
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

    def _sync_plan(self):
        t = self.trainer
        # sync_view: with LoRA, base + adapter merged under the base model's names (workers/lora.py).
        return sync_plan(
            sync_view(t.model), engine_dtype=self.cfg.model.dtype, bucket_mb=self.cfg.trainer.sync_bucket_mb, version=t.version
        )

    def _publish(self) -> None:
        """Put this version's buckets into the object store (rank 0; every rank gathers)."""
        source = self._put_buckets(*self._sync_plan())
        if source is not None:
            self._published = (self.policy.version, source)

    def _put_buckets(self, entries, manifest) -> PublishedSource | None:
        """Every bucket of `manifest` into the object store, once the weights are checked
        finite; the source on rank 0, None on the others (they only join the gathers)."""
        check_finite_shards(entries, f"the weights of policy v{self.policy.version} (to be synced)", self.world_size)
        refs: list = []
        put = refs.append if self.rank == 0 and ray.is_initialized() else None
        gather_and_offer(entries, manifest, (lambda b: put(ray.put(b))) if put else None)
        return PublishedSource(manifest, refs) if put else None

    @ray.method(concurrency_group="published")
    def published_weights(self) -> tuple[int, PublishedSource] | None:
        """The latest published (version, its buckets as a weight source), or None."""
        return self._published

    # -- weight sync (weight_sync/transport.py: the driver, and the table of transports) ---

    def send_weights(self, sync_id: str, transport: str, consumers: int) -> StreamReport:
        """Gather the weights bucket by bucket (every rank: the gathers are collectives) and
        send them by `transport` (catalog/weight_transports.py) to the `consumers` rollout
        replicas this rank serves (0: it only joins the gathers). Non-finite weights are
        refused before the first bucket leaves."""
        way = WEIGHT_TRANSPORTS.get(transport)
        relay = way.open_relay(self, consumers) if consumers > 0 else None
        return self._sync_frame(sync_id, relay, lambda entries, manifest: way.send(self, entries, manifest, relay))

    @ray.method(concurrency_group=SYNC_GROUP)
    def sync_manifest(self, sync_id: str):
        return self._relays.get(sync_id).manifest()

    @ray.method(concurrency_group=SYNC_GROUP)
    def sync_take(self, sync_id: str, consumer: int, index: int):
        """Bucket `index` as the transport hands it (an ObjectRef, an IPC handle, a ready
        signal; None past the last); the receiver is done with the ones before it."""
        return self._relays.get(sync_id).take(consumer, index)

    @ray.method(concurrency_group=SYNC_GROUP)
    def sync_leave(self, sync_id: str, consumer: int, error: str | None = None) -> None:
        if error:
            log.warning("weight sync %s: receiver %d stopped: %s", sync_id, consumer, error)
        self._relays.get(sync_id, timeout_s=0).leave(consumer)

    @ray.method(concurrency_group=SYNC_GROUP)
    def sync_abort(self, sync_id: str, reason: str) -> None:
        self._relays.get(sync_id, timeout_s=0).fail(reason)

    def sync_device(self):
        """The device this rank's weights (and so its shared buckets) are on."""
        return next(self.policy.model.parameters()).device

    def _sync_frame(self, sync_id: str, relay: BucketRelay | None, send) -> StreamReport:
        """Plan, check finiteness, then `send(entries, manifest)` -> (bytes, failure): the
        frame every transport shares."""
        t0 = time.perf_counter()
        if relay is not None:
            self._relays.open(sync_id, relay)
        try:
            entries, manifest = self._sync_plan()
            check_finite_shards(entries, f"the weights of policy v{self.policy.version} (to be synced)", self.world_size)
        except Exception as e:
            if relay is not None:
                relay.fail(f"{type(e).__name__}: {e}")
            raise
        if relay is not None:
            relay.start(manifest)
        sent, failure = send(entries, manifest)
        if failure is not None:
            raise failure
        return StreamReport(
            version=manifest.version,
            bytes=sent,
            buckets=len(manifest.buckets),
            seconds=time.perf_counter() - t0,
            window_peak=relay.peak_stored if relay is not None else 0,
        )

    # -- the NCCL transport's engine group (weight_sync/device_sync.py) -------------------

    def engine_group_key(self) -> str | None:
        """The membership this rank's engine group was made for (None: none)."""
        return self.engine_group.key if self.engine_group is not None else None

    def engine_group_address(self) -> tuple[str, int]:
        """(host, port) for the engine group's TCPStore, which rank 0 hosts on its node."""
        host = node_address()
        return host, free_port(host)

    def join_engine_group(self, key: str, host: str, port: int, rank: int, world_size: int) -> str:
        """Rank 0 joins (hosts) the engine group for membership `key`; an older group is
        dropped (a member was recreated)."""
        from .weight_sync.device_sync import join_engine_group

        if self.rank != 0 or rank != 0:
            raise ValueError(f"only trainer rank 0 is member 0 of the engine group (this is rank {self.rank}, asked to be {rank})")
        self.engine_group = None
        self.engine_group = join_engine_group(key, host, port, 0, world_size)
        return key

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
                self._publish()
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

    # A batch handed over in memory (train_handed), kept with the update it went into.
    _handed: tuple[tuple[int, int], HandedStep] | None = None

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
            published = self._one_bucket() if publish else None
        finally:
            for w in writes:
                w.join()
        for w in writes:
            if w.error is not None:
                raise w.error
        return result, step.summary(), published

    def _one_bucket(self) -> PublishedSource | None:
        """The weights as one published bucket (rank 0; every rank gathers), or None when
        they need more than one (`sync_weights` then streams them)."""
        entries, manifest = self._sync_plan()
        if len(manifest.buckets) != 1:
            return None
        return self._put_buckets(entries, manifest)

    # -- checkpoints -----------------------------------------------------------------------

    def start_checkpoint(
        self, step: int, run_state: dict, extra_files: dict[str, bytes] | None = None, foreground: bool = False
    ) -> CheckpointStarted:
        """Snapshot the state (the only stall), then write, export and upload it in the
        background (with `foreground`, before returning; its error, if any, is returned).
        Every rank calls (the snapshot and the write are collectives); rank 0 adds
        `extra_files` (relative path -> bytes: the critic's state) to the checkpoint. The
        caller reads the previous checkpoint's outcome first (`wait_checkpoint`): this
        one replaces it."""
        from .checkpointing import snapshot

        waited = self.wait_checkpoint().seconds  # one checkpoint in flight at a time
        t0 = time.perf_counter()
        name = RunLayout.checkpoint_name(step)
        meta = {"step": step, "policy_version": self.policy.version, "world_size": self.world_size}
        # For the HF export; with LoRA the adapter alone (the base stays where it is: workers/lora.py).
        full = {
            k: v.clone()
            for k, v in (adapter_state(self.policy.model) if getattr(self.trainer, "lora", None) else self.policy.full_state()).items()
        }
        # Every rank holds the full weights here, so every rank refuses alike.
        check_finite_weights(full, f"the weights of policy v{self.policy.version} (checkpoint {name})")
        snap = snapshot(self.policy, meta)
        stall = time.perf_counter() - t0
        self._checkpoint_request = (step, run_state, extra_files or {}, self.policy.version)
        args = (snap, full if self.rank == 0 else None, name, meta, run_state, extra_files or {})
        self._checkpoint_error = None
        if foreground:
            self._write_checkpoint(*args)
        else:
            self._checkpointing = threading.Thread(target=self._write_checkpoint, args=args, daemon=True)
            self._checkpointing.start()
        return CheckpointStarted(
            name=name,
            stall_seconds=stall,
            waited_seconds=waited,
            policy_version=self.policy.version,
            error=self._checkpoint_error if foreground else None,
        )

    def redo_checkpoint(self) -> CheckpointOutcome:
        """Take the latest checkpoint again, in the foreground, if it failed on any rank
        (every rank calls; the write is a collective) and the trainer still holds its
        version. Returns its error (None: committed) and whether a redo was impossible."""
        self.wait_checkpoint()
        if self._checkpoint_request is None:
            return CheckpointOutcome(error=None)
        step, run_state, extra_files, version = self._checkpoint_request
        if self.policy.version != version:
            return CheckpointOutcome(
                error=f"checkpoint {RunLayout.checkpoint_name(step)} failed ({self._checkpoint_error}) and cannot be taken again: "
                f"the trainer has trained on from v{version} to v{self.policy.version}",
                impossible=True,
            )
        return CheckpointOutcome(error=self.start_checkpoint(step, run_state, extra_files, foreground=True).error)

    def _write_checkpoint(self, snap, full_state, name: str, meta: dict, run_state: dict, extra_files: dict[str, bytes]) -> None:
        """Every rank writes its shard into a staging folder of its own (on its own node)
        and uploads it; rank 0 also writes the meta file, the Hugging Face export, the run
        state and `extra_files`. Once every rank's upload is done (the ranks tell each
        other, a collective), rank 0 commits the manifest listing every rank's files. No
        rank needs another's disk. A failure on any rank before that is kept on every rank
        (whichever rank is asked reports it) and nothing is committed; a failed commit is
        kept on rank 0."""
        from .checkpointing import all_ranks, write_snapshot

        local = staging_dir(self._run_id, name, self.rank)
        ckpts = CheckpointStore(self.run)
        failure: list[str] = []  # this rank's first failure

        def attempt(what, *, collective: bool = False):
            # A local step is skipped after a failure; a collective is taken part in even
            # then, or the other ranks would wait in it for ever.
            if failure and not collective:
                return None
            try:
                return what()
            except Exception as e:  # noqa: BLE001 - kept, and reported by the next wait_checkpoint
                log.exception("checkpoint %s failed on trainer rank %d", name, self.rank)
                failure.append(f"checkpoint {name} failed on trainer rank {self.rank}: {type(e).__name__}: {e}")
                return None

        try:
            # Rank 0 picks where this attempt writes (a committed checkpoint of this name,
            # from an earlier try, stays whole until the new manifest replaces it), and
            # every rank learns it before uploading a byte.
            begun = attempt(lambda: ckpts.begin(name)) if self.rank == 0 else None
            attempt(lambda: write_snapshot(snap, local / RunLayout.TRAINER_STATE), collective=True)
            if self.rank == 0:
                attempt(lambda: self._write_rank0_files(local, full_state, run_state, extra_files))
            told = attempt(lambda: all_ranks(begun, snap.world_size, snap.process_group), collective=True)
            folder = told[0] if told else None  # None: rank 0 failed to begin, and reports it
            files = (attempt(lambda: ckpts.upload(name, local, folder)) if folder is not None else None) or {}
            outcomes = attempt(
                lambda: all_ranks((failure[0] if failure else None, files), snap.world_size, snap.process_group), collective=True
            )
            if outcomes is None:  # the exchange itself failed: the ranks cannot agree on anything
                self._checkpoint_error = "; ".join(failure)
                return
            errors = list(dict.fromkeys(e for e, _ in outcomes if e))
            if errors:
                self._checkpoint_error = "; ".join(errors)
                return
            if self.rank == 0:
                attempt(lambda: self._seal(ckpts, name, [f for _, f in outcomes], meta, folder or ""))
                self._checkpoint_error = failure[0] if failure else None
        finally:
            shutil.rmtree(local, ignore_errors=True)
            try:
                local.parent.rmdir()  # the checkpoint's folder, once no rank of this node has one in it
            except OSError:
                pass

    @property
    def _run_id(self) -> str:
        return self.run.root.rpartition("/")[2]

    def _write_rank0_files(self, local: Path, full_state: dict, run_state: dict, extra_files: dict[str, bytes]) -> None:
        if getattr(self.trainer, "lora", None) is not None:  # peft's adapter folder, naming the base it needs
            write_adapter_folder(self.policy.model, full_state, local / RunLayout.CHECKPOINT_HF)
        else:
            self._write_hf(full_state, local / RunLayout.CHECKPOINT_HF)  # committed by the checkpoint's manifest
        (local / RunLayout.RUN_STATE).write_text(json.dumps(run_state, sort_keys=True))
        for rel, data in extra_files.items():
            (local / rel).parent.mkdir(parents=True, exist_ok=True)
            (local / rel).write_bytes(data)

    def _seal(self, ckpts: CheckpointStore, name: str, uploads: list[dict], meta: dict, folder: str) -> None:
        """Rank 0: the manifest over every rank's uploaded files (a name uploaded by two
        ranks would be a bug: refused; stored bytes other than those sent: SealMismatch,
        nothing committed, and the checkpoint is taken again), then retention, whose
        errors are warnings: the checkpoint is committed whatever retention does."""
        files: dict = {}
        for rank, uploaded in enumerate(uploads):
            twice = sorted(set(files) & set(uploaded))
            if twice:
                raise RuntimeError(f"checkpoint {name}: trainer rank {rank} uploaded files another rank did too: {twice[:3]}")
            files.update(uploaded)
        ckpts.seal(name, files, meta, folder)
        c = self.cfg.checkpoint
        try:
            ckpts.apply_retention(keep_last=c.keep_last, keep_every=c.keep_every)
        except Exception as e:  # noqa: BLE001 - housekeeping; the next checkpoint's retention tries again
            log.warning("checkpoint %s is committed; retention of older checkpoints failed: %s: %s", name, type(e).__name__, e)

    def _write_hf(self, state: dict, out: Path) -> None:
        """The policy with weights `state` as a Hugging Face folder (safetensors) in `out`,
        loadable by from_pretrained and vLLM: the one export, for checkpoints and `export`."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # One at a time per process: the background checkpoint thread and `export` may both
        # get here, and from_pretrained's empty-weights init is process-wide state (a model
        # built while another thread is inside it can keep meta tensors).
        with _HF_BUILD_LOCK:
            model = AutoModelForCausalLM.from_pretrained(self.policy_path)
            model.load_state_dict(state, strict=False)
            write_hf_folder(model, AutoTokenizer.from_pretrained(self.policy_path), out)

    def wait_checkpoint(self) -> CheckpointOutcome:
        """Wait for the checkpoint in flight (if any) to be committed; the latest
        checkpoint's error, if it failed (it stays until another checkpoint is taken)."""
        t0 = time.perf_counter()
        if self._checkpointing is not None:
            self._checkpointing.join()
            self._checkpointing = None
        return CheckpointOutcome(error=self._checkpoint_error, seconds=time.perf_counter() - t0)

    def restore_from_store(self, name: str) -> StoreRestore:
        """Load checkpoint `name`'s trainer state from the run's object store (every rank
        calls; a collective). Each rank downloads the checkpoint's `trainer/` files (every
        rank's shards: a load may reshard, and reads them all) into a private folder on
        its own node, checked against the manifest, loads and removes it: nothing on the
        disk of the node that wrote the checkpoint, or of the caller, is needed.

        If any rank found a file that does not match the manifest, no rank loads and every
        rank returns the problems (the caller tries an older checkpoint). Any other
        failure of a rank fails the call on every rank."""
        from ratchet.storage import CorruptCheckpoint

        from .checkpointing import StoreRestore, all_ranks

        self.wait_checkpoint()  # its collectives run on the group the restore uses
        folder = restore_dir(self._run_id)
        try:
            problems: list[str] = []
            failed: BaseException | None = None
            try:
                CheckpointStore(self.run).download(name, folder, under=RunLayout.TRAINER_STATE)
            except CorruptCheckpoint as e:
                problems = [f"{p} (trainer rank {self.rank})" for p in e.problems]
            except Exception as e:  # noqa: BLE001 - told to the other ranks, then raised
                failed = e
            told = f"{type(failed).__name__}: {failed}" if failed is not None else None
            outcomes = all_ranks((problems, told), self.world_size)
            if failed is not None:
                raise failed
            others = [f"trainer rank {r}: {t}" for r, (_, t) in enumerate(outcomes) if t]
            if others:
                raise RuntimeError(f"restoring checkpoint {name} failed on {'; '.join(others)}")
            found = [p for ps, _ in outcomes for p in ps]
            if found:
                return StoreRestore(name, None, tuple(found))
            return StoreRestore(name, self.restore(str(folder)))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def restore(self, local_dir: str) -> int:
        """Load a downloaded checkpoint's trainer state (any world size; every rank calls, a
        collective); the version it holds. `local_dir` must be on this rank's node and hold
        every rank's files: `restore_from_store` is the way for ranks on several nodes."""
        from .checkpointing import load_trainer_state

        load_trainer_state(self.policy, Path(local_dir) / RunLayout.TRAINER_STATE)
        self._last = None  # a retry cache of the replaced state must not answer for the new one
        self._published = None
        return self.policy.version

    def export(self, key: str) -> str | None:
        """Save the policy in Hugging Face format under the run folder, its manifest last
        (every rank calls: unsharding is a collective; rank 0 writes)."""
        state = self.policy.full_state()
        check_finite_weights(state, f"the weights of policy v{self.policy.version} (export to {key})")
        if self.rank != 0:
            return None
        with tempfile.TemporaryDirectory(prefix="ratchet-hf-") as tmp:
            self._write_hf(state, Path(tmp))
            return upload_hf_folder(Path(tmp), self.run, key)
