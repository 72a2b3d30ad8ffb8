"""How ratchet reaches a Temporal frontend beyond the embedded dev server: the namespace,
TLS (server CA, client certificate for mTLS, server name) and an API key (Temporal Cloud),
read from the environment and turned into keyword arguments for
`temporalio.client.Client.connect`.

Why the environment and not the run config: the config travels through the Temporal
history and `config.json`, and a key or a certificate must not. The same variables are
read by the client, the CLI and `ratchet worker`, so a Kubernetes Secret or a compose env
file configures every process the same way.

| variable | meaning |
| --- | --- |
| RATCHET_TEMPORAL_NAMESPACE (or the older RATCHET_NAMESPACE) | the namespace (default `default`) |
| RATCHET_TEMPORAL_TLS | `true`: TLS with the system's roots; `false`: plain (refused with any TLS file or API key) |
| RATCHET_TEMPORAL_TLS_CA | PEM file of the CA that signed the server's certificate (implies TLS) |
| RATCHET_TEMPORAL_TLS_CERT, RATCHET_TEMPORAL_TLS_KEY | PEM client certificate and key for mTLS, both or neither (imply TLS) |
| RATCHET_TEMPORAL_TLS_SERVER_NAME | the name to verify the server's certificate against (SNI), when it differs from the address |
| RATCHET_TEMPORAL_API_KEY | API key sent as a bearer token (Temporal Cloud); implies TLS; or RATCHET_TEMPORAL_API_KEY_FILE: a file holding it |

With none of them set, `connect_options()` is `{"namespace": ...}` alone: the call is the
one ratchet made before TLS existed. Every problem is a `TemporalConnectionError` naming
the variable and the fix, raised before any connection is tried (a `ValueError`, so the
worker's retry loop, which waits out a restarting server, never retries it). The API key
is never logged, never part of a repr and never in an error message.

This module imports nothing from temporalio at import time (the CLI imports it to catch its
error); `TLSConfig` is built when options are.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet.secret_env import SecretFileError, secret_value

NAMESPACE_VAR = "RATCHET_TEMPORAL_NAMESPACE"
LEGACY_NAMESPACE_VAR = "RATCHET_NAMESPACE"
TLS_VAR = "RATCHET_TEMPORAL_TLS"
CA_VAR = "RATCHET_TEMPORAL_TLS_CA"
CERT_VAR = "RATCHET_TEMPORAL_TLS_CERT"
KEY_VAR = "RATCHET_TEMPORAL_TLS_KEY"
SERVER_NAME_VAR = "RATCHET_TEMPORAL_TLS_SERVER_NAME"
API_KEY_VAR = "RATCHET_TEMPORAL_API_KEY"
ALL_VARS = (NAMESPACE_VAR, LEGACY_NAMESPACE_VAR, TLS_VAR, CA_VAR, CERT_VAR, KEY_VAR, SERVER_NAME_VAR, API_KEY_VAR)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
# What each file must hold: the PEM block a reader looks for first.
_PEM_MARKERS = {CA_VAR: "CERTIFICATE", CERT_VAR: "CERTIFICATE", KEY_VAR: "PRIVATE KEY"}


class TemporalConnectionError(ValueError):
    """The environment's Temporal connection settings are wrong; the message names the
    variable and what to do."""


@dataclass(frozen=True)
class TemporalConnection:
    """Namespace, TLS material and API key for `Client.connect`. The key and the client's
    private key stay out of the repr; `describe()` is what may be logged."""

    namespace: str = "default"
    tls: bool = False
    server_ca: bytes | None = field(default=None, repr=False)
    client_cert: bytes | None = field(default=None, repr=False)
    client_key: bytes | None = field(default=None, repr=False)
    server_name: str | None = None
    api_key: str | None = field(default=None, repr=False)
    # Where the files came from, for describe() (paths are not secrets).
    sources: tuple[tuple[str, str], ...] = ()

    def connect_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `temporalio.client.Client.connect(address, **kwargs)`."""
        kwargs: dict[str, Any] = {"namespace": self.namespace}
        if self.tls:
            if self.server_ca or self.client_cert or self.server_name:
                from temporalio.service import TLSConfig

                kwargs["tls"] = TLSConfig(
                    server_root_ca_cert=self.server_ca,
                    domain=self.server_name,
                    client_cert=self.client_cert,
                    client_private_key=self.client_key,
                )
            else:
                kwargs["tls"] = True  # the system's trust store, no client certificate
        if self.api_key:
            kwargs["api_key"] = self.api_key
        return kwargs

    def describe(self) -> str:
        """One line for logs and errors: what is used, never the key's value."""
        parts = [f"namespace {self.namespace}"]
        if not self.tls:
            parts.append("no TLS")
        else:
            tls = "mTLS" if self.client_cert else "TLS"
            details = [f"{name.rsplit('_', 1)[-1].lower()} {path}" for name, path in self.sources]
            if self.server_name:
                details.append(f"server name {self.server_name}")
            parts.append(f"{tls} ({', '.join(details)})" if details else f"{tls} (system roots)")
        if self.api_key:
            parts.append("API key set")
        return ", ".join(parts)


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def namespace_from_env(env: Mapping[str, str] | None = None) -> str:
    """RATCHET_TEMPORAL_NAMESPACE, else RATCHET_NAMESPACE, else `default`; two different
    values are refused rather than one silently winning."""
    env = os.environ if env is None else env
    new, old = _get(env, NAMESPACE_VAR), _get(env, LEGACY_NAMESPACE_VAR)
    if new and old and new != old:
        raise TemporalConnectionError(f"{NAMESPACE_VAR}={new!r} and {LEGACY_NAMESPACE_VAR}={old!r} disagree; set only {NAMESPACE_VAR}")
    return new or old or "default"


