"""Every key of a run folder, in one place: who writes it and who reads it.

A run lives in `<storage.root>/<run_id>/`; the keys below are relative to that folder and
are exactly the keys older ratchet versions wrote, so old run folders still read. Code
that reads or writes a run folder takes its keys from `RunLayout`, never from a literal;
`tests/unit/test_layout.py` pins every key to its string. The table in
`docs/architecture.md` ("Run folder") is this module in prose.

Stdlib only: the client and the CLI import it without torch or the storage clients.
"""

from __future__ import annotations

import numbers
from typing import Final


def _number(value: object, what: str) -> int:
    """A step or version as an int (numpy ints too); bools and negatives are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")
    return int(value)


class RunLayout:
    """The keys of a run folder. Not instantiated: constants and pure key builders."""

    # Where run folders live when no storage.root is given (Client.resume, `ratchet checkpoints --root`).
    DEFAULT_ROOT: Final = ".ratchet/runs"

    # -- the run ------------------------------------------------------------------------
    # activities.prepare_run writes the validated config; every activity (activities/run_config.py) and Client.resume read it.
    CONFIG: Final = "config.json"
    # activities.prepare_run writes where the run comes from (a fork's parent, a sweep trial);
    # a registry rebuilt from the store reads it.
    LINEAGE: Final = "lineage.json"
    # activities.record_step writes one line per step (MetricsLog); users, dashboards and `ratchet watch` read it.
    METRICS: Final = "metrics.jsonl"
    # ratchet.tracking writes which MLflow run / wandb id holds this run and the last step each
    # has; a later worker (a resume, a recovery) continues the same tracker runs from it.
    TRACKING: Final = "tracking.json"

    # -- batches (BatchStore kinds; a batch's parts are `<kind>/step-NNNNNN/<part>.safetensors`,
    # NNNNNN the batch index: not the training step once fully_async drops a batch) --
    # RolloutWorker writes rollout parts, RewardWorker scores, TrainerWorker advantages, CriticWorker
    # values; the reward, trainer and critic workers (and recovery, to rebuild state) read them.
    BATCHES: Final = "batches"
    # RolloutWorker.generate_eval writes greedy eval batches; RewardWorker scores them (activity evaluate).
    EVALS: Final = "evals"

    # -- the policy's history -----------------------------------------------------------
    # TrainerWorker.train writes one record per update; workers/actors/recovery.py reads them to rebuild state.
    TRAIN_LOG: Final = "train_log"
    # RolloutWorker writes the weights it is sent (deterministic runs, last few kept) and reads them back.
    POLICY_LOG: Final = "policy_log"

    # -- models (Hugging Face folders, committed by MODEL_MANIFEST written last) ---------
    # workers/warmup.py writes the warmed-up policy; RunActors.initial_policy names it to every worker.
    WARMUP_MODEL: Final = "warmup/model"
    # workers/warmup.py writes the warm-up's first and last loss; a retried warm-up reads them back.
    WARMUP_LOSSES: Final = "warmup/losses.json"
    # activities.finish_run has trainer rank 0 export it (checkpoint.export_final); users read it.
    FINAL_MODEL: Final = "final/model"
    # workers/hf_io.save_hf writes it last in every model folder; hf_io.local_hf_path reads it.
    MODEL_MANIFEST: Final = "manifest.json"

    # -- checkpoints (`checkpoints/<name>/...`, committed by CHECKPOINT_MANIFEST written last) --
    # Every trainer rank uploads its files (CheckpointStore.upload), rank 0 seals them; recovery, Client.resume and `ratchet checkpoints` read.
    CHECKPOINTS: Final = "checkpoints"
    # CheckpointStore.commit writes it last; every reader of a checkpoint reads it first.
    CHECKPOINT_MANIFEST: Final = "MANIFEST.json"
    # CheckpointStore.retire moves a manifest here (Client.resume retires newer checkpoints); nothing reads it back.
    CHECKPOINT_RETIRED: Final = "RETIRED.json"
    # Inside a checkpoint. TrainerWorker writes the workflow's run state; Client.resume reads it.
    RUN_STATE: Final = "run_state.json"
    # Inside a checkpoint. Every trainer rank writes its sharded state (workers/checkpointing.py); TrainerWorker.restore_from_store reads it.
    TRAINER_STATE: Final = "trainer"
    # Inside TRAINER_STATE. workers/checkpointing.write_snapshot writes it; load_trainer_state reads it.
    TRAINER_META: Final = "trainer_meta.json"
    # Inside a checkpoint. TrainerWorker rank 0 exports the policy (Hugging Face format, no manifest); users read it.
    CHECKPOINT_HF: Final = "hf"
    # Inside a checkpoint. CriticWorker.state_files makes them, rank 0 writes them; recovery reads them back.
    CRITIC_STATE: Final = "critic/critic.safetensors"
    CRITIC_META: Final = "critic/critic.json"

    # -- key builders -------------------------------------------------------------------

    @staticmethod
    def batch_step(kind: str, batch_index: int) -> str:
        """`batches/step-000012`: batch 12's folder in the batch store of `kind` (evals are
        stored by the training step they evaluate)."""
        return f"{kind}/step-{_number(batch_index, 'batch index'):06d}"

    @staticmethod
    def batch_part(kind: str, batch_index: int, part: str) -> str:
        """`batches/step-000012/rollout.safetensors`: one part of a stored batch."""
        return f"{RunLayout.batch_step(kind, batch_index)}/{part}.safetensors"

    @staticmethod
    def train_log(policy_version: int) -> str:
        """`train_log/v00000003.json`: the record of the update that turned policy
        v`policy_version` into the next one."""
        return f"{RunLayout.TRAIN_LOG}/v{_number(policy_version, 'policy version'):08d}.json"

    @staticmethod
    def policy_log(version: int) -> str:
        """`policy_log/v00000003.safetensors`: the weights of policy v`version`."""
        return f"{RunLayout.POLICY_LOG}/v{_number(version, 'policy version'):08d}.safetensors"

    @staticmethod
    def policy_log_version(key: str) -> int:
        """The version a `policy_log(version)` key names."""
        return int(key.rsplit("/", 1)[-1][1:].split(".", 1)[0])

    @staticmethod
    def checkpoint_name(step: int) -> str:
        """`step-00000012`: the checkpoint the trainer takes after workflow step `step`."""
        return f"step-{_number(step, 'checkpoint step'):08d}"

    @staticmethod
    def checkpoint(name: str, rel: str = "") -> str:
        """`checkpoints/<name>` or, with `rel`, a file in it (`checkpoints/<name>/run_state.json`)."""
        return f"{RunLayout.CHECKPOINTS}/{name}/{rel}" if rel else f"{RunLayout.CHECKPOINTS}/{name}"


__all__ = ["RunLayout"]
