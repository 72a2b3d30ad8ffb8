"""ObjectStore on S3-protocol storage (moto in server mode), through `s3://` (s3fs) and
`minio://` (the minio client), plus what applies to every backend: streamed multipart
uploads, resumable downloads, retries on transient errors, and credentials that stay out
of logs, exceptions and pickles."""

from __future__ import annotations

import hashlib
import logging
import pickle
import threading
import time
import traceback

import pytest

from ratchet.storage.object_store import ObjectStore, StoreUnavailable
from ratchet.storage.s3_env import StorageConfigError
from tests.s3_server import ACCESS_KEY, SECRET_KEY, moto_server, s3_env, store_url  # noqa: F401

MiB = 1 << 20
FAST_RETRY = dict(retry_timeout_s=5.0, retry_initial_s=0.05, retry_max_s=0.2)


@pytest.fixture(params=["file", "s3", "minio"])
def backend(request):
    return request.param


@pytest.fixture
def store(backend, request, tmp_path):
    env = request.getfixturevalue("s3_env") if backend != "file" else None
    return ObjectStore(store_url(backend, tmp_path, env), part_size=5 * MiB, **FAST_RETRY)


@pytest.fixture(params=["s3", "minio"])
def remote(request, s3_env, tmp_path):
    """A store on the moto server, and the server (to stop it)."""
    return ObjectStore(store_url(request.param, tmp_path, s3_env), part_size=5 * MiB, **FAST_RETRY), s3_env


def random_bytes(n: int, seed: int) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


def open_uploads(env) -> list:
    """Multipart uploads still open in the test bucket (an aborted one is gone)."""
    import s3fs

    fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, client_kwargs={"endpoint_url": env.server.endpoint}, skip_instance_cache=True)
    return fs.call_s3("list_multipart_uploads", Bucket=env.bucket).get("Uploads", [])


# --------------------------------------------------------------------------- the old API, remotely


def test_small_object_api_matches_local(remote):
    store, env = remote
    assert store.put_bytes("a/b/blob.bin", b"\x00\x01hello") == f"{store.protocol}://{env.bucket}/run/a/b/blob.bin"
    assert store.get_bytes("a/b/blob.bin") == b"\x00\x01hello"
    obj = {"step": 3, "values": [1.5, None, "x"], "nested": {"ü": True}}
    store.put_json("meta.json", obj)
    assert store.get_json("meta.json") == obj
    assert store.exists("meta.json") and store.exists("a/b/blob.bin") and store.exists("a")
    assert not store.exists("nope") and not store.exists("a/b/blob")
    assert store.list() == ["a/b/blob.bin", "meta.json"]
    assert store.list("a") == ["a/b/blob.bin"]
    assert store.list("missing/prefix") == []
    store.put_bytes("a/b/blob.bin", b"second, longer")  # overwrite
    assert store.get_bytes("a/b/blob.bin") == b"second, longer"
    assert store.size("a/b/blob.bin") == 14
    child = store.child("a")
    assert child.url == f"{store.protocol}://{env.bucket}/run/a" and child.list() == ["b/blob.bin"]
    with pytest.raises(FileNotFoundError):
        store.get_bytes("nope")
    store.delete("a/b/blob.bin")
    assert store.list() == ["meta.json"]
    store.put_bytes("d/x", b"1")
    store.put_bytes("d/y/z", b"2")
    store.delete("d")
    assert store.list() == ["meta.json"]
    store.delete("never-existed")  # no error


def test_a_store_from_another_process_sees_new_objects(remote):
    """No listing cache: what another writer commits is visible at once."""
    store, env = remote
    assert store.list("ckpt") == []
    other = ObjectStore(store.url)
    other.put_bytes("ckpt/new", b"1")
    assert store.list("ckpt") == ["ckpt/new"] and store.exists("ckpt/new")


# --------------------------------------------------------------------------- large files


class RecordingReader:
    """A file-like source that records its read sizes, and can fail after `fail_after` bytes."""

    def __init__(self, data: bytes, fail_after: int | None = None):
        self.data, self.pos, self.fail_after, self.reads = data, 0, fail_after, []

    def read(self, n: int = -1) -> bytes:
        self.reads.append(n)
        if self.fail_after is not None and self.pos >= self.fail_after:
            raise OSError("disk read error (simulated)")
        n = len(self.data) - self.pos if n < 0 else n
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out

    def seekable(self) -> bool:
        return False


