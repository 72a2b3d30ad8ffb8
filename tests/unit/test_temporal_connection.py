"""Temporal connection options from the environment (src/ratchet/platform/temporal_connection.py):
what `Client.connect` receives for each combination of variables, and the error, naming the
variable, for each bad one. No network: a real TLS connection through a proxy in front of a
dev server is tests/deploy/test_temporal_tls.py."""

from __future__ import annotations

import logging

import pytest

from ratchet.platform import temporal_connection as tc
from tests.deploy.certs import make_certs

SECRET = "tmprl-api-key-0123456789abcdef"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_no_variables_give_the_plain_call_of_before():
    assert tc.connect_options(env={}) == {"namespace": "default"}
    assert tc.connect_options("research", env={}) == {"namespace": "research"}


def test_namespace_from_either_variable_and_a_conflict_is_refused():
    assert tc.namespace_from_env({"RATCHET_TEMPORAL_NAMESPACE": "prod"}) == "prod"
    assert tc.namespace_from_env({"RATCHET_NAMESPACE": "old"}) == "old"
    assert tc.namespace_from_env({"RATCHET_TEMPORAL_NAMESPACE": "a", "RATCHET_NAMESPACE": "a"}) == "a"
    with pytest.raises(tc.TemporalConnectionError, match="RATCHET_TEMPORAL_NAMESPACE='a' and RATCHET_NAMESPACE='b' disagree"):
        tc.namespace_from_env({"RATCHET_TEMPORAL_NAMESPACE": "a", "RATCHET_NAMESPACE": "b"})
    # An explicit namespace (the CLI's --namespace) wins over the environment.
    assert tc.connect_options("cli", env={"RATCHET_TEMPORAL_NAMESPACE": "env"})["namespace"] == "cli"


def test_api_key_alone_means_temporal_cloud_tls_with_system_roots():
    opts = tc.connect_options(env={"RATCHET_TEMPORAL_API_KEY": f"  {SECRET}\n", "RATCHET_TEMPORAL_NAMESPACE": "ns.acct"})
    assert opts == {"namespace": "ns.acct", "tls": True, "api_key": SECRET}


def test_tls_flag_alone_uses_system_roots():
    assert tc.connect_options(env={"RATCHET_TEMPORAL_TLS": "true"}) == {"namespace": "default", "tls": True}
    assert tc.connect_options(env={"RATCHET_TEMPORAL_TLS": "0"}) == {"namespace": "default"}


def test_mtls_files_become_a_tls_config(certs):
    from temporalio.service import TLSConfig

    env = {
        "RATCHET_TEMPORAL_TLS_CA": str(certs.ca),
        "RATCHET_TEMPORAL_TLS_CERT": str(certs.client_cert),
        "RATCHET_TEMPORAL_TLS_KEY": str(certs.client_key),
        "RATCHET_TEMPORAL_TLS_SERVER_NAME": "temporal.test",
    }
    opts = tc.connect_options(env=env)
    assert set(opts) == {"namespace", "tls"}
    tls = opts["tls"]
    assert isinstance(tls, TLSConfig)
    assert tls.server_root_ca_cert == certs.ca.read_bytes()
    assert tls.client_cert == certs.client_cert.read_bytes()
    assert tls.client_private_key == certs.client_key.read_bytes()
    assert tls.domain == "temporal.test"
    conn = tc.from_env(env)
    assert conn.describe() == f"namespace default, mTLS (ca {certs.ca}, cert {certs.client_cert}, server name temporal.test)"


def test_ca_alone_verifies_the_server_without_a_client_certificate(certs):
    tls = tc.connect_options(env={"RATCHET_TEMPORAL_TLS_CA": str(certs.ca)})["tls"]
    assert tls.server_root_ca_cert == certs.ca.read_bytes() and tls.client_cert is None and tls.domain is None


@pytest.mark.parametrize(
    "env_names, message",
    [
        (("RATCHET_TEMPORAL_TLS_CERT",), "RATCHET_TEMPORAL_TLS_CERT is set but RATCHET_TEMPORAL_TLS_KEY is not"),
        (("RATCHET_TEMPORAL_TLS_KEY",), "RATCHET_TEMPORAL_TLS_KEY is set but RATCHET_TEMPORAL_TLS_CERT is not"),
    ],
)
def test_half_of_a_client_certificate_is_refused(certs, env_names, message):
    paths = {"RATCHET_TEMPORAL_TLS_CERT": certs.client_cert, "RATCHET_TEMPORAL_TLS_KEY": certs.client_key}
    with pytest.raises(tc.TemporalConnectionError, match=message):
        tc.from_env({name: str(paths[name]) for name in env_names})


