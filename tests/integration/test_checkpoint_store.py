"""CheckpointStore on a local folder, and on a real S3-protocol server (moto in server
mode) through both `s3://` (s3fs) and `minio://` (the minio client): commit with a manifest
written last, crash-safety, corruption detection and fallback, resumable downloads and
retention."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from pathlib import Path

import pytest

from ratchet.storage.checkpoint_store import CheckpointInfo, CheckpointStore, CorruptCheckpoint
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.checkpoint_store import MANIFEST
from tests.s3_server import moto_server, s3_env, store_url  # noqa: F401

MiB = 1 << 20


@pytest.fixture(params=["file", "s3", "minio"])
def ckpts(request, tmp_path) -> CheckpointStore:
    env = request.getfixturevalue("s3_env") if request.param != "file" else None
    store = ObjectStore(
        store_url(request.param, tmp_path, env), part_size=5 * MiB, retry_timeout_s=5, retry_initial_s=0.05, retry_max_s=0.2
    )
    return CheckpointStore(store)


def make_checkpoint(root: Path, seed: int, big: int = 64 * 1024) -> Path:
    """A checkpoint-like folder: two safetensors-like shards, a nested optimizer file, JSON."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    (root / "model-00001-of-00002.safetensors").write_bytes(rng.randbytes(big))
    (root / "model-00002-of-00002.safetensors").write_bytes(rng.randbytes(1000 + seed))
    (root / "optim").mkdir(exist_ok=True)
    (root / "optim" / "rank-0.distcp").write_bytes(rng.randbytes(3000))
    (root / "config.json").write_text(json.dumps({"seed": seed}))
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def step_name(step: int) -> str:
    return f"step-{step:06d}"


# --------------------------------------------------------------------------- commit and read back


@pytest.mark.slow
def test_commit_writes_manifest_last_and_round_trips(ckpts, tmp_path, monkeypatch):
    local = make_checkpoint(tmp_path / "local", seed=1)
    writes = []
    store = ckpts.store
    real_file, real_json = store.put_file, store.put_json
    monkeypatch.setattr(store, "put_file", lambda key, path: writes.append(key) or real_file(key, path))
    monkeypatch.setattr(store, "put_json", lambda key, obj: writes.append(key) or real_json(key, obj))
    info = ckpts.commit("step-000001", local, {"step": 1, "loss": 0.5})
    monkeypatch.undo()

    assert writes[-1] == f"checkpoints/step-000001/{MANIFEST}" and len(writes) == 5  # the commit marker comes last
    files = tree(local)
    assert isinstance(info, CheckpointInfo)
    assert (info.name, info.step, info.meta) == ("step-000001", 1, {"step": 1, "loss": 0.5})
    assert info.files == {rel: {"size": len(data), "sha256": sha(data)} for rel, data in files.items()}
    assert info.total_bytes == sum(len(d) for d in files.values()) and info.created.endswith("Z")
    assert info.uri == store.uri("checkpoints/step-000001")
    manifest = store.get_json(f"checkpoints/step-000001/{MANIFEST}")
    assert manifest["files"] == info.files and manifest["meta"] == info.meta and manifest["created"] == info.created
    assert store.list("checkpoints") == sorted(
        [f"checkpoints/step-000001/{rel}" for rel in files] + [f"checkpoints/step-000001/{MANIFEST}"]
    )
    assert ckpts.list() == [info] and ckpts.get("step-000001") == info and ckpts.verify("step-000001")

    out = ckpts.download("step-000001", tmp_path / "restored")
    assert out == info
    restored = tree(tmp_path / "restored")
    assert restored.pop(MANIFEST) and restored == files


@pytest.mark.slow
def test_list_sorts_by_step_then_name(ckpts, tmp_path):
    local = make_checkpoint(tmp_path / "l", seed=2, big=100)
    for name, meta in [("ckpt-10", {"step": 10}), ("ckpt-9", {"step": 9}), ("ckpt-100", {"step": 100}), ("warm", {})]:
        ckpts.commit(name, local, meta)
    assert [c.name for c in ckpts.list()] == ["warm", "ckpt-9", "ckpt-10", "ckpt-100"]  # not lexicographic
    assert [c.step for c in ckpts.list()] == [None, 9, 10, 100]
    assert ckpts.latest().name == "ckpt-100"
    assert ckpts.latest(max_step=50).name == "ckpt-10"
    assert ckpts.latest(max_step=5) is None


