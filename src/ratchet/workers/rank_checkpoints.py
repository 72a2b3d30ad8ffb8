"""One trainer rank's side of checkpoints, restores and the export: a snapshot of the state
(the only stall of training), then in the background every rank writes its shard
(torch.distributed.checkpoint) into a folder of its own and uploads it; rank 0 also writes
the policy in Hugging Face format, the run state and extra files (the critic's), and
commits the manifest last once every rank's upload is done (storage/checkpoint_store.py).
A restore has every rank fetch the state from the object store itself, so no rank needs a
disk shared with another, or with the node that wrote the checkpoint. `TrainerWorker`
holds one per rank."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ratchet.storage.checkpoint_store import CheckpointStore
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout

from .hf_io import upload_hf_folder, write_hf_folder
from .local_paths import restore_dir, staging_dir
from .lora import adapter_state, write_adapter_folder
from .policy_update import check_finite_weights
from .results import CheckpointOutcome, CheckpointStarted

if TYPE_CHECKING:
    from ratchet.config.schema import RunConfig

    from .checkpointing import StoreRestore
    from .policy_update import PolicyTrainer

log = logging.getLogger(__name__)
# Building a Hugging Face model for an export: one thread of the process at a time (_write_hf).
_HF_BUILD_LOCK = threading.Lock()


class RankCheckpoints:
    def __init__(
        self, cfg: RunConfig, rank: int, world_size: int, run: ObjectStore, policy: Callable[[], PolicyTrainer],
        policy_path: Callable[[], str], load: Callable[[str], int],
    ):  # fmt: skip
        """`policy`, `policy_path`: the rank's policy trainer and its local model folder (once
        set up); `load`: the rank's load of a downloaded checkpoint (`TrainerWorker.restore`)."""
        self.cfg, self.rank, self.world_size, self.run = cfg, rank, world_size, run
        self._policy, self._policy_path, self._load = policy, policy_path, load
        self._writing: threading.Thread | None = None  # the background write and upload
        # The outcome of the latest checkpoint (None: committed or none yet), kept until a
        # later checkpoint replaces it, so a failed upload is always reported.
        self._error: str | None = None
        self._request: tuple | None = None  # (step, run_state, extra files, version) of the latest

    @property
    def _run_id(self) -> str:
        return self.run.root.rpartition("/")[2]

    def _uses_lora(self) -> bool:
        return getattr(self._policy(), "lora", None) is not None

    def start(self, step: int, run_state: dict, extra_files: dict[str, bytes] | None = None, foreground: bool = False) -> CheckpointStarted:
        """Snapshot the state (the only stall), then write, export and upload it in the
        background (with `foreground`, before returning; its error, if any, is returned).
        Every rank calls (the snapshot and the write are collectives); rank 0 adds
        `extra_files` (relative path -> bytes: the critic's state) to the checkpoint. The
        caller reads the previous checkpoint's outcome first (`wait`): this one replaces it."""
        from .checkpointing import snapshot

        policy = self._policy()
        waited = self.wait().seconds  # one checkpoint in flight at a time
        t0 = time.perf_counter()
        name = RunLayout.checkpoint_name(step)
        meta = {"step": step, "policy_version": policy.version, "world_size": self.world_size}
        # For the HF export; with LoRA the adapter alone (the base stays where it is: workers/lora.py).
        full = {k: v.clone() for k, v in (adapter_state(policy.model) if self._uses_lora() else policy.full_state()).items()}
        # Every rank holds the full weights here, so every rank refuses alike.
        check_finite_weights(full, f"the weights of policy v{policy.version} (checkpoint {name})")
        snap = snapshot(policy, meta)
        stall = time.perf_counter() - t0
        self._request = (step, run_state, extra_files or {}, policy.version)
        args = (snap, full if self.rank == 0 else None, name, meta, run_state, extra_files or {})
        self._error = None
        if foreground:
            self._write(*args)
        else:
            self._writing = threading.Thread(target=self._write, args=args, daemon=True)
            self._writing.start()
        return CheckpointStarted(
            name=name, stall_seconds=stall, waited_seconds=waited, policy_version=policy.version,
            error=self._error if foreground else None,
        )  # fmt: skip

    def redo(self) -> CheckpointOutcome:
        """Take the latest checkpoint again, in the foreground, if it failed on any rank
        (every rank calls; the write is a collective) and the trainer still holds its
        version. Returns its error (None: committed) and whether a redo was impossible."""
        self.wait()
        if self._request is None:
            return CheckpointOutcome(error=None)
        step, run_state, extra_files, version = self._request
        holds = self._policy().version
        if holds != version:
            return CheckpointOutcome(
                error=f"checkpoint {RunLayout.checkpoint_name(step)} failed ({self._error}) and cannot be taken again: "
                f"the trainer has trained on from v{version} to v{holds}",
                impossible=True,
            )
        return CheckpointOutcome(error=self.start(step, run_state, extra_files, foreground=True).error)

    def wait(self) -> CheckpointOutcome:
        """Wait for the checkpoint in flight (if any) to be committed; the latest
        checkpoint's error, if it failed (it stays until another checkpoint is taken)."""
        t0 = time.perf_counter()
        if self._writing is not None:
            self._writing.join()
            self._writing = None
        return CheckpointOutcome(error=self._error, seconds=time.perf_counter() - t0)

    def _write(self, snap, full_state, name: str, meta: dict, run_state: dict, extra_files: dict[str, bytes]) -> None:
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
            except Exception as e:  # noqa: BLE001 - kept, and reported by the next wait
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
                self._error = "; ".join(failure)
                return
            errors = list(dict.fromkeys(e for e, _ in outcomes if e))
            if errors:
                self._error = "; ".join(errors)
                return
            if self.rank == 0:
                attempt(lambda: self._seal(ckpts, name, [f for _, f in outcomes], meta, folder or ""))
                self._error = failure[0] if failure else None
        finally:
            shutil.rmtree(local, ignore_errors=True)
            try:
                local.parent.rmdir()  # the checkpoint's folder, once no rank of this node has one in it
            except OSError:
                pass

    def _write_rank0_files(self, local: Path, full_state: dict, run_state: dict, extra_files: dict[str, bytes]) -> None:
        if self._uses_lora():  # peft's adapter folder, naming the base it needs
            write_adapter_folder(self._policy().model, full_state, local / RunLayout.CHECKPOINT_HF)
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
            model = AutoModelForCausalLM.from_pretrained(self._policy_path())
            model.load_state_dict(state, strict=False)
            write_hf_folder(model, AutoTokenizer.from_pretrained(self._policy_path()), out)

    def restore_from_store(self, name: str) -> StoreRestore:
        """Load checkpoint `name`'s trainer state from the run's object store (every rank
        calls; a collective). Each rank downloads the checkpoint's `trainer/` files (every
        rank's shards: a load may reshard, and reads them all) into a private folder on
        its own node, checked against the manifest, loads and removes it: nothing on the
        disk of the node that wrote the checkpoint, or of the caller, is needed.

        If any rank found a file that does not match the manifest, no rank loads and every
        rank returns the problems (the caller tries an older checkpoint). Any other
        failure of a rank fails the call on every rank."""
        from ratchet.storage.checkpoint_store import CorruptCheckpoint

        from .checkpointing import StoreRestore, all_ranks

        self.wait()  # its collectives run on the group the restore uses
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
            return StoreRestore(name, self._load(str(folder)))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def export(self, key: str) -> str | None:
        """Save the policy in Hugging Face format under the run folder, its manifest last
        (every rank calls: unsharding is a collective; rank 0 writes)."""
        policy = self._policy()
        state = policy.full_state()
        check_finite_weights(state, f"the weights of policy v{policy.version} (export to {key})")
        if self.rank != 0:
            return None
        with tempfile.TemporaryDirectory(prefix="ratchet-hf-") as tmp:
            self._write_hf(state, Path(tmp))
            return upload_hf_folder(Path(tmp), self.run, key)
