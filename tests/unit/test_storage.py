"""ratchet.storage (object store, batch store, metrics log) on a local folder, and the
Hugging Face model folders of ratchet.workers.hf_io."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import pytest
import torch

from ratchet.storage.batch_store import BatchStore
from ratchet.storage.metrics_log import MetricsLog
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.batch_store import pack_tensors, unpack_tensors

torch.set_num_threads(1)


def all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- ObjectStore


def test_put_get_bytes_and_json(tmp_path):
    store = ObjectStore(str(tmp_path / "root"))
    uri = store.put_bytes("a/b/blob.bin", b"\x00\x01hello")
    assert uri == str(tmp_path / "root" / "a" / "b" / "blob.bin")
    assert Path(uri).read_bytes() == b"\x00\x01hello"
    assert store.get_bytes("a/b/blob.bin") == b"\x00\x01hello"
    obj = {"step": 3, "values": [1.5, None, "x"], "nested": {"ü": True}}
    store.put_json("meta.json", obj)
    assert store.get_json("meta.json") == obj
    assert store.exists("meta.json") and store.exists("a/b/blob.bin") and not store.exists("nope")
    assert store.list() == ["a/b/blob.bin", "meta.json"]
    assert store.list("a") == ["a/b/blob.bin"]
    assert store.list("missing/prefix") == []


def test_overwrite_replaces_the_object(tmp_path):
    store = ObjectStore(str(tmp_path))
    store.put_bytes("k", b"first")
    store.put_bytes("k", b"second, longer")
    assert store.get_bytes("k") == b"second, longer"
    assert store.list() == ["k"]


def test_no_tmp_leftovers_after_writes(tmp_path):
    store = ObjectStore(str(tmp_path))
    for i in range(3):
        store.put_bytes(f"dir/obj-{i}", b"x" * (i + 1))
        store.put_json("dir/meta.json", {"i": i})
    files = all_files(tmp_path)
    assert files == ["dir/meta.json", "dir/obj-0", "dir/obj-1", "dir/obj-2"]
    assert not any(".tmp-" in f for f in files)


def test_list_hides_temporary_keys(tmp_path):
    store = ObjectStore(str(tmp_path))
    store.put_bytes("x/real", b"1")
    # what an interrupted writer leaves behind
    (tmp_path / "x" / f"real.tmp-{uuid.uuid4().hex}").write_bytes(b"partial")
    (tmp_path / "x" / f"other.tmp-{uuid.uuid4().hex}").write_bytes(b"partial")
    assert store.list() == ["x/real"]
    assert store.list("x") == ["x/real"]


def test_write_failing_midway_keeps_previous_object(tmp_path, monkeypatch):
    store = ObjectStore(str(tmp_path))
    store.put_bytes("ckpt/state.bin", b"OLD-" * 100)
    real_open = store.fs.open

    class HalfWriter:
        """Writes the first half of what it is given to the real file, then fails."""

        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()
            return False

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError("disk full (simulated)")

    def failing_open(path, mode="rb", **kwargs):
        f = real_open(path, mode, **kwargs)
        return HalfWriter(f) if "w" in mode else f

    monkeypatch.setattr(store.fs, "open", failing_open)
    with pytest.raises(OSError, match="simulated"):
        store.put_bytes("ckpt/state.bin", b"NEW!" * 1000)
    with pytest.raises(OSError, match="simulated"):
        store.put_bytes("ckpt/fresh.bin", b"NEW!" * 1000)
    monkeypatch.undo()
    assert store.get_bytes("ckpt/state.bin") == b"OLD-" * 100
    assert not store.exists("ckpt/fresh.bin")  # a failed first write does not create the object
    assert store.list() == ["ckpt/state.bin"]  # a partial temporary file, if any, stays hidden


def test_file_url_root(tmp_path):
    url = f"file://{tmp_path}/run"
    store = ObjectStore(url)
    assert store.protocol == "file"
    assert store.url == f"{tmp_path}/run"
    uri = store.put_json("m/x.json", {"a": 1})
    assert uri == f"{tmp_path}/run/m/x.json"
    assert json.loads((tmp_path / "run" / "m" / "x.json").read_text()) == {"a": 1}
    # the same objects through a plain-path store and through a child store
    assert ObjectStore(str(tmp_path / "run")).get_json("m/x.json") == {"a": 1}
    assert store.child("m").get_json("x.json") == {"a": 1}
    assert store.child("m").list() == ["x.json"]


def test_delete(tmp_path):
    store = ObjectStore(str(tmp_path))
    store.put_bytes("d/a", b"1")
    store.put_bytes("d/b/c", b"2")
    store.delete("d/a")
    assert store.list() == ["d/b/c"]
    store.delete("d")
    assert store.list() == []
    store.delete("never-existed")  # no error


# --------------------------------------------------------------------------- BatchStore


def sample_tensors() -> dict[str, torch.Tensor]:
    return {
        "ids": torch.arange(12, dtype=torch.long).reshape(3, 4),
        "mask": torch.tensor([[1.0, 1.0, 0.0, 0.0]] * 3),
        "logp": torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),
        "version": torch.tensor([[2, 2, 0, 0]] * 3, dtype=torch.long),
        "strided": torch.arange(10.0)[::2],  # non-contiguous input
    }


def test_pack_unpack_round_trip():
    tensors = sample_tensors()
    meta = {"samples": [{"ground_truth": "0123", "extra": {"i": 1}}], "text": "ünïcode"}
    out, meta_back = unpack_tensors(pack_tensors(tensors, meta))
    assert meta_back == meta
    assert sorted(out) == sorted(tensors)
    for k, v in tensors.items():
        assert out[k].dtype == v.dtype
        assert torch.equal(out[k], v)


def test_batch_store_round_trip_and_keys(tmp_path):
    store = ObjectStore(str(tmp_path))
    batches = BatchStore(store)
    tensors = sample_tensors()
    meta = {"samples": [{"data_source": "digits/copy", "ground_truth": "42"}] * 3}
    uri = batches.write(12, "rollout", tensors, meta)
    assert uri == str(tmp_path / "batches" / "step-000012" / "rollout.safetensors")
    assert batches.batch_key(12) == "batches/step-000012"
    assert batches.has(12, "rollout") and not batches.has(12, "scores") and not batches.has(13, "rollout")
    out, meta_back = batches.read(12, "rollout")
    assert meta_back == meta
    for k, v in tensors.items():
        assert torch.equal(out[k], v)
    # safetensors on disk, nothing else
    assert all_files(tmp_path) == ["batches/step-000012/rollout.safetensors"]


def test_batch_store_kinds_are_separate(tmp_path):
    store = ObjectStore(str(tmp_path))
    train, evals = BatchStore(store), BatchStore(store, "evals")
    train.write(1, "rollout", {"x": torch.ones(2)}, {"kind": "train"})
    evals.write(1, "rollout", {"x": torch.zeros(3)}, {"kind": "eval"})
    assert store.list() == ["batches/step-000001/rollout.safetensors", "evals/step-000001/rollout.safetensors"]
    assert train.read(1, "rollout")[1] == {"kind": "train"}
    assert torch.equal(evals.read(1, "rollout")[0]["x"], torch.zeros(3))
    assert not evals.has(2, "rollout")


def test_rewriting_a_step_overwrites(tmp_path):
    store = ObjectStore(str(tmp_path))
    batches = BatchStore(store)
    batches.write(5, "scores", {"reward": torch.tensor([0.0, 1.0])}, {"try": 1})
    batches.write(5, "scores", {"reward": torch.tensor([0.5, 0.25, 1.0])}, {"try": 2})  # a retried activity
    tensors, meta = batches.read(5, "scores")
    assert meta == {"try": 2}
    assert torch.equal(tensors["reward"], torch.tensor([0.5, 0.25, 1.0]))
    assert store.list() == ["batches/step-000005/scores.safetensors"]
    assert all_files(tmp_path) == ["batches/step-000005/scores.safetensors"]


# --------------------------------------------------------------------------- MetricsLog


def test_metrics_log_one_line_per_step_latest_wins(tmp_path):
    store = ObjectStore(str(tmp_path))
    log = MetricsLog(store, clock=lambda: 0.0)  # each line's time_unix/time_utc: tests/unit/test_datasets.py
    assert log.read() == []
    log.write(0, {"reward": 0.1})
    log.write(1, {"reward": 0.2, "kl": 0.0})
    log.write(1, {"reward": 0.3})  # retried step 1 replaces the line
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    epoch = {"time_unix": 0.0, "time_utc": "1970-01-01T00:00:00.000+00:00"}
    assert [json.loads(line) for line in lines] == [{"step": 0, "reward": 0.1, **epoch}, {"step": 1, "reward": 0.3, **epoch}]
    assert log.read() == [{"step": 0, "reward": 0.1, **epoch}, {"step": 1, "reward": 0.3, **epoch}]
    log.write(7, {"reward": 0.7})
    log.write(3, {"reward": 0.5})  # out of order: the file stays sorted by step
    assert [r["step"] for r in log.read()] == [0, 1, 3, 7]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("\n")
    assert all_files(tmp_path) == ["metrics.jsonl"]


def test_metrics_log_appends_a_new_step_without_reencoding_the_lines_before(tmp_path):
    """A long run's file is not parsed and rewritten whole at every step: a step after the
    last is appended, the earlier lines kept byte for byte (here: spacing json.dumps would
    not write); a file cut before its last newline still gets whole lines."""
    store = ObjectStore(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"step":0,  "reward": 0.1}\n{"step": 1, "reward": 0.2}')
    log = MetricsLog(store, clock=lambda: 0.0)
    log.write(2, {"reward": 0.3})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[:2] == ['{"step":0,  "reward": 0.1}', '{"step": 1, "reward": 0.2}']
    assert [r["step"] for r in log.read()] == [0, 1, 2] and log.read()[2]["reward"] == 0.3
    log.write(1, {"reward": 0.25})  # a retried step: the whole file, keyed by step
    assert [(r["step"], r["reward"]) for r in log.read()] == [(0, 0.1), (1, 0.25), (2, 0.3)]


def test_metrics_log_custom_key_and_file_url(tmp_path):
    log = MetricsLog(ObjectStore(f"file://{tmp_path}"), key="evals/metrics.jsonl", clock=lambda: 1.5)
    log.write(2, {"acc": 1.0})
    log.write(2, {"acc": 0.5})
    stamp = '"time_unix": 1.5, "time_utc": "1970-01-01T00:00:01.500+00:00"'
    assert (tmp_path / "evals" / "metrics.jsonl").read_text() == '{"acc": 0.5, "step": 2, ' + stamp + "}\n"


# --------------------------------------------------------------------------- hf_io


@pytest.fixture(scope="module")
def loaded(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)


def test_save_hf_writes_manifest_last_with_sha256(tmp_path, loaded, monkeypatch):
    from ratchet.workers.hf_io import MANIFEST, local_hf_path, save_hf

    model, tokenizer = loaded
    store = ObjectStore(str(tmp_path / "run"))
    written = []
    real_put = store.put_bytes

    def recording_put(key, data):
        written.append(key)
        return real_put(key, data)

    monkeypatch.setattr(store, "put_bytes", recording_put)
    uri = save_hf(model, tokenizer, store, "export/model")
    assert uri == str(tmp_path / "run" / "export" / "model")
    assert written[-1] == f"export/model/{MANIFEST}"  # the commit marker comes last
    manifest = store.get_json(f"export/model/{MANIFEST}")
    files = manifest["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert sorted(files) == sorted(k.rsplit("/", 1)[1] for k in written[:-1])
    for name, info in files.items():
        data = (Path(uri) / name).read_bytes()
        assert info["bytes"] == len(data)
        assert info["sha256"] == hashlib.sha256(data).hexdigest()
    assert not any(".tmp-" in f for f in all_files(tmp_path))
    # a local export is used in place
    assert local_hf_path(uri) == uri


def test_local_hf_path_of_local_folder(tiny_model, tmp_path):
    from ratchet.workers.hf_io import local_hf_path

    assert local_hf_path(str(tiny_model)) == str(tiny_model)
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    (empty / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError):
        local_hf_path(str(empty))
    with pytest.raises(FileNotFoundError):
        local_hf_path(str(tmp_path / "does-not-exist"))


def test_local_hf_path_downloads_remote_model_and_checks_sha(loaded, tmp_path):
    """A non-local store (fsspec's in-memory filesystem) goes through the manifest."""
    from transformers import AutoModelForCausalLM

    from ratchet.workers.hf_io import MANIFEST, local_hf_path, save_hf

    model, tokenizer = loaded
    root = f"memory://ratchet-test-{uuid.uuid4().hex}"
    store = ObjectStore(root)
    uri = save_hf(model, tokenizer, store, "m")
    assert uri == f"memory://{store.root}/m"
    local = Path(local_hf_path(uri, cache_dir=str(tmp_path / "cache")))
    assert local.is_relative_to(tmp_path / "cache")
    assert (local / MANIFEST).is_file() and (local / "config.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(local)
    for (k, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(reloaded.state_dict().items())):
        assert torch.equal(a, b), k
    assert local_hf_path(uri, cache_dir=str(tmp_path / "cache")) == str(local)  # cached

    # a corrupted object is refused
    store.put_bytes("m/config.json", b"{}")
    with pytest.raises(ValueError, match="sha256"):
        local_hf_path(uri, cache_dir=str(tmp_path / "cache2"))
    store.delete("")
