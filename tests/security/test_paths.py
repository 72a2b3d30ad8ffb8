"""Keys, run ids and checkpoint names never reach outside the store's root.

Before: `ObjectStore(root).child("../../../../etc").get_bytes("hostname")` read
/etc/hostname, and any key with `..` read or wrote outside the root. Now every key-taking
method refuses a `..` or `.` segment, an absolute key, a backslash, a NUL or an empty
segment (UnsafeKey), `child()` of one segment wants a valid run id, and checkpoint names
and manifest file names are checked. Local folders and the moto S3 server (s3:// through
s3fs and minio:// through the minio client). A Python audit hook records every file this
process opens, to prove nothing under /etc (or outside the root) is touched.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from ratchet.ids import InvalidId
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.checkpoint_store import CheckpointStore, CorruptCheckpoint
from ratchet.storage.metrics_log import MetricsLog
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.keys import UnsafeKey
from ratchet.storage.checkpoint_store import MANIFEST
from tests.s3_server import moto_server, s3_env, store_url  # noqa: F401

OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, Path)):
        OPENED.append(str(args[0]))


sys.addaudithook(_audit)  # cannot be removed; records only while OPENED is a list


@pytest.fixture
def opened():
    global OPENED
    OPENED = []
    try:
        yield OPENED
    finally:
        OPENED = None


BAD_KEYS = [
    "../escaped.bin",
    "a/../../escaped.bin",
    "../../../../etc/hostname",
    "/etc/hostname",
    "a\\..\\..\\escaped.bin",
    "a\x00b",
    "a//b",
    "a/",
    "./a",
    "a/./b",
]


@pytest.fixture(params=["file", "s3", "minio"])
def store(request, tmp_path) -> ObjectStore:
    env = request.getfixturevalue("s3_env") if request.param != "file" else None
    return ObjectStore(store_url(request.param, tmp_path, env), retry_timeout_s=2, retry_initial_s=0.05, retry_max_s=0.1)


def outside_files(tmp_path: Path, root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and not p.is_relative_to(root)}


def test_child_refuses_traversal_and_etc_is_never_read(tmp_path, opened):
    store = ObjectStore(str(tmp_path / "runs"))
    for bad in ["../../../../etc", "..", ".", "", "a/../../etc", "/etc", "run\\..", "r u n", "-x"]:
        with pytest.raises(ValueError) as err:
            store.child(bad)
        assert isinstance(err.value, (InvalidId, UnsafeKey)) and repr(bad) in str(err.value)
    assert store.child("run-1").url == str(tmp_path / "runs" / "run-1")
    assert store.child("run-1/sub").url == str(tmp_path / "runs" / "run-1" / "sub")  # deeper keys pass check_key
    assert not any(p.startswith("/etc") for p in opened), opened


def every_key_method(store: ObjectStore, key: str, tmp_path: Path):
    """One call per key-taking method of ObjectStore."""
    src = tmp_path / "src.bin"
    src.write_bytes(b"payload")
    return [
        lambda: store.put_bytes(key, b"x"),
        lambda: store.get_bytes(key),
        lambda: store.put_json(key, {"a": 1}),
        lambda: store.get_json(key),
        lambda: store.exists(key),
        lambda: store.size(key),
        lambda: store.modified(key),
        lambda: store.list(key),
        lambda: store.delete(key),
        lambda: store.put_file(key, src),
        lambda: store.put_stream(key, io.BytesIO(b"abc"), 3),
        lambda: store.get_file(key, tmp_path / "dl" / "out.bin"),
        lambda: store.sha256(key),
        lambda: store.uri(key),
        lambda: store.path(key),
        lambda: store.clean_leftovers(key),
    ]


def test_every_method_refuses_unsafe_keys(store, tmp_path, opened):
    root = tmp_path / "store" / "run"
    (tmp_path / "escaped.bin").write_bytes(b"outside")  # what a traversal would read or overwrite
    store.put_bytes("inside.bin", b"inside")
    before = outside_files(tmp_path, root)
    if store.protocol != "file":  # an object beside the run's prefix, in the same bucket
        sibling = ObjectStore(store.url.rsplit("/", 1)[0])
        sibling.put_bytes("escaped.bin", b"outside")
    for key in BAD_KEYS:
        for call in every_key_method(store, key, tmp_path):
            with pytest.raises(UnsafeKey) as err:
                call()
            assert repr(key) in str(err.value)
    assert not any(p.startswith("/etc") for p in opened), [p for p in opened if p.startswith("/etc")]
    after = outside_files(tmp_path, root)
    after.pop(str(tmp_path / "src.bin"), None)
    assert after == before  # nothing written (or removed) outside the root
    assert not (tmp_path / "dl").exists()
    assert store.list() == ["inside.bin"]
    if store.protocol != "file":
        assert sibling.list() == ["escaped.bin", "run/inside.bin"] and sibling.get_bytes("escaped.bin") == b"outside"


def test_backends_refuse_traversal_too(store):
    """The second guard: a backend given a full path with `..` refuses it."""
    backend = store._backend
    for call in (
        lambda: backend.get_bytes(f"{store.root}/../escaped.bin"),
        lambda: backend.put_bytes(f"{store.root}/../escaped.bin", b"x"),
        lambda: backend.find(f"{store.root}/.."),
        lambda: backend.delete(f"{store.root}/a/../.."),
        lambda: backend.size(f"{store.root}\\..\\x"),
    ):
        with pytest.raises(UnsafeKey):
            call()


def make_checkpoint(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.safetensors").write_bytes(b"weights" * 100)
    (root / "run_state.json").write_text('{"step": 1}')
    return root


def test_checkpoint_names_are_checked_at_every_entry(store, tmp_path):
    ckpts = CheckpointStore(store)
    ckpts.commit("step-00000001", make_checkpoint(tmp_path / "c"), {"step": 1})
    for bad in ["../step-00000001", "..", "a/b", "/abs", "x\\y", "", ".hidden", "step.tmp-1"]:
        for call in (
            lambda: ckpts.get(bad),
            lambda: ckpts.verify(bad),
            lambda: ckpts.download(bad, tmp_path / "out"),
            lambda: ckpts.retire(bad),
            lambda: ckpts.read_files(bad, ["run_state.json"]),
            lambda: ckpts.commit(bad, tmp_path / "c", {}),
            lambda: ckpts.delete(bad),
        ):
            with pytest.raises(ValueError, match="checkpoint name"):
                call()
    with pytest.raises(UnsafeKey):
        ckpts.read_files("step-00000001", ["../../config.json"])
    assert [c.name for c in ckpts.list()] == ["step-00000001"] and ckpts.verify("step-00000001")


def test_crafted_manifest_cannot_reach_outside(store, tmp_path, opened):
    """A manifest listing `../../x` (a tampered store) is a corrupted checkpoint: nothing is
    read from or written to a path outside the checkpoint, locally or in the store."""
    ckpts = CheckpointStore(store)
    info = ckpts.commit("step-00000001", make_checkpoint(tmp_path / "c"), {"step": 1})
    store.put_bytes("x", b"a run file beside checkpoints/")
    manifest = store.get_json(f"checkpoints/step-00000001/{MANIFEST}")
    entry = next(iter(info.files.values()))
    for evil in ["../../x", "/etc/hostname", "a/../../../x", "..\\..\\x"]:
        manifest["files"] = {evil: entry}
        store.put_json(f"checkpoints/step-00000001/{MANIFEST}", manifest)
        dest = tmp_path / "restore" / "deep" / "dest"
        with pytest.raises(CorruptCheckpoint, match="outside the checkpoint folder"):
            ckpts.download("step-00000001", dest)
        assert not ckpts.verify("step-00000001")
        assert ckpts.list() == [] and ckpts.latest() is None
        assert not (tmp_path / "restore" / "x").exists() and not (tmp_path / "restore" / "deep" / "x").exists()
        assert not any(p.endswith("/x") or p.startswith("/etc") for p in opened), opened
    assert store.get_bytes("x") == b"a run file beside checkpoints/"


def test_batch_and_metrics_keys(store):
    batches = BatchStore(store)
    for bad in ["../../x", "a/b", "..", ""]:
        with pytest.raises(UnsafeKey):
            batches.read(1, bad)
        with pytest.raises(UnsafeKey):
            batches.has(1, bad)
    for step in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="batch index"):
            batches.has(step, "rollout")
    with pytest.raises(UnsafeKey):
        BatchStore(store, kind="../other")
    with pytest.raises(UnsafeKey):
        MetricsLog(store, key="../metrics.jsonl")
    MetricsLog(store, clock=lambda: 0.0).write(1, {"loss": 0.5})
    assert MetricsLog(store).read() == [{"step": 1, "loss": 0.5, "time_unix": 0.0, "time_utc": "1970-01-01T00:00:00.000+00:00"}]
