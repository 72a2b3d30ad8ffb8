"""Retention keeps a good checkpoint, leftovers of interrupted writes are cleaned, and
local writes reach the disk.

Before: `apply_retention(keep_last=1)` deleted every checkpoint but the newest without
reading it, so a corrupted newest checkpoint left nothing to restore; `.tmp-` files of a
killed writer (and unfinished multipart uploads) stayed forever; local writes were renamed
into place without fsync. On a local folder and the moto S3 server (s3://, minio://).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ratchet.storage.checkpoint_store import CheckpointStore
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.checkpoint_store import MANIFEST
from tests.s3_server import moto_server, s3_env, store_url  # noqa: F401

MiB = 1 << 20


@pytest.fixture(params=["file", "s3", "minio"])
def ckpts(request, tmp_path) -> CheckpointStore:
    env = request.getfixturevalue("s3_env") if request.param != "file" else None
    store = ObjectStore(store_url(request.param, tmp_path, env), retry_timeout_s=5, retry_initial_s=0.05, retry_max_s=0.2)
    return CheckpointStore(store)


def local_checkpoint(root: Path, step: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.safetensors").write_bytes(bytes([step]) * 4096)
    (root / "run_state.json").write_text(f'{{"step": {step}}}')
    return root


def commit(ckpts: CheckpointStore, tmp_path: Path, step: int):
    return ckpts.commit(f"step-{step:08d}", local_checkpoint(tmp_path / f"c{step}", step), {"step": step})


def corrupt(ckpts: CheckpointStore, step: int) -> None:
    key = f"checkpoints/step-{step:08d}/model.safetensors"
    data = ckpts.store.get_bytes(key)
    ckpts.store.put_bytes(key, b"\xff" + data[1:])  # same size, other bytes


def names(ckpts: CheckpointStore) -> list[str]:
    return [c.name for c in ckpts.list()]


@pytest.mark.slow
def test_corrupted_newest_keeps_the_older_good_one(ckpts, tmp_path):
    for step in (1, 2, 3):
        commit(ckpts, tmp_path, step)
    corrupt(ckpts, 3)
    assert ckpts.apply_retention(keep_last=1, keep_every=0) == ["step-00000001"]  # older than the good step 2
    assert names(ckpts) == ["step-00000002", "step-00000003"]
    assert ckpts.latest().name == "step-00000002"  # still something to restore
    commit(ckpts, tmp_path, 4)  # a newer good checkpoint: now the rest may go
    assert ckpts.apply_retention(keep_last=1, keep_every=0) == ["step-00000002", "step-00000003"]
    assert names(ckpts) == ["step-00000004"] and ckpts.verify("step-00000004")


def test_no_good_checkpoint_means_nothing_is_deleted(ckpts, tmp_path):
    for step in (1, 2):
        commit(ckpts, tmp_path, step)
    corrupt(ckpts, 1)
    corrupt(ckpts, 2)
    assert ckpts.apply_retention(keep_last=1, keep_every=0) == []
    assert names(ckpts) == ["step-00000001", "step-00000002"]


def test_nothing_to_delete_reads_nothing(ckpts, tmp_path, monkeypatch):
    """Verification (a read of every byte) happens only when something would be deleted."""
    commit(ckpts, tmp_path, 1)
    monkeypatch.setattr(ckpts, "problems", lambda name: pytest.fail("verified without cause"))
    assert ckpts.apply_retention(keep_last=2, keep_every=0) == []


def test_local_tmp_leftovers_are_cleaned_but_not_a_write_in_flight(tmp_path):
    ckpts = CheckpointStore(ObjectStore(str(tmp_path / "run")))
    commit(ckpts, tmp_path, 1)
    folder = tmp_path / "run" / "checkpoints" / "step-00000001"
    old = folder / "model.safetensors.tmp-0123456789abcdef"  # a writer killed two hours ago
    young = folder / "extra.bin.tmp-fedcba9876543210"  # a write going on now
    for path in (old, young):
        path.write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    assert ckpts.store.list("checkpoints") == sorted(
        f"checkpoints/step-00000001/{n}" for n in ("model.safetensors", "run_state.json", MANIFEST)
    )  # invisible to readers either way
    deleted = ckpts.apply_retention(keep_last=1, keep_every=0)
    assert deleted == [f"checkpoints/step-00000001/{old.name}"]
    assert not old.exists() and young.read_bytes() == b"partial"
    assert ckpts.verify("step-00000001")
    assert ckpts.apply_retention(keep_last=1, keep_every=0, leftover_age_s=0) == [f"checkpoints/step-00000001/{young.name}"]


def test_unfinished_multipart_uploads_are_aborted(ckpts, tmp_path, s3_env):
    """An upload a killed writer left open (invisible, but billed) is aborted. Which are
    old enough goes by the server's `Initiated` date; moto reports a fixed date in 2010
    for every upload, so here every open upload counts as old: what this shows is the
    abort, and that only uploads under the checkpoint prefix are touched (the age rule
    is shown on local `.tmp-` files above)."""
    if ckpts.store.protocol == "file":
        pytest.skip("local folders have no multipart uploads")
    import boto3

    client = boto3.client("s3", endpoint_url=s3_env.server.endpoint)
    commit(ckpts, tmp_path, 1)
    key = "run/checkpoints/step-00000002/model.safetensors"  # a writer killed mid-upload
    upload = client.create_multipart_upload(Bucket=s3_env.bucket, Key=key)["UploadId"]
    client.upload_part(Bucket=s3_env.bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * (5 * MiB))
    elsewhere = client.create_multipart_upload(Bucket=s3_env.bucket, Key="run/batches/step-000001/rollout.safetensors")

    def open_keys() -> list[str]:
        return sorted(u["Key"] for u in client.list_multipart_uploads(Bucket=s3_env.bucket).get("Uploads", []))

    assert open_keys() == sorted([key, "run/batches/step-000001/rollout.safetensors"])
    assert ckpts.apply_retention(keep_last=1, keep_every=0) == ["checkpoints/step-00000002/model.safetensors"]
    assert open_keys() == ["run/batches/step-000001/rollout.safetensors"]  # only under the checkpoint prefix
    assert ckpts.apply_retention(keep_last=1, keep_every=0) == []
    assert names(ckpts) == ["step-00000001"] and ckpts.verify("step-00000001")
    client.abort_multipart_upload(Bucket=s3_env.bucket, Key=elsewhere["Key"], UploadId=elsewhere["UploadId"])


def test_local_writes_are_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    store = ObjectStore(str(tmp_path / "run"))
    store.put_bytes("a/b.json", b"{}")
    assert len(synced) == 2 and ".tmp-" in synced[0] and synced[0].startswith(str(tmp_path / "run" / "a" / "b.json"))
    assert synced[1] == str(tmp_path / "run" / "a")  # the folder, after the rename
    synced.clear()
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 1000)
    store.put_file("c.bin", src)
    assert ".tmp-" in synced[0] and synced[1] == str(tmp_path / "run")
    synced.clear()
    store.get_file("c.bin", tmp_path / "dl" / "c.bin")
    assert synced == [str(tmp_path / "dl" / "c.bin.part"), str(tmp_path / "dl")]


def test_download_reports_progress_per_file(ckpts, tmp_path):
    info = commit(ckpts, tmp_path, 1)
    seen: list[str] = []
    ckpts.download(info.name, tmp_path / "out", progress=seen.append)
    assert len(seen) == len(info.files) == 2
    assert seen[-1].startswith(f"{info.name}: 2/2 files, {info.total_bytes}/{info.total_bytes} bytes")