def test_missing_and_invalid(ckpts, tmp_path):
    assert ckpts.list() == [] and ckpts.latest() is None
    with pytest.raises(FileNotFoundError, match="no committed checkpoint 'nope'"):
        ckpts.get("nope")
    for bad in ("../up", "a/b", "", ".hidden", "x.tmp-1"):
        with pytest.raises(ValueError, match="checkpoint name"):
            ckpts.commit(bad, tmp_path, {})
    with pytest.raises(TypeError, match="JSON-serializable"):
        ckpts.commit("ok", make_checkpoint(tmp_path / "l", seed=3, big=10), {"when": object()})
    with pytest.raises(NotADirectoryError):
        ckpts.commit("ok", tmp_path / "does-not-exist", {})
    assert ckpts.list() == []


def test_recommit_keeps_the_old_checkpoint_until_the_new_manifest(ckpts, tmp_path, monkeypatch):
    """A retried activity re-commits its step: the new attempt goes to a folder of its own,
    nothing is deleted before its manifest replaces the old one, then the old files go."""
    first = ckpts.commit("step-000003", make_checkpoint(tmp_path / "a", seed=1), {"step": 3, "try": 1})
    assert first.attempt == ""  # the first attempt: the plain layout every ratchet reads
    local = make_checkpoint(tmp_path / "b", seed=2)
    (local / "optim" / "rank-0.distcp").unlink()
    (local / "extra.json").write_text("{}")
    events = []
    store = ckpts.store
    real_delete, real_put, real_bytes = store.delete, store.put_file, store.put_bytes
    monkeypatch.setattr(store, "delete", lambda key: events.append(("delete", key)) or real_delete(key))
    monkeypatch.setattr(store, "put_file", lambda key, p: events.append(("put", key)) or real_put(key, p))
    monkeypatch.setattr(store, "put_bytes", lambda key, d: events.append(("put", key)) or real_bytes(key, d))
    second = ckpts.commit("step-000003", local, {"step": 3, "try": 2})
    monkeypatch.undo()
    manifest_at = events.index(("put", f"checkpoints/step-000003/{MANIFEST}"))
    assert all(kind == "put" for kind, _ in events[:manifest_at]) and all(kind == "delete" for kind, _ in events[manifest_at + 1 :])
    assert second.attempt.startswith("attempt-") and all(key.startswith(f"checkpoints/step-000003/{second.attempt}/")
                                                         for _, key in events[:manifest_at])  # fmt: skip
    assert ("delete", "checkpoints/step-000003/optim/rank-0.distcp") in events  # the first attempt's files go after
    assert second.meta["try"] == 2 and second.files != first.files and ckpts.list() == [second]
    assert sorted(ckpts.store.list("checkpoints")) == sorted(
        [f"checkpoints/step-000003/{second.attempt}/{r}" for r in tree(local)] + [f"checkpoints/step-000003/{MANIFEST}"]
    )
    assert ckpts.verify("step-000003")
    ckpts.download("step-000003", tmp_path / "back")
    assert {k: v for k, v in tree(tmp_path / "back").items() if k != MANIFEST} == tree(local)
    (local / MANIFEST).write_text("{}")
    with pytest.raises(ValueError, match="remove it from the folder"):
        ckpts.commit("step-000004", local, {"step": 4})


def test_manifest_paths_cannot_escape_the_download_folder(ckpts, tmp_path):
    info = ckpts.commit("step-000001", make_checkpoint(tmp_path / "c", seed=1, big=10), {"step": 1})
    manifest = ckpts.store.get_json(f"checkpoints/step-000001/{MANIFEST}")
    manifest["files"] = {"../../escaped.bin": next(iter(info.files.values()))}
    ckpts.store.put_json(f"checkpoints/step-000001/{MANIFEST}", manifest)
    with pytest.raises(CorruptCheckpoint, match="outside the checkpoint folder"):
        ckpts.download("step-000001", tmp_path / "out" / "x")
    assert not (tmp_path / "escaped.bin").exists()
    del manifest["files"]
    ckpts.store.put_json(f"checkpoints/step-000001/{MANIFEST}", manifest)
    with pytest.raises(CorruptCheckpoint, match="lacks a field"):
        ckpts.get("step-000001")


