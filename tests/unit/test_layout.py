"""The run folder's keys (`RunLayout`) and the one manifest format (`Manifest`).

Every key is pinned to the exact string older ratchet versions wrote, so run folders of
older runs still read; the code that writes a run folder takes its keys from RunLayout.
Manifests written by older versions, in each of the two stored shapes (a checkpoint's
`MANIFEST.json` with `"size"`, a model folder's `manifest.json` with `"bytes"`), still
parse and verify, and the writers still write exactly those shapes. Local folders and
fsspec's in-memory store; no Ray, no torch model."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import pytest

from ratchet.storage.batch_store import BatchStore
from ratchet.storage.checkpoint_store import CheckpointStore, CorruptCheckpoint
from ratchet.storage.metrics_log import MetricsLog
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout
from ratchet.storage.keys import check_key
from ratchet.storage.manifest import CHECKPOINT, MODEL, BadManifest, FileEntry, Manifest

# Every key as the old code spelled it (a literal at its call site).
OLD_KEYS = {
    "DEFAULT_ROOT": ".ratchet/runs",
    "CONFIG": "config.json",
    "METRICS": "metrics.jsonl",
    "TRACKING": "tracking.json",
    "LINEAGE": "lineage.json",
    "BATCHES": "batches",
    "EVALS": "evals",
    "TRAIN_LOG": "train_log",
    "POLICY_LOG": "policy_log",
    "WARMUP_MODEL": "warmup/model",
    "WARMUP_LOSSES": "warmup/losses.json",
    "FINAL_MODEL": "final/model",
    "MODEL_MANIFEST": "manifest.json",
    "CHECKPOINTS": "checkpoints",
    "CHECKPOINT_MANIFEST": "MANIFEST.json",
    "CHECKPOINT_RETIRED": "RETIRED.json",
    "RUN_STATE": "run_state.json",
    "TRAINER_STATE": "trainer",
    "TRAINER_META": "trainer_meta.json",
    "CHECKPOINT_HF": "hf",
    "CRITIC_STATE": "critic/critic.safetensors",
    "CRITIC_META": "critic/critic.json",
}

BUILT_KEYS = {
    RunLayout.batch_step(RunLayout.BATCHES, 12): "batches/step-000012",
    RunLayout.batch_part(RunLayout.BATCHES, 12, "rollout-1"): "batches/step-000012/rollout-1.safetensors",
    RunLayout.batch_part(RunLayout.EVALS, 0, "scores"): "evals/step-000000/scores.safetensors",
    RunLayout.train_log(3): "train_log/v00000003.json",
    RunLayout.policy_log(17): "policy_log/v00000017.safetensors",
    RunLayout.checkpoint_name(120): "step-00000120",
    RunLayout.checkpoint("step-00000120"): "checkpoints/step-00000120",
    RunLayout.checkpoint("step-00000120", RunLayout.RUN_STATE): "checkpoints/step-00000120/run_state.json",
}


def test_every_key_is_the_old_literal():
    constants = {k: v for k, v in vars(RunLayout).items() if k.isupper()}
    assert constants == OLD_KEYS  # a new key is added here, with its string, on purpose
    for built, old in BUILT_KEYS.items():
        assert built == old


def test_every_key_stays_under_the_run_folder(tmp_path):
    run = ObjectStore(str(tmp_path)).child("run-1")
    keys = [v for k, v in OLD_KEYS.items() if k != "DEFAULT_ROOT"] + list(BUILT_KEYS.values())
    for key in keys:
        assert check_key(key, allow_empty=False) == key
        assert Path(run.path(key)).resolve().is_relative_to(Path(run.root).resolve()), key


def test_builders_refuse_what_is_not_a_step_or_version():
    assert RunLayout.policy_log_version(RunLayout.policy_log(42)) == 42
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="must be an integer >= 0"):
            RunLayout.train_log(bad)
        with pytest.raises(ValueError, match="batch index"):
            RunLayout.batch_step(RunLayout.BATCHES, bad)


def test_stores_and_workers_use_the_layout(tmp_path):
    from ratchet.storage import checkpoint_store
    from ratchet.workers import hf_io

    store = ObjectStore(str(tmp_path))
    assert CheckpointStore(store).prefix == "checkpoints" and checkpoint_store.MANIFEST == "MANIFEST.json"
    assert MetricsLog(store).key == "metrics.jsonl" and hf_io.MANIFEST == "manifest.json"
    assert BatchStore(store).key(5, "values") == "batches/step-000005/values.safetensors"
    assert BatchStore(store, RunLayout.EVALS).batch_key(5) == "evals/step-000005"


# --------------------------------------------------------------------------- old checkpoint manifests


def _old_checkpoint(store: ObjectStore, name: str, files: dict[str, bytes]) -> dict:
    """A checkpoint as the code before `Manifest` committed it, manifest byte for byte."""
    for rel, data in files.items():
        store.put_bytes(f"checkpoints/{name}/{rel}", data)
    manifest = {
        "format": "ratchet-checkpoint/1",
        "name": name,
        "step": 2,
        "created": "2025-01-01T00:00:00.000000Z",
        "total_bytes": sum(len(d) for d in files.values()),
        "files": {rel: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for rel, d in files.items()},
        "meta": {"step": 2, "policy_version": 2, "world_size": 1},
    }
    store.put_bytes(f"checkpoints/{name}/MANIFEST.json", json.dumps(manifest, indent=1, sort_keys=True).encode())
    return manifest


CKPT_FILES = {
    "run_state.json": b'{"next_step": 3}',
    "trainer/trainer_meta.json": b'{"format": "ratchet-trainer-state/1"}',
    "hf/config.json": b"{}",
    "critic/critic.json": b'{"version": 2}',
}


def test_old_checkpoint_manifest_still_reads_and_verifies(tmp_path):
    store = ObjectStore(str(tmp_path / "run"))
    old = _old_checkpoint(store, "step-00000002", CKPT_FILES)
    ckpts = CheckpointStore(store)
    info = ckpts.latest()
    assert info is not None and info.name == "step-00000002" and info.step == 2
    assert info.files == old["files"] and info.total_bytes == old["total_bytes"] and info.meta == old["meta"]
    assert ckpts.problems(info.name) == []
    assert ckpts.read_files(info.name, [RunLayout.RUN_STATE]) == {"run_state.json": b'{"next_step": 3}'}
    ckpts.download(info.name, tmp_path / "local")
    assert (tmp_path / "local" / "critic" / "critic.json").read_bytes() == b'{"version": 2}'
    assert json.loads((tmp_path / "local" / "MANIFEST.json").read_bytes()) == old  # kept as stored
    store.put_bytes("checkpoints/step-00000002/hf/config.json", b"{ }")  # one byte more
    store.put_bytes("checkpoints/step-00000002/run_state.json", b'{"next_step": 4}')  # same size, other bytes
    problems = ckpts.problems(info.name)
    assert problems[0] == "hf/config.json: 3 bytes, manifest says 2"
    assert problems[1].startswith("run_state.json: sha256 ") and "differs from the manifest's" in problems[1]
    with pytest.raises(CorruptCheckpoint, match="run_state.json: sha256"):
        ckpts.read_files(info.name, [RunLayout.RUN_STATE])


def test_checkpoint_manifest_is_written_in_the_old_shape(tmp_path):
    local = tmp_path / "local"
    for rel, data in CKPT_FILES.items():
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(data)
    store = ObjectStore(str(tmp_path / "run"))
    CheckpointStore(store).commit("step-00000002", local, {"step": 2})
    written = store.get_json("checkpoints/step-00000002/MANIFEST.json")
    assert set(written) == {"format", "name", "step", "created", "total_bytes", "files", "meta"}
    assert written["format"] == "ratchet-checkpoint/1" and written["total_bytes"] == sum(map(len, CKPT_FILES.values()))
    assert written["files"] == {r: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for r, d in CKPT_FILES.items()}


# --------------------------------------------------------------------------- old model manifests


MODEL_FILES = {"config.json": b'{"model_type": "tiny"}', "model.safetensors": b"\x00" * 64, "tokenizer.json": b"{}"}


def _old_model(store: ObjectStore, key: str) -> dict:
    """A model folder as `save_hf` wrote it before `Manifest`."""
    for name, data in MODEL_FILES.items():
        store.put_bytes(f"{key}/{name}", data)
    manifest = {"files": {n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in MODEL_FILES.items()}}
    store.put_json(f"{key}/manifest.json", manifest)
    return manifest


def test_old_model_manifest_still_downloads_and_verifies(tmp_path):
    from ratchet.workers.hf_io import CorruptModel, cached_ok, local_hf_path

    store = ObjectStore(f"memory://ratchet-layout-{uuid.uuid4().hex}")  # not local: goes through the manifest
    old = _old_model(store, RunLayout.WARMUP_MODEL)
    uri = store.uri(RunLayout.WARMUP_MODEL)
    folder = Path(local_hf_path(uri, cache_dir=str(tmp_path / "cache")))
    assert {n: (folder / n).read_bytes() for n in MODEL_FILES} == MODEL_FILES
    assert json.loads((folder / "manifest.json").read_bytes()) == old
    assert cached_ok(folder, old["files"]) and cached_ok(folder, Manifest.parse(json.dumps(old), MODEL))
    store.put_bytes(f"{RunLayout.WARMUP_MODEL}/model.safetensors", b"\x01" * 64)  # same size, other bytes
    with pytest.raises(CorruptModel, match="model.safetensors: sha256 does not match the manifest"):
        local_hf_path(uri, cache_dir=str(tmp_path / "other-cache"))


def test_model_manifest_is_written_in_the_old_shape():
    files = {n: FileEntry.of_bytes(d) for n, d in MODEL_FILES.items()}
    assert Manifest(files).to_json(MODEL) == {
        "files": {n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in MODEL_FILES.items()}
    }


# --------------------------------------------------------------------------- one parser


def test_parse_reads_either_shape_and_checks_names():
    entry = {"sha256": "ab" * 32}
    for kind in (CHECKPOINT, MODEL):
        for size_key in ("size", "bytes"):
            parsed = Manifest.parse(json.dumps({"files": {"config.json": {**entry, size_key: 7}}}), kind)
            assert parsed.files == {"config.json": FileEntry(7, "ab" * 32)} and parsed.total_bytes == 7
        both = {"files": {"config.json": {**entry, "size": 7, "bytes": 8}}}  # two lengths that disagree
        for bad in [both, {"files": {"a": {**entry, "size": -1}}}, {"files": {"a": {**entry, "size": True}}}]:
            with pytest.raises(BadManifest, match="lacks an integer 'size'"):
                Manifest.parse(bad, kind)
        with pytest.raises(BadManifest, match="lacks an integer 'size'"):
            Manifest.parse({"files": {"a": {"size": 1}}}, kind)  # no sha256
        for evil in ["../x", "/etc/hostname", "a/../../x", "a\\x", "", kind.file_name]:
            with pytest.raises(BadManifest, match="manifest path"):
                Manifest.parse({"files": {evil: {**entry, "size": 1}}}, kind)
        with pytest.raises(BadManifest, match="not valid JSON"):
            Manifest.parse(b"{not json", kind)
        with pytest.raises(BadManifest, match="lacks a field"):
            Manifest.parse({"format": "x"}, kind)
    # a checkpoint lists relative paths; a model folder plain file names only
    assert list(Manifest.parse({"files": {"trainer/a.bin": {**entry, "size": 1}}}, CHECKPOINT).files) == ["trainer/a.bin"]
    with pytest.raises(BadManifest, match="outside the model folder"):
        Manifest.parse({"files": {"trainer/a.bin": {**entry, "size": 1}}}, MODEL)


def test_problem_names_size_and_sha256():
    m = Manifest({"a": FileEntry.of_bytes(b"abc")})
    assert m.problem_of_bytes("a", b"abc") is None and m.problem("a", 3) is None
    assert m.problem("a", 4) == "a: 4 bytes, manifest says 3"
    assert m.problem_of_bytes("a", b"abd").startswith("a: sha256 ")
    assert m.problem("b", 3) == "b: not in the manifest"
