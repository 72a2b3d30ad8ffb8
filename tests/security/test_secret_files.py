"""Secrets read from mounted files, so that deploy/ keeps them out of every environment.

Before: the S3 keys, the registry URL (with its password) and the Temporal API key could
only come from environment values, which `docker inspect` and the pod spec show and which
every Ray worker (every actor, and the user code in it) inherits. Now the S3 keys may be
in the AWS credentials file AWS_SHARED_CREDENTIALS_FILE names, and RATCHET_REGISTRY_URL
and RATCHET_TEMPORAL_API_KEY in the file their `_FILE` variable names; a file that is
missing or empty is an error naming the variable and the file, never the value.
"""

from __future__ import annotations

import pytest

from ratchet.platform.temporal_connection import TemporalConnectionError
from ratchet.platform.temporal_connection import from_env as temporal_from_env
from ratchet.registry.urls import RegistryURLError, registry_url
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.s3_env import S3Settings, StorageConfigError, redact
from tests.s3_server import ACCESS_KEY, SECRET_KEY, moto_server, s3_env  # noqa: F401


def _credentials_file(tmp_path, profile: str = "default"):
    path = tmp_path / "s3-credentials"
    path.write_text(f"[{profile}]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    path.chmod(0o600)
    return path


def test_s3_keys_from_the_credentials_file_reach_a_real_server(s3_env, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(_credentials_file(tmp_path)))
    store = ObjectStore(f"minio://{s3_env.bucket}/run", retry_timeout_s=2)  # the minio client needs the keys itself
    store.put_bytes("a.json", b"{}")
    assert store.get_bytes("a.json") == b"{}"
    settings = S3Settings.from_env("s3://b/x", require_endpoint=True, require_keys=True)
    assert (settings.access_key, settings.secret_key) == (ACCESS_KEY, SECRET_KEY)
    assert redact(f"key {ACCESS_KEY} secret {SECRET_KEY}") == "key *** secret ***"  # scrubbed though in no variable


def test_s3_credentials_file_problems_name_the_file(tmp_path, monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    missing = tmp_path / "nope"
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(missing))
    with pytest.raises(StorageConfigError, match=f"AWS_SHARED_CREDENTIALS_FILE names \\(it names {missing}, which does not exist\\)"):
        S3Settings.from_env("s3://b/x", require_endpoint=True, require_keys=True)
    missing.mkdir()  # there, but not a readable file
    with pytest.raises(StorageConfigError, match=f"AWS_SHARED_CREDENTIALS_FILE={missing}: cannot read it"):
        S3Settings.from_env("s3://b/x", require_endpoint=True, require_keys=True)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(_credentials_file(tmp_path, profile="other")))
    with pytest.raises(StorageConfigError, match=r"has no \[default\] section"):
        S3Settings.from_env("s3://b/x", require_endpoint=True, require_keys=True)
    monkeypatch.setenv("AWS_PROFILE", "other")
    assert S3Settings.from_env("s3://b/x", require_endpoint=True, require_keys=True).secret_key == SECRET_KEY
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFROMTHEENVIRONMENT")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-from-the-environment")
    assert S3Settings.from_env("s3://b/x", require_endpoint=True, require_keys=True).secret_key == "secret-from-the-environment"


def test_registry_url_from_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("RATCHET_REGISTRY_URL", raising=False)
    secret = tmp_path / "registry-url"
    secret.write_text("postgresql+psycopg://ratchet:pw-in-a-file@db:5432/registry\n")
    monkeypatch.setenv("RATCHET_REGISTRY_URL_FILE", str(secret))
    assert registry_url() == "postgresql+psycopg://ratchet:pw-in-a-file@db:5432/registry"
    secret.write_text("\n")
    with pytest.raises(RegistryURLError, match=f"RATCHET_REGISTRY_URL_FILE={secret} is empty") as err:
        registry_url()
    assert "pw-in-a-file" not in str(err.value)
    monkeypatch.setenv("RATCHET_REGISTRY_URL", "sqlite:////tmp/x.db")  # the variable wins
    assert registry_url() == "sqlite:////tmp/x.db"


def test_temporal_api_key_from_a_file(tmp_path):
    key = tmp_path / "api-key"
    key.write_text("tmprl-key-from-a-file\n")
    conn = temporal_from_env({"RATCHET_TEMPORAL_API_KEY_FILE": str(key)})
    assert conn.api_key == "tmprl-key-from-a-file" and conn.tls is True
    with pytest.raises(TemporalConnectionError, match="RATCHET_TEMPORAL_API_KEY_FILE=.*cannot read it"):
        temporal_from_env({"RATCHET_TEMPORAL_API_KEY_FILE": str(tmp_path / "missing")})