def test_put_file_streams_in_parts_and_round_trips(store, tmp_path):
    data = random_bytes(12 * MiB + 123, seed=1)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    t = store.put_file("big/model.safetensors", src)
    assert (t.size, t.sha256, t.transferred) == (len(data), hashlib.sha256(data).hexdigest(), len(data))
    assert t.uri == store.uri("big/model.safetensors")
    assert store.size("big/model.safetensors") == len(data)
    assert store.sha256("big/model.safetensors") == (len(data), t.sha256)
    got = store.get_file("big/model.safetensors", tmp_path / "out" / "model.safetensors")
    assert (got.size, got.sha256, got.transferred) == (len(data), t.sha256, len(data))
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == data
    assert not (tmp_path / "out" / "model.safetensors.part").exists()
    # never the whole file in memory: reads of at most one part
    reader = RecordingReader(data)
    store.put_stream("big/streamed.bin", reader, len(data))
    assert max(reader.reads) <= 5 * MiB and len(reader.reads) >= 3
    assert store.sha256("big/streamed.bin")[1] == t.sha256


def test_empty_file(store, tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    t = store.put_file("e/empty", tmp_path / "empty")
    assert (t.size, t.sha256) == (0, hashlib.sha256(b"").hexdigest())
    assert store.get_file("e/empty", tmp_path / "back").size == 0 and (tmp_path / "back").read_bytes() == b""


def test_upload_failing_midway_leaves_no_object(store, request):
    store.put_bytes("ckpt/state.bin", b"OLD-" * 100)
    data = random_bytes(12 * MiB, seed=2)
    for key in ("ckpt/state.bin", "ckpt/fresh.bin"):
        with pytest.raises(OSError, match="simulated"):
            store.put_stream(key, RecordingReader(data, fail_after=7 * MiB), len(data))
    assert store.get_bytes("ckpt/state.bin") == b"OLD-" * 100
    assert not store.exists("ckpt/fresh.bin")
    assert store.list() == ["ckpt/state.bin"]
    if store.protocol != "file":
        assert open_uploads(request.getfixturevalue("s3_env")) == []  # aborted, not left open


def test_get_file_resumes_from_a_partial_file(store, tmp_path, monkeypatch):
    data = random_bytes(12 * MiB + 7, seed=3)
    store.put_bytes("m/shard.bin", data)
    target = tmp_path / "dl" / "shard.bin"
    target.parent.mkdir()
    (tmp_path / "dl" / "shard.bin.part").write_bytes(data[: 5 * MiB])  # an earlier, interrupted download
    starts = []
    real = store._backend.iter_range

    def spy(path, start, end, chunk):
        starts.append((start, end))
        return real(path, start, end, chunk)

    monkeypatch.setattr(store._backend, "iter_range", spy)
    t = store.get_file("m/shard.bin", target)
    assert starts == [(5 * MiB, len(data))]  # only the rest was requested
    assert t.transferred == len(data) - 5 * MiB
    assert t.sha256 == hashlib.sha256(data).hexdigest()  # covers the bytes that were already on disk
    assert target.read_bytes() == data


def test_get_file_interrupted_resumes_in_the_retry(store, tmp_path, monkeypatch, caplog):
    data = random_bytes(12 * MiB, seed=4)
    store.put_bytes("m/shard.bin", data)
    starts, first = [], []
    real = store._backend.iter_range

    def flaky(path, start, end, chunk):
        starts.append(start)
        it = real(path, start, end, chunk)
        if len(starts) == 1:  # the first attempt: one chunk, then the connection drops
            first.append(next(it))
            yield first[0]
            it.close()
            raise ConnectionResetError("connection reset by peer (simulated)")
        yield from it

    monkeypatch.setattr(store._backend, "iter_range", flaky)
    with caplog.at_level(logging.WARNING, logger="ratchet.storage.object_store"):
        t = store.get_file("m/shard.bin", tmp_path / "shard.bin")
    assert starts == [0, len(first[0])] and 0 < len(first[0]) <= 5 * MiB  # the retry went on after the written chunk
    assert t.transferred == len(data) and t.sha256 == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "shard.bin").read_bytes() == data
    assert sum("retry 1" in r.getMessage() for r in caplog.records) == 1


