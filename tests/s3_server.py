"""A real S3-protocol server for tests: moto in server mode on 127.0.0.1, a fresh bucket
per test, and the AWS_* variables that ObjectStore reads (set with monkeypatch).

Import the fixtures into a test module: `from tests.s3_server import moto_server, s3_env  # noqa`.
"""

from __future__ import annotations

import logging
import socket
import uuid
from dataclasses import dataclass

import pytest

ACCESS_KEY = "AKIARATCHETTESTKEY01"
SECRET_KEY = "ratchet-test-secret-Zq8vN3xK0pL7wR2m"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """moto's threaded server; `stop()`/`start()` on the same port simulate an outage
    (moto's state lives in the process, so buckets and objects survive a restart)."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        self._cls = ThreadedMotoServer
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = None

    def start(self) -> None:
        self._server = self._cls(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


@pytest.fixture(scope="module")
def moto_server():
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = MotoServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class S3Env:
    server: MotoServer
    bucket: str

    def client(self):
        from minio import Minio

        return Minio(f"127.0.0.1:{self.server.port}", access_key=ACCESS_KEY, secret_key=SECRET_KEY, secure=False, region=REGION)


def _clear_s3fs_cache() -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_env(moto_server, monkeypatch):
    """Environment pointing at the moto server, and a fresh bucket."""
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    _clear_s3fs_cache()
    env = S3Env(moto_server, f"ratchet-{uuid.uuid4().hex[:16]}")
    env.client().make_bucket(env.bucket)
    try:
        yield env
    finally:
        _clear_s3fs_cache()


def store_url(backend: str, tmp_path, env: S3Env | None, prefix: str = "run") -> str:
    """The root URL of a store on `backend` ("file", "s3" or "minio")."""
    if backend == "file":
        return str(tmp_path / "store" / prefix)
    assert env is not None
    return f"{backend}://{env.bucket}/{prefix}"