def test_missing_unreadable_or_wrong_files_name_the_variable(certs, tmp_path):
    with pytest.raises(
        tc.TemporalConnectionError, match=r"RATCHET_TEMPORAL_TLS_CA=/nope/ca.pem: not found; set it to the path of a PEM file"
    ):
        tc.from_env({"RATCHET_TEMPORAL_TLS_CA": "/nope/ca.pem"})
    with pytest.raises(tc.TemporalConnectionError, match="RATCHET_TEMPORAL_TLS_CA=.*: a folder, not a file"):
        tc.from_env({"RATCHET_TEMPORAL_TLS_CA": str(tmp_path)})
    # The key given where the certificate belongs (and the reverse): caught, content not echoed.
    with pytest.raises(tc.TemporalConnectionError, match="RATCHET_TEMPORAL_TLS_CERT=.*: not a PEM file holding a certificate") as info:
        tc.from_env({"RATCHET_TEMPORAL_TLS_CERT": str(certs.client_key), "RATCHET_TEMPORAL_TLS_KEY": str(certs.client_key)})
    assert "PRIVATE KEY-----" not in str(info.value) and "MII" not in str(info.value)
    with pytest.raises(tc.TemporalConnectionError, match="RATCHET_TEMPORAL_TLS_KEY=.*: not a PEM file holding a private key"):
        tc.from_env({"RATCHET_TEMPORAL_TLS_CERT": str(certs.client_cert), "RATCHET_TEMPORAL_TLS_KEY": str(certs.client_cert)})
    garbage = tmp_path / "ca.der"
    garbage.write_bytes(b"\x30\x82\x01\x0a")
    with pytest.raises(tc.TemporalConnectionError, match="ca.der: not a PEM file"):
        tc.from_env({"RATCHET_TEMPORAL_TLS_CA": str(garbage)})


def test_an_unreadable_file_names_the_variable(certs, tmp_path):
    unreadable = tmp_path / "locked.pem"
    unreadable.write_bytes(certs.ca.read_bytes())
    unreadable.chmod(0)
    try:
        unreadable.read_bytes()
        pytest.skip("running as root: a mode-000 file is still readable")
    except PermissionError:
        pass
    with pytest.raises(tc.TemporalConnectionError, match="RATCHET_TEMPORAL_TLS_CA=.*locked.pem: cannot be read .*; check its permissions"):
        tc.from_env({"RATCHET_TEMPORAL_TLS_CA": str(unreadable)})


def test_tls_off_with_tls_settings_is_refused_and_a_bad_flag_too(certs):
    with pytest.raises(
        tc.TemporalConnectionError,
        match="RATCHET_TEMPORAL_TLS=false, but RATCHET_TEMPORAL_API_KEY need TLS .*must not travel in plain text",
    ):
        tc.from_env({"RATCHET_TEMPORAL_TLS": "false", "RATCHET_TEMPORAL_API_KEY": SECRET})
    with pytest.raises(tc.TemporalConnectionError, match="RATCHET_TEMPORAL_TLS=false, but RATCHET_TEMPORAL_TLS_CA"):
        tc.from_env({"RATCHET_TEMPORAL_TLS": "no", "RATCHET_TEMPORAL_TLS_CA": str(certs.ca)})
    with pytest.raises(tc.TemporalConnectionError, match="RATCHET_TEMPORAL_TLS='maybe' is not a yes/no value"):
        tc.from_env({"RATCHET_TEMPORAL_TLS": "maybe"})


def test_the_api_key_never_shows(certs, caplog):
    env = {"RATCHET_TEMPORAL_API_KEY": SECRET, "RATCHET_TEMPORAL_TLS_CA": str(certs.ca)}
    conn = tc.from_env(env)
    assert SECRET not in repr(conn) and SECRET not in conn.describe() and "API key set" in conn.describe()
    assert certs.ca.read_text()[30:60] not in repr(conn)
    # Errors raised while the key is set do not carry it either.
    with pytest.raises(tc.TemporalConnectionError) as info:
        tc.from_env({**env, "RATCHET_TEMPORAL_TLS": "false"})
    assert SECRET not in str(info.value)
    with caplog.at_level(logging.DEBUG):
        tc.connect_options(env=env)
    assert SECRET not in caplog.text


def test_worker_and_client_read_the_same_namespace(monkeypatch):
    from ratchet.platform.worker import WorkerSettings

    monkeypatch.delenv("RATCHET_NAMESPACE", raising=False)
    monkeypatch.setenv("RATCHET_TEMPORAL_NAMESPACE", "prod")
    assert WorkerSettings.from_env().namespace == "prod"
    monkeypatch.setenv("RATCHET_NAMESPACE", "other")
    with pytest.raises(tc.TemporalConnectionError, match="disagree"):
        WorkerSettings.from_env()