def test_partial_file_longer_than_the_object_starts_over(store, tmp_path):
    store.put_bytes("k", b"short")
    (tmp_path / "k.part").write_bytes(b"something much longer than the object")
    t = store.get_file("k", tmp_path / "k")
    assert (tmp_path / "k").read_bytes() == b"short" and t.transferred == 5


# --------------------------------------------------------------------------- retries


@pytest.mark.slow
def test_outage_within_the_retry_window_is_survived(remote, caplog):
    store, env = remote
    store.put_bytes("before", b"0")
    env.server.stop()
    restart = threading.Timer(2.0, env.server.start)
    restart.start()
    t0 = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="ratchet.storage.object_store"):
            outage_store = ObjectStore(store.url, retry_timeout_s=20, retry_initial_s=0.2, retry_max_s=1.0)
            outage_store.put_bytes("during", b"written while the server was down")
    finally:
        restart.join()
    assert time.monotonic() - t0 >= 1.9
    retries = [r for r in caplog.records if "retry" in r.getMessage()]
    assert retries and all(r.levelno == logging.WARNING for r in retries)
    assert store.get_bytes("during") == b"written while the server was down"
    assert store.list() == ["before", "during"]  # moto's state outlives the restart in this process


def test_outage_past_the_retry_window_raises_a_clear_error(remote):
    store, env = remote
    env.server.stop()
    try:
        short = ObjectStore(store.url, retry_timeout_s=1.0, retry_initial_s=0.1, retry_max_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="retry_timeout_s") as err:
            short.put_bytes("k", b"x")
        assert time.monotonic() - t0 < 8
        assert short.uri("k") in str(err.value)
    finally:
        env.server.start()


def test_default_policy_survives_a_30_s_outage(tmp_path, monkeypatch):
    """On a simulated clock: every attempt fails for 30 s, then the store answers."""
    store = ObjectStore(str(tmp_path))
    clock = [1000.0]
    attempts = []
    real_put = store._backend.put_bytes

    def put(path, data):
        attempts.append(clock[0])
        if clock[0] - 1000.0 < 30.0:
            raise ConnectionRefusedError("connection refused (simulated outage)")
        real_put(path, data)

    monkeypatch.setattr(store._backend, "put_bytes", put)
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    store.put_bytes("k", b"v")
    monkeypatch.undo()
    assert store.get_bytes("k") == b"v"
    assert 30.0 <= attempts[-1] - 1000.0 <= 30.0 + 8.5  # recovered within one max backoff
    assert 5 <= len(attempts) <= 15  # exponential, not a busy loop
    gaps = [b - a for a, b in zip(attempts, attempts[1:])]
    assert gaps[1] > gaps[0] and max(gaps) <= 8.0 + 0.25


def test_other_errors_are_not_retried(tmp_path, monkeypatch):
    store = ObjectStore(str(tmp_path))
    calls = []

    def denied(path):
        calls.append(path)
        raise PermissionError("access denied")

    monkeypatch.setattr(store._backend, "get_bytes", denied)
    with pytest.raises(PermissionError):
        store.get_bytes("k")
    assert len(calls) == 1
    with pytest.raises(FileNotFoundError):
        ObjectStore(str(tmp_path)).get_bytes("missing")


def test_injected_transient_errors_are_retried(tmp_path, monkeypatch):
    store = ObjectStore(str(tmp_path), retry_initial_s=0.01, retry_max_s=0.02)
    calls = []
    real = store._backend.put_bytes

    def flaky(path, data):
        calls.append(path)
        if len(calls) < 3:
            raise TimeoutError("read timed out (simulated)")
        real(path, data)

    monkeypatch.setattr(store._backend, "put_bytes", flaky)
    store.put_bytes("k", b"v")
    assert len(calls) == 3 and store.get_bytes("k") == b"v"


# --------------------------------------------------------------------------- configuration and secrets