def _flag(env: Mapping[str, str]) -> bool | None:
    raw = _get(env, TLS_VAR)
    if raw is None:
        return None
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise TemporalConnectionError(f"{TLS_VAR}={raw!r} is not a yes/no value; use true or false (or leave it unset)")


def _read_pem(env: Mapping[str, str], name: str) -> tuple[bytes, str] | None:
    path = _get(env, name)
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_file():
        what = "a folder, not a file" if p.is_dir() else "not found"
        raise TemporalConnectionError(f"{name}={path}: {what}; set it to the path of a PEM file (or unset it)")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise TemporalConnectionError(f"{name}={path}: cannot be read ({exc.strerror}); check its permissions") from None
    marker = _PEM_MARKERS[name]
    # "-----BEGIN CERTIFICATE-----"; keys: "-----BEGIN [RSA |EC ]PRIVATE KEY-----".
    if b"-----BEGIN " not in data or f"{marker}-----".encode() not in data:
        # Never echo the content: it may be a private key in the wrong variable.
        raise TemporalConnectionError(f"{name}={path}: not a PEM file holding a {marker.lower()} (no '-----BEGIN ...{marker}-----' line)")
    return data, path


def from_env(env: Mapping[str, str] | None = None, *, namespace: str | None = None) -> TemporalConnection:
    """Read and check the variables above (`namespace`, when given, wins over them)."""
    env = os.environ if env is None else env
    ns = namespace or namespace_from_env(env)
    flag = _flag(env)
    ca = _read_pem(env, CA_VAR)
    cert = _read_pem(env, CERT_VAR)
    key = _read_pem(env, KEY_VAR)
    if (cert is None) != (key is None):
        have, missing = (CERT_VAR, KEY_VAR) if key is None else (KEY_VAR, CERT_VAR)
        raise TemporalConnectionError(f"{have} is set but {missing} is not; mTLS needs both the client certificate and its private key")
    server_name = _get(env, SERVER_NAME_VAR)
    try:  # or the file RATCHET_TEMPORAL_API_KEY_FILE names (a mounted Secret)
        api_key = secret_value(API_KEY_VAR, env)
    except SecretFileError as exc:
        raise TemporalConnectionError(str(exc)) from None
    wants_tls = [
        n for n, v in ((CA_VAR, ca), (CERT_VAR, cert), (KEY_VAR, key), (SERVER_NAME_VAR, server_name), (API_KEY_VAR, api_key)) if v
    ]
    if flag is False and wants_tls:
        raise TemporalConnectionError(
            f"{TLS_VAR}=false, but {', '.join(wants_tls)} need TLS (an API key must not travel in plain text); "
            f"unset {TLS_VAR} or those variables"
        )
    tls = bool(flag) or bool(wants_tls)
    sources = tuple((n, src[1]) for n, src in ((CA_VAR, ca), (CERT_VAR, cert)) if src)
    return TemporalConnection(
        namespace=ns,
        tls=tls,
        server_ca=ca[0] if ca else None,
        client_cert=cert[0] if cert else None,
        client_key=key[0] if key else None,
        server_name=server_name,
        api_key=api_key,
        sources=sources,
    )


def connect_options(namespace: str | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`Client.connect` keyword arguments from the environment (see the module's table)."""
    return from_env(env, namespace=namespace).connect_kwargs()