# --------------------------------------------------------------------------- crashes


def test_crash_mid_upload_leaves_no_visible_checkpoint(ckpts, tmp_path, monkeypatch):
    ckpts.commit(step_name(1), make_checkpoint(tmp_path / "c1", seed=1), {"step": 1})
    local2 = make_checkpoint(tmp_path / "c2", seed=2, big=12 * MiB)  # the big shard is a multipart upload
    store = ckpts.store
    real_put_stream = store.put_stream

    class FailingRead:
        """The shard's file raises halfway through (a disk error, a killed writer)."""

        def __init__(self, f):
            self.f, self.read_bytes = f, 0

        def read(self, n=-1):
            if self.read_bytes > 6 * MiB:
                raise OSError("I/O error reading the shard (simulated)")
            data = self.f.read(n)
            self.read_bytes += len(data)
            return data

        def seekable(self):
            return False

    def crashing(key, stream, size):
        if key.endswith("model-00001-of-00002.safetensors"):
            return real_put_stream(key, FailingRead(stream), size)
        return real_put_stream(key, stream, size)

    monkeypatch.setattr(store, "put_stream", crashing)
    with pytest.raises(OSError, match="simulated"):
        ckpts.commit(step_name(2), local2, {"step": 2})
    monkeypatch.undo()

    assert store.list(f"checkpoints/{step_name(2)}") == [f"checkpoints/{step_name(2)}/config.json"]  # an invisible leftover
    assert [c.name for c in ckpts.list()] == [step_name(1)]
    assert ckpts.latest().name == step_name(1)
    with pytest.raises(FileNotFoundError):
        ckpts.get(step_name(2))
    # the retried activity commits the same name again, and wins
    info = ckpts.commit(step_name(2), local2, {"step": 2})
    assert ckpts.latest() == info and ckpts.verify(step_name(2))