def test_missing_or_bad_environment_names_the_variable(s3_env, monkeypatch):
    url = f"minio://{s3_env.bucket}/run"
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    with pytest.raises(StorageConfigError, match="AWS_ENDPOINT_URL"):
        ObjectStore(url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "ftp://127.0.0.1:1")
    with pytest.raises(StorageConfigError, match="AWS_ENDPOINT_URL_S3 must look like http"):
        ObjectStore(url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://user:{SECRET_KEY}@127.0.0.1:1")
    with pytest.raises(StorageConfigError, match="must not embed credentials") as err:
        ObjectStore(url)
    assert SECRET_KEY not in str(err.value)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_env.server.endpoint)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StorageConfigError, match="AWS_SECRET_ACCESS_KEY is not set"):
        ObjectStore(url)
    with pytest.raises(StorageConfigError, match="AWS_SECRET_ACCESS_KEY is not set"):
        ObjectStore(f"s3://{s3_env.bucket}/run")  # a key without its secret
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    with pytest.raises(StorageConfigError, match="AWS_ACCESS_KEY_ID is not set"):
        ObjectStore(url)  # minio needs keys; s3 may use botocore's other sources
    with pytest.raises(ValueError, match="needs a bucket"):
        ObjectStore("minio://")


def test_s3_without_any_credentials_names_the_variables(s3_env, monkeypatch, tmp_path):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", raising=False)
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", raising=False)
    with pytest.raises(StorageConfigError, match="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        ObjectStore(f"s3://{s3_env.bucket}/run", **FAST_RETRY).put_bytes("k", b"v")


def test_https_endpoint_means_tls(s3_env, monkeypatch):
    from ratchet.storage.minio_backend import MinioBackend

    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://storage.example:9000")
    backend = MinioBackend("minio://b/p", part_size=5 * MiB, concurrency=2)
    assert backend._client._base_url.is_https and repr(backend) == "MinioBackend(https://storage.example:9000)"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://storage.example:9000")
    assert not MinioBackend("minio://b/p", part_size=5 * MiB, concurrency=2)._client._base_url.is_https


@pytest.mark.slow
def test_secrets_stay_out_of_logs_exceptions_and_pickles(remote, tmp_path, caplog):
    store, env = remote
    caplog.set_level(logging.DEBUG)  # every logger, every level, the client libraries' too
    errors: list[BaseException] = []
    (tmp_path / "f.bin").write_bytes(random_bytes(6 * MiB, seed=5))
    store.put_file("f.bin", tmp_path / "f.bin")
    store.get_file("f.bin", tmp_path / "back.bin")
    for op in (lambda: store.get_bytes("missing"), lambda: store.size("missing")):
        with pytest.raises(FileNotFoundError) as err:
            op()
        errors.append(err.value)
    env.server.stop()
    try:
        short = ObjectStore(store.url, retry_timeout_s=1.5, retry_initial_s=0.1, retry_max_s=0.2)
        with pytest.raises(StoreUnavailable) as err:
            short.put_bytes("k", b"x")
        errors.append(err.value)
    finally:
        env.server.start()
    texts = [r.getMessage() + (r.exc_text or "") for r in caplog.records]
    texts += ["".join(traceback.format_exception(e)) + repr(e) for e in errors]
    assert any("retry" in t for t in texts)  # the retries were logged...
    assert not [t for t in texts if SECRET_KEY in t]  # ...without the secret, anywhere
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("ratchet")]
    assert ours and not [t for t in ours if ACCESS_KEY in t]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and ACCESS_KEY in r.getMessage()]
    for e in errors:
        assert ACCESS_KEY not in "".join(traceback.format_exception(e))
    assert SECRET_KEY not in repr(store) and ACCESS_KEY not in repr(store) and SECRET_KEY not in repr(store._backend)
    blob = pickle.dumps(store)
    assert SECRET_KEY.encode() not in blob and ACCESS_KEY.encode() not in blob
    assert pickle.loads(blob).get_bytes("f.bin") == (tmp_path / "f.bin").read_bytes()


def test_a_secret_in_a_library_error_is_withheld(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    store = ObjectStore(str(tmp_path))

    def leaky(path):
        raise ValueError(f"signature mismatch for secret {SECRET_KEY}")

    monkeypatch.setattr(store._backend, "get_bytes", leaky)
    with pytest.raises(OSError) as err:
        store.get_bytes("k")
    text = "".join(traceback.format_exception(err.value))
    assert SECRET_KEY not in text and "***" in text and err.value.__cause__ is None
