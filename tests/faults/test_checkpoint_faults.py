"""Runs that lose a checkpoint, a torn metrics file, a leaked temp file (issue 28, part E).

Before:
- a retry of checkpoint N deleted N's committed manifest before writing a byte, and a
  retention error counted as a checkpoint failure (so N was taken again): a retention
  error and then a full disk left no checkpoint at all;
- `seal` committed whatever was stored, also bytes that changed after their upload (the
  newest checkpoint then failed verification on use), and a checkpoint folder holding
  only an hour-old `.tmp-` file survived retention;
- one torn line in a run's `metrics.jsonl` aborted `ratchet registry rebuild` (and every
  reader of the file, and the next write to it);
- a weight stream that ended short left the policy log's temp folder behind, and an
  engine that took the partial stream served the version with no log of it.

Real storage throughout: a local folder, and the moto S3 server where the store's layout
matters; the trainer and rollout workers in-process with the tiny model.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ratchet.storage.checkpoint_store import CheckpointStore, SealMismatch
from ratchet.storage.metrics_log import MetricsLog
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout
from ratchet.storage.checkpoint_store import FORMAT, MANIFEST, SEAL_TRIES
from tests.s3_server import moto_server, s3_env, store_url  # noqa: F401

from .test_worker_faults import stored_step, trainer_worker

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled, )?unavailable or uninitialized")


@pytest.fixture(params=["file", "s3"])
def ckpts(request, tmp_path) -> CheckpointStore:
    env = request.getfixturevalue("s3_env") if request.param != "file" else None
    store = ObjectStore(store_url(request.param, tmp_path, env), retry_timeout_s=5, retry_initial_s=0.05, retry_max_s=0.2)
    return CheckpointStore(store)


def local_checkpoint(root: Path, step: int, tag: str = "") -> Path:
    (root / "trainer").mkdir(parents=True, exist_ok=True)
    (root / "trainer" / "shard-1.safetensors").write_bytes(bytes([step]) * 4096 + tag.encode())
    (root / RunLayout.RUN_STATE).write_text(json.dumps({"next_step": step, "tag": tag}))
    return root


def tamper_after_upload(monkeypatch, suffix: str, times: int) -> list[str]:
    """The first `times` uploads of each key ending in `suffix` are changed in storage
    right after they were written (same size, other bytes): what a faulty disk, a stray
    writer or a broken gateway does between the upload and the seal. Returns the keys
    uploaded, in order."""
    real = ObjectStore.put_file
    uploaded: list[str] = []

    def put_file(self, key, path):
        out = real(self, key, path)
        uploaded.append(key)
        if key.endswith(suffix) and uploaded.count(key) <= times:
            data = self.get_bytes(key)
            self.put_bytes(key, bytes([data[0] ^ 0xFF]) + data[1:])
        return out

    monkeypatch.setattr(ObjectStore, "put_file", put_file)
    return uploaded


# --------------------------------------------------------------------------- a retry keeps the committed checkpoint


def test_a_retry_never_unmakes_the_committed_checkpoint(ckpts, tmp_path, monkeypatch):
    """A retry of step 1 writes a fresh attempt beside the committed one; when it fails
    (full disk) the committed checkpoint is still the newest good one, and when it
    succeeds its manifest replaces the old one and the old files go."""
    first = ckpts.commit("step-00000001", local_checkpoint(tmp_path / "a", 1, "first"), {"step": 1})
    assert first.attempt == ""  # a first attempt keeps the layout every ratchet reads

    def full_disk(key, path):
        if "attempt-" in key:  # the retry's files
            raise OSError(errno.ENOSPC, "No space left on device")
        raise AssertionError(f"a retry wrote {key} outside its attempt folder")

    monkeypatch.setattr(ckpts.store, "put_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        ckpts.commit("step-00000001", local_checkpoint(tmp_path / "b", 1, "retry"), {"step": 1})
    monkeypatch.undo()
    latest = ckpts.latest()
    assert latest is not None and latest.name == "step-00000001" and latest.attempt == ""
    assert ckpts.read_files("step-00000001", [RunLayout.RUN_STATE])[RunLayout.RUN_STATE] == b'{"next_step": 1, "tag": "first"}'

    second = ckpts.commit("step-00000001", local_checkpoint(tmp_path / "c", 1, "second"), {"step": 1})
    assert second.attempt == "attempt-1" and ckpts.list() == [second] and ckpts.verify("step-00000001")
    assert ckpts.store.get_json(f"checkpoints/step-00000001/{MANIFEST}")["format"] == "ratchet-checkpoint/2"
    assert sorted(ckpts.store.list("checkpoints")) == [
        f"checkpoints/step-00000001/{MANIFEST}",
        f"checkpoints/step-00000001/{second.attempt}/{RunLayout.RUN_STATE}",
        f"checkpoints/step-00000001/{second.attempt}/trainer/shard-1.safetensors",
    ]
    # Every reader takes the files from where the manifest says: download, read_files, newest_good.
    back = ckpts.download("step-00000001", tmp_path / "back", under=RunLayout.TRAINER_STATE)
    assert back == second and (tmp_path / "back" / "trainer" / "shard-1.safetensors").read_bytes().endswith(b"second")
    got = ckpts.newest_good(lambda info: ckpts.read_files(info.name, [RunLayout.RUN_STATE]))
    assert got is not None and json.loads(got[1][RunLayout.RUN_STATE])["tag"] == "second"
    # A third attempt replaces the second the same way, in the other folder (the keys are
    # the step's and the slot's: a retried retry overwrites its own files, rule 2).
    third = ckpts.commit("step-00000001", local_checkpoint(tmp_path / "d", 1, "third"), {"step": 1})
    assert third.attempt == "attempt-2" and not ckpts.store.list(f"checkpoints/step-00000001/{second.attempt}")
    assert ckpts.verify("step-00000001")


def test_retention_errors_are_warnings(ckpts, tmp_path, monkeypatch, caplog):
    for step in (1, 2):
        ckpts.commit(f"step-{step:08d}", local_checkpoint(tmp_path / f"c{step}", step), {"step": step})

    def denied(key):
        raise PermissionError(f"{key}: access denied")

    monkeypatch.setattr(ckpts.store, "delete", denied)
    with caplog.at_level(logging.WARNING, logger="ratchet.storage.checkpoint_store"):
        assert ckpts.apply_retention(keep_last=1, keep_every=0) == []  # no error: a warning, and nothing deleted
    assert "deleting checkpoint step-00000001 failed (PermissionError" in caplog.text and "access denied" in caplog.text
    monkeypatch.undo()
    assert ckpts.apply_retention(keep_last=1, keep_every=0) == ["step-00000001"]  # the next retention does it


def test_retention_removes_an_attempt_that_never_sealed(tmp_path):
    """A retry of step 1 uploaded into its attempt folder and died before the seal: the
    folder is removed once a newer manifest exists (as an uncommitted upload is), and the
    committed step 1 stays whole."""
    ckpts = CheckpointStore(ObjectStore(str(tmp_path / "run")))
    ckpts.commit("step-00000001", local_checkpoint(tmp_path / "c1", 1), {"step": 1})
    attempt = ckpts.begin("step-00000001")
    ckpts.upload("step-00000001", local_checkpoint(tmp_path / "r", 1, "never sealed"), attempt)
    hour_ago = time.time() - 3600
    for path in (tmp_path / "run" / "checkpoints" / "step-00000001" / attempt).rglob("*"):
        os.utime(path, (hour_ago, hour_ago))  # written before the next checkpoint's manifest
    ckpts.commit("step-00000002", local_checkpoint(tmp_path / "c2", 2), {"step": 2})
    assert ckpts.apply_retention(keep_last=2, keep_every=0) == [f"step-00000001/{attempt}"]
    assert [c.name for c in ckpts.list()] == ["step-00000001", "step-00000002"] and ckpts.verify("step-00000001")
    assert not ckpts.store.list(f"checkpoints/step-00000001/{attempt}")


def test_retention_removes_a_folder_left_holding_an_old_tmp_file(tmp_path):
    """A killed upload left `checkpoints/step-00000002/` holding one `.tmp-` file an hour
    old: retention removes the file and the folder; a fresh one (a write in flight) stays."""
    ckpts = CheckpointStore(ObjectStore(str(tmp_path / "run")))
    ckpts.commit("step-00000001", local_checkpoint(tmp_path / "c1", 1), {"step": 1})
    root = tmp_path / "run" / "checkpoints"
    for name, age in (("step-00000002", 3700), ("step-00000003", 10)):
        tmp = root / name / "trainer" / "shard-1.safetensors.tmp-0123abcd"
        tmp.parent.mkdir(parents=True)
        tmp.write_bytes(b"half")
        os.utime(tmp, (time.time() - age, time.time() - age))
    deleted = ckpts.apply_retention(keep_last=1, keep_every=0)
    assert deleted == ["checkpoints/step-00000002/trainer/shard-1.safetensors.tmp-0123abcd", "step-00000002"]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000003"]
    assert (root / "step-00000003" / "trainer" / "shard-1.safetensors.tmp-0123abcd").exists()


# --------------------------------------------------------------------------- the seal checks what was written


def test_seal_refuses_bytes_changed_after_their_upload(ckpts, tmp_path, monkeypatch):
    ckpts.commit("step-00000001", local_checkpoint(tmp_path / "a", 1), {"step": 1})
    attempt = ckpts.begin("step-00000002")
    files = ckpts.upload("step-00000002", local_checkpoint(tmp_path / "b", 2), attempt)
    key = "checkpoints/step-00000002/trainer/shard-1.safetensors"
    data = ckpts.store.get_bytes(key)
    ckpts.store.put_bytes(key, b"\0" + data[1:])  # changed after the upload, before the seal
    with pytest.raises(SealMismatch, match=r"not committed: .*trainer/shard-1.safetensors: sha256") as caught:
        ckpts.seal("step-00000002", files, {"step": 2}, attempt)
    assert caught.value.rels == ["trainer/shard-1.safetensors"]
    assert [c.name for c in ckpts.list()] == ["step-00000001"] and ckpts.latest().name == "step-00000001"


def test_commit_uploads_changed_bytes_again_and_gives_up_after_a_bound(ckpts, tmp_path, monkeypatch):
    uploaded = tamper_after_upload(monkeypatch, "shard-1.safetensors", times=1)
    info = ckpts.commit("step-00000001", local_checkpoint(tmp_path / "a", 1), {"step": 1})
    assert ckpts.verify(info.name)  # the second upload of the changed file is what is committed
    assert [k.rsplit("/", 1)[1] for k in uploaded] == [RunLayout.RUN_STATE, "shard-1.safetensors", "shard-1.safetensors"]

    monkeypatch.undo()
    uploaded = tamper_after_upload(monkeypatch, "shard-1.safetensors", times=99)
    with pytest.raises(SealMismatch, match="step-00000002' not committed"):
        ckpts.commit("step-00000002", local_checkpoint(tmp_path / "b", 2), {"step": 2})
    assert sum(k.endswith("shard-1.safetensors") for k in uploaded) == SEAL_TRIES
    assert [c.name for c in ckpts.list()] == ["step-00000001"]


def test_manifest_attempt_cannot_point_outside_the_checkpoint(ckpts, tmp_path):
    """The attempt folder comes from the manifest: one that could leave the checkpoint's
    folder makes the checkpoint corrupt, not a path."""
    ckpts.commit("step-00000001", local_checkpoint(tmp_path / "a", 1), {"step": 1})
    info = ckpts.commit("step-00000002", local_checkpoint(tmp_path / "b", 2), {"step": 2})
    key = f"checkpoints/{info.name}/{MANIFEST}"
    manifest = ckpts.store.get_json(key)
    for bad in ("../step-00000001", "attempt-x/../..", "trainer"):
        ckpts.store.put_json(key, {**manifest, "format": "ratchet-checkpoint/2", "attempt": bad})
        assert any("attempt" in p for p in ckpts.problems(info.name))
        assert ckpts.latest().name == "step-00000001"
    assert FORMAT == "ratchet-checkpoint/1"  # what a first attempt still writes: older ratchet reads it


# --------------------------------------------------------------------------- the trainer's checkpoint path


def test_trainer_checkpoint_survives_a_retention_error_then_a_full_disk(tiny_model, tmp_path, monkeypatch, caplog):
    """The product's path (TrainerWorker.start_checkpoint, as the checkpoint activity and
    its Temporal retries call it): a retention error leaves the checkpoint committed and
    reported good; the activity's retry of the same step on a full disk fails and leaves
    it in place; a retry with space commits a fresh attempt that a restore reads."""
    run = ObjectStore(str(tmp_path / "run"))
    stored_step(run)
    worker = trainer_worker(tiny_model, run)
    worker.train(0, 0, 0.0)
    ckpts = CheckpointStore(run)

    def listing_denied(self, *args, **kwargs):
        raise PermissionError("listing checkpoints/ for leftovers: access denied")

    monkeypatch.setattr(ObjectStore, "clean_leftovers", listing_denied)
    with caplog.at_level(logging.WARNING):
        assert worker.start_checkpoint(1, {"next_step": 1}, foreground=True).error is None
    assert worker.wait_checkpoint().error is None  # what the next checkpoint activity asks: nothing to redo
    assert "access denied" in caplog.text
    assert [c.name for c in ckpts.list()] == ["step-00000001"]

    def full_disk(self, key, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ObjectStore, "put_file", full_disk)
    again = worker.start_checkpoint(1, {"next_step": 1}, foreground=True)
    assert again.error and "No space left on device" in again.error
    monkeypatch.undo()
    latest = ckpts.latest()
    assert latest is not None and latest.name == "step-00000001" and latest.attempt == ""

    # Bytes that change between their upload and the seal: not committed, reported.
    tamper_after_upload(monkeypatch, RunLayout.RUN_STATE, times=1)
    changed = worker.start_checkpoint(1, {"next_step": 1}, foreground=True)
    assert changed.error and "not committed" in changed.error and RunLayout.RUN_STATE in changed.error
    monkeypatch.undo()
    assert ckpts.latest() == latest

    retried = worker.start_checkpoint(1, {"next_step": 1}, foreground=True)
    assert retried.error is None
    newest = ckpts.latest()
    assert newest.attempt.startswith("attempt-") and newest.meta["policy_version"] == 1
    assert worker.restore_from_store(newest.name).version == 1


# --------------------------------------------------------------------------- torn metrics.jsonl


TORN = b'{"step": 1, "reward_mea'


def test_a_torn_metrics_line_is_skipped_by_readers_and_kept_by_writers(tmp_path, caplog):
    run = ObjectStore(str(tmp_path / "run"))
    log = MetricsLog(run)
    log.write(0, {"reward_mean": 0.1})
    run.put_bytes(RunLayout.METRICS, run.get_bytes(RunLayout.METRICS) + TORN)  # a writer died mid-line
    with caplog.at_level(logging.WARNING, logger="ratchet.storage.metrics_log"):
        assert [r["step"] for r in log.read()] == [0]
    assert f"{RunLayout.METRICS}: skipped 1 unreadable lines" in caplog.text and "line 2" in caplog.text
    log.write(1, {"reward_mean": 0.2})  # the retried step's line: written, the torn one kept
    log.write(2, {"reward_mean": 0.3})
    assert [(r["step"], r["reward_mean"]) for r in log.read()] == [(0, 0.1), (1, 0.2), (2, 0.3)]
    assert TORN in run.get_bytes(RunLayout.METRICS)
    checked = log.read_checked()
    assert len(checked.records) == 3 and len(checked.skipped) == 1


def test_registry_rebuild_skips_torn_lines_and_bad_runs(tmp_path):
    from ratchet.registry.db import Registry
    from ratchet.registry.rebuild import rebuild_from_store
    from tests.registry.runfolders import write_run

    root = tmp_path / "runs"
    torn = write_run(root, "torn-1", rewards=[0.1, 0.2, 0.4], loop={"steps": 10})
    lines = torn.get_bytes(RunLayout.METRICS).splitlines()
    torn.put_bytes(RunLayout.METRICS, b"\n".join([lines[0], lines[1], lines[2][:-7], b"[1, 2]"]) + b"\n")
    write_run(root, "broken-2", rewards=[0.3], loop={"steps": 10})
    (root / "broken-2" / RunLayout.METRICS).unlink()
    (root / "broken-2" / RunLayout.METRICS).mkdir()  # unreadable as a file: this run fails, alone
    write_run(root, "fine-3", rewards=[0.5, 0.6], loop={"steps": 10})
    registry = Registry.open(f"sqlite:///{tmp_path / 'registry.db'}")
    try:
        report = rebuild_from_store(registry, str(root))
        assert report.runs == ["fine-3", "torn-1"] and list(report.skipped) == ["broken-2"]
        assert list(report.skipped_lines) == ["torn-1"]
        assert [s.split(":")[0] for s in report.skipped_lines["torn-1"]] == [f"{RunLayout.METRICS} line 3", f"{RunLayout.METRICS} line 4"]
        torn_row, fine = registry.run("torn-1"), registry.run("fine-3")
        assert (torn_row.last_step, torn_row.last_reward) == (1, 0.2)  # from the lines that read
        assert (fine.last_step, fine.last_reward) == (1, 0.6)
    finally:
        registry.close()


# --------------------------------------------------------------------------- the policy log of a short weight stream


def test_a_short_weight_stream_is_neither_served_nor_logged_and_leaves_no_temp(tiny_model, tmp_path, monkeypatch):
    from ratchet.config.schema import RunConfig
    from ratchet.tasks.generate import write_task_parquet
    from ratchet.workers.rollout import RolloutWorker
    from ratchet.workers.weight_slot import TORN_VERSION
    from ratchet.workers.weight_sync.sources import BucketListSource
    from ratchet.workers.weight_sync.buckets import WeightBucket, mapping_manifest

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    data = write_task_parquet(tmp_path / "copy.parquet", "copy", 8, seed=0, min_len=4, max_len=4)
    cfg = RunConfig.model_validate(
        {"seed": 0, "deterministic": True, "model": {"path": str(tiny_model)}, "data": {"train_files": str(data)},
         "rollout": {"n": 2, "max_response_length": 4}, "storage": {"root": str(tmp_path / "run")}}
    )  # fmt: skip
    worker = RolloutWorker(cfg, str(tiny_model), str(tmp_path / "run"))
    weights = {k: v.numpy().copy() for k, v in worker.engine.model.state_dict().items() if k != "lm_head.weight"}

    def short_stream(version: int) -> BucketListSource:
        m = mapping_manifest(weights, version)
        half = len(m.specs) // 2
        return BucketListSource(m, [WeightBucket(index=0, specs=m.specs[:half], arrays=[weights[s.name] for s in m.specs[:half]])])

    run = ObjectStore(str(tmp_path / "run"))
    # The HF engine refuses a partial set itself.
    with pytest.raises(ValueError, match="missing="):
        worker.load_weights(short_stream(1))
    assert worker.version == TORN_VERSION and not run.list(RunLayout.POLICY_LOG) and not list(scratch.iterdir())

    # An engine that takes whatever arrives (as vLLM's reload does): the log writer notices.
    real_load = worker.engine.load_weights
    monkeypatch.setattr(worker.engine, "load_weights", lambda pairs: [None for _ in pairs])
    with pytest.raises(RuntimeError, match=r"policy v2: the stream ended after \d+ of \d+ tensors; not served, not logged"):
        worker.load_weights(short_stream(2))
    assert worker.version == TORN_VERSION and not run.list(RunLayout.POLICY_LOG) and not list(scratch.iterdir())

    # A log that cannot be stored: the version is not served either (a recreated worker could not serve it again).
    monkeypatch.setattr(worker.engine, "load_weights", real_load)
    monkeypatch.setattr(worker.run, "put_file", lambda key, path: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    whole = mapping_manifest(weights, 3)
    with pytest.raises(OSError, match="No space left"):
        worker.load_weights(
            BucketListSource(whole, [WeightBucket(index=0, specs=whole.specs, arrays=[weights[s.name] for s in whole.specs])])
        )
    assert worker.version == TORN_VERSION and not list(scratch.iterdir())

    monkeypatch.undo()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    worker.load_weights({k: v for k, v in weights.items()}, 4)
    assert worker.version == 4 and run.list(RunLayout.POLICY_LOG) == [RunLayout.policy_log(4)] and not list(scratch.iterdir())
    assert np.array_equal(worker.engine.model.state_dict()["model.embed_tokens.weight"].numpy(), weights["model.embed_tokens.weight"])


def test_a_failed_trainer_meta_write_leaves_no_temp_file(tmp_path, monkeypatch):
    """`write_snapshot` writes `trainer_meta.json` through a temp file; when the write or
    the rename fails (a full disk), the temp file goes too: it would otherwise be uploaded
    with the next checkpoint of that folder."""
    from ratchet.workers import checkpointing

    snap = checkpointing.TrainerSnapshot(
        state={"version": torch.tensor(3, dtype=torch.int64)}, meta={"format": checkpointing.FORMAT, "version": 3}, rank=0, world_size=1
    )

    def no_space(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpointing.os, "replace", no_space)
    with pytest.raises(OSError, match="No space left"):
        checkpointing.write_snapshot(snap, tmp_path / "trainer")
    assert [p.name for p in (tmp_path / "trainer").iterdir()] == ["shard-00001-model-00001-of-00001.safetensors"]  # no meta, no temp