def test_crash_after_some_files_then_a_different_retry(ckpts, tmp_path, monkeypatch):
    """Files of an earlier attempt that the retry no longer has are cleaned up."""
    local = make_checkpoint(tmp_path / "c", seed=4)
    store = ckpts.store
    real = store.put_file
    calls = []

    def dies_on_third(key, path):
        calls.append(key)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the worker is killed
        return real(key, path)

    monkeypatch.setattr(store, "put_file", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        ckpts.commit("step-000005", local, {"step": 5})
    monkeypatch.undo()
    assert ckpts.list() == [] and len(store.list("checkpoints")) == 2
    (local / "config.json").unlink()
    (local / "model-00001-of-00002.safetensors").unlink()
    info = ckpts.commit("step-000005", local, {"step": 5})
    assert sorted(info.files) == ["model-00002-of-00002.safetensors", "optim/rank-0.distcp"]
    assert store.list("checkpoints") == sorted(
        ["checkpoints/step-000005/" + r for r in (MANIFEST, "model-00002-of-00002.safetensors", "optim/rank-0.distcp")]
    )


# --------------------------------------------------------------------------- corruption


def test_corrupted_shard_is_detected_and_latest_falls_back(ckpts, tmp_path, caplog):
    ckpts.commit(step_name(1), make_checkpoint(tmp_path / "c1", seed=1), {"step": 1})
    good2 = ckpts.commit(step_name(2), make_checkpoint(tmp_path / "c2", seed=2), {"step": 2})
    store = ckpts.store
    shard = f"checkpoints/{step_name(2)}/model-00001-of-00002.safetensors"
    original = store.get_bytes(shard)
    store.put_bytes(shard, bytes(b ^ 0xFF for b in original[:16]) + original[16:])  # same size, other bytes

    assert ckpts.verify(step_name(1)) and not ckpts.verify(step_name(2))
    problems = ckpts.problems(step_name(2))
    assert len(problems) == 1 and problems[0].startswith("model-00001-of-00002.safetensors: sha256")
    with caplog.at_level(logging.WARNING, logger="ratchet.storage.checkpoint_store"):
        assert ckpts.latest().name == step_name(1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and step_name(2) in warnings[0] and "falling back" in warnings[0]
    assert ckpts.latest(valid_only=False) == good2  # the unchecked answer is the corrupted one
    with pytest.raises(CorruptCheckpoint, match="model-00001-of-00002.safetensors") as err:
        ckpts.download(step_name(2), tmp_path / "bad")
    assert err.value.name == step_name(2) and len(err.value.problems) == 1
    assert not (tmp_path / "bad" / MANIFEST).exists()  # the local copy is not marked complete
    assert not (tmp_path / "bad" / "model-00001-of-00002.safetensors").exists()
    ckpts.download(step_name(1), tmp_path / "good")
    assert (tmp_path / "good" / MANIFEST).is_file()

    # a truncated file and a missing file are reported too
    store.put_bytes(shard, original[:100])
    store.delete(f"checkpoints/{step_name(2)}/config.json")
    problems = ckpts.problems(step_name(2))
    assert sorted(problems) == sorted(
        [f"model-00001-of-00002.safetensors: 100 bytes, manifest says {len(original)}", "config.json: missing"]
    )
    with pytest.raises(CorruptCheckpoint):
        ckpts.download(step_name(2), tmp_path / "bad2")
    # a broken manifest hides the checkpoint from list() (with a warning), and latest() moves on
    store.put_bytes(f"checkpoints/{step_name(2)}/{MANIFEST}", b"{not json")
    assert [c.name for c in ckpts.list()] == [step_name(1)]
    with pytest.raises(CorruptCheckpoint, match="not valid JSON"):
        ckpts.get(step_name(2))


# --------------------------------------------------------------------------- downloads


def test_download_resumes_a_partial_file(ckpts, tmp_path, monkeypatch):
    local = make_checkpoint(tmp_path / "c", seed=7, big=12 * MiB)
    ckpts.commit("step-000007", local, {"step": 7})
    data = (local / "model-00001-of-00002.safetensors").read_bytes()
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors.part").write_bytes(data[: 8 * MiB])  # a download killed earlier
    transfers = {}
    real = ckpts.store.get_file

    def spy(key, path, **kw):
        t = real(key, path, **kw)
        transfers[key.rsplit("/", 1)[1]] = t
        return t

    monkeypatch.setattr(ckpts.store, "get_file", spy)
    ckpts.download("step-000007", out)
    t = transfers["model-00001-of-00002.safetensors"]
    assert (t.size, t.transferred) == (len(data), len(data) - 8 * MiB)  # only the rest came over the network
    restored = tree(out)
    assert restored.pop(MANIFEST) and restored == tree(local)


def test_stale_partial_file_is_refetched_from_scratch(ckpts, tmp_path):
    local = make_checkpoint(tmp_path / "c", seed=8)
    ckpts.commit("step-000008", local, {"step": 8})
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors.part").write_bytes(b"bytes of some other checkpoint")
    ckpts.download("step-000008", out)
    assert (out / "model-00001-of-00002.safetensors").read_bytes() == (local / "model-00001-of-00002.safetensors").read_bytes()


# --------------------------------------------------------------------------- delete and retention


def test_delete_removes_the_manifest_first(ckpts, tmp_path, monkeypatch):
    ckpts.commit("step-000001", make_checkpoint(tmp_path / "c", seed=1), {"step": 1})
    deleted = []
    real = ckpts.store.delete
    monkeypatch.setattr(ckpts.store, "delete", lambda key: deleted.append(key) or real(key))
    ckpts.delete("step-000001")
    assert deleted == [f"checkpoints/step-000001/{MANIFEST}", "checkpoints/step-000001"]
    assert ckpts.list() == [] and ckpts.store.list("checkpoints") == []


@pytest.mark.slow
def test_retention_keeps_last_k_and_every_mth(ckpts, tmp_path):
    local = make_checkpoint(tmp_path / "c", seed=9, big=100)
    remote = ckpts.store.protocol != "file"
    for step in range(10):
        ckpts.commit(step_name(step), local, {"step": step})
    # an upload that died before the newest commit, and one that is still going on after it
    ckpts.store.put_bytes("checkpoints/step-000003b/model.safetensors", b"orphan")
    if remote:
        time.sleep(1.1)  # S3 Last-Modified has one-second resolution
    ckpts.commit(step_name(10), local, {"step": 10})
    ckpts.store.put_bytes("checkpoints/step-000011/model.safetensors", b"in progress")

    deleted = ckpts.apply_retention(keep_last=3, keep_every=5)
    assert deleted == [step_name(s) for s in (1, 2, 3, 4, 6, 7)] + ["step-000003b"]
    assert [c.name for c in ckpts.list()] == [step_name(s) for s in (0, 5, 8, 9, 10)]
    names = {k.split("/")[1] for k in ckpts.store.list("checkpoints")}
    assert names == {step_name(s) for s in (0, 5, 8, 9, 10)} | {"step-000011"}  # nothing left of the deleted
    assert ckpts.apply_retention(keep_last=3, keep_every=5) == []  # idempotent
    assert ckpts.apply_retention(keep_last=1, keep_every=0) == [step_name(s) for s in (0, 5, 8, 9)]
    assert [c.name for c in ckpts.list()] == [step_name(10)]
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        ckpts.apply_retention(keep_last=0, keep_every=5)


def test_newest_good_reads_once_and_falls_back(ckpts, tmp_path):
    """What recovery uses: the verifying fetch itself decides, so the bytes are read once."""
    ckpts.commit(step_name(1), make_checkpoint(tmp_path / "c1", seed=1), {"step": 1})
    ckpts.commit(step_name(2), make_checkpoint(tmp_path / "c2", seed=2), {"step": 2})
    ckpts.commit(step_name(3), make_checkpoint(tmp_path / "c3", seed=3), {"step": 3})
    store = ckpts.store
    cfg = f"checkpoints/{step_name(2)}/config.json"
    store.put_bytes(cfg, store.get_bytes(cfg).replace(b"2", b"7"))  # same size, other bytes
    fetched = []

    def fetch(info):
        fetched.append(info.name)
        return ckpts.read_files(info.name, ["config.json"])

    info, files = ckpts.newest_good(fetch, max_step=2)
    assert info.name == step_name(1) and json.loads(files["config.json"]) == {"seed": 1}
    assert fetched == [step_name(2), step_name(1)]  # step 3 is past max_step; step 2 is corrupted
    assert ckpts.newest_good(fetch, max_step=0) is None
    with pytest.raises(CorruptCheckpoint, match="nothing.json: not in the manifest"):
        ckpts.read_files(step_name(1), ["nothing.json"])


@pytest.mark.slow
def test_retired_checkpoints_are_invisible_and_kept(ckpts, tmp_path):
    local = make_checkpoint(tmp_path / "c", seed=4, big=100)
    for step in range(4):
        ckpts.commit(step_name(step), local, {"step": step})
    before = {k: ckpts.store.get_bytes(k) for k in ckpts.store.list(f"checkpoints/{step_name(3)}")}
    ckpts.retire(step_name(3))
    assert [c.name for c in ckpts.list()] == [step_name(s) for s in range(3)]
    assert ckpts.latest().name == step_name(2)
    if ckpts.store.protocol != "file":
        time.sleep(1.1)  # S3 Last-Modified has one-second resolution
    ckpts.commit(step_name(4), local, {"step": 4})
    assert ckpts.apply_retention(keep_last=1, keep_every=0) == [step_name(s) for s in range(3)]  # not the retired one
    after = {k: ckpts.store.get_bytes(k) for k in ckpts.store.list(f"checkpoints/{step_name(3)}")}
    manifest = before.pop(f"checkpoints/{step_name(3)}/{MANIFEST}")
    assert after.pop(f"checkpoints/{step_name(3)}/RETIRED.json") == manifest and after == before
