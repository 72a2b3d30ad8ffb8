"""How to reach an S3-protocol server, from the environment only, and keeping its secrets
out of every message.

Endpoints and credentials come from the standard AWS variables of the process, never
from URLs, configs or payloads: a URL can travel through Temporal history and logs, a
secret must not. `redact` scrubs the current secret values from any text that leaves
the storage package.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit

ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
SECRET_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN")



class StorageConfigError(ValueError):
    """The environment does not say how to reach the store (names the variable to set)."""


def redact(text: str) -> str:
    """`text` with the current values of the credential variables replaced by `***`."""
    for var in SECRET_VARS:
        value = os.environ.get(var)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


def contains_secret(text: str) -> bool:
    return redact(text) != text


@dataclass(frozen=True)
class S3Settings:
    """How to reach an S3-protocol server, read from the environment. `repr` hides the
    keys; only `endpoint_for_messages` may appear in logs and errors."""

    endpoint: str | None
    region: str | None
    access_key: str | None = field(default=None, repr=False)
    secret_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, url: str, *, require_endpoint: bool, require_keys: bool) -> "S3Settings":
        endpoint_var = next((v for v in ENDPOINT_VARS if os.environ.get(v)), None)
        endpoint = os.environ[endpoint_var].strip() if endpoint_var else None
        if endpoint is None and require_endpoint:
            raise StorageConfigError(
                f"{url}: no S3 endpoint configured; set AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) "
                "in the environment, e.g. AWS_ENDPOINT_URL=http://127.0.0.1:9000"
            )
        if endpoint is not None:
            parts = urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise StorageConfigError(
                    f"{url}: {endpoint_var} must look like http://host:port or https://host:port "
                    "(the scheme decides TLS)"
                )
            if parts.username or parts.password:
                raise StorageConfigError(
                    f"{url}: {endpoint_var} must not embed credentials; "
                    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY instead"
                )
            if parts.path not in ("", "/"):
                raise StorageConfigError(f"{url}: {endpoint_var} must not have a path (path-style endpoint: scheme://host:port)")
        key = os.environ.get("AWS_ACCESS_KEY_ID") or None
        secret = os.environ.get("AWS_SECRET_ACCESS_KEY") or None
        if (key is None) != (secret is None) or (require_keys and key is None):
            missing = "AWS_ACCESS_KEY_ID" if key is None else "AWS_SECRET_ACCESS_KEY"
            raise StorageConfigError(
                f"{url}: {missing} is not set; set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "in the environment of every process that uses this store"
            )
        return cls(
            endpoint=endpoint.rstrip("/") if endpoint else None,
            region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None,
            access_key=key,
            secret_key=secret,
            session_token=os.environ.get("AWS_SESSION_TOKEN") or None,
        )

    @property
    def endpoint_for_messages(self) -> str:
        if not self.endpoint:
            return "the default AWS endpoint"
        parts = urlsplit(self.endpoint)
        return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")
