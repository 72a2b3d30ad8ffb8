"""How to reach an S3-protocol server, from the environment only, and keeping its secrets
out of every message.

Endpoints and credentials come from the standard AWS variables of the process, never
from URLs, configs or payloads: a URL can travel through Temporal history and logs, a
secret must not. The keys may instead be in the file AWS_SHARED_CREDENTIALS_FILE names
(the AWS format: `[default]` or the AWS_PROFILE section with `aws_access_key_id`,
`aws_secret_access_key`, optionally `aws_session_token`): what deploy/ mounts from a
Secret, so the keys are in no process's environment (`docker inspect`, every Ray worker
and the user code in it). `redact` scrubs the current secret values, from either place,
from any text that leaves the storage package.
"""

from __future__ import annotations

import configparser
import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit

ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
SECRET_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN")
CREDENTIALS_FILE_VAR = "AWS_SHARED_CREDENTIALS_FILE"
# The file's option for each variable (the AWS CLI's names).
_FILE_KEYS = {
    "AWS_ACCESS_KEY_ID": "aws_access_key_id",
    "AWS_SECRET_ACCESS_KEY": "aws_secret_access_key",
    "AWS_SESSION_TOKEN": "aws_session_token",
}


class StorageConfigError(ValueError):
    """The environment does not say how to reach the store (names the variable to set)."""


def file_credentials() -> dict[str, str]:
    """The keys in the AWS_SHARED_CREDENTIALS_FILE (by variable name), {} when it is not
    set; StorageConfigError naming the file when it cannot be read or has no such section."""
    path = (os.environ.get(CREDENTIALS_FILE_VAR) or "").strip()
    if not path:
        return {}
    profile = (os.environ.get("AWS_PROFILE") or "default").strip()
    parser = configparser.ConfigParser(interpolation=None)
    if not os.path.exists(os.path.expanduser(path)):
        return {}  # as botocore reads it: no file, no keys from it (the "not set" error names it)
    try:
        with open(os.path.expanduser(path)) as f:
            parser.read_file(f)
    except (OSError, configparser.Error, UnicodeDecodeError) as exc:
        raise StorageConfigError(
            f"{CREDENTIALS_FILE_VAR}={path}: cannot read it ({type(exc).__name__}); mount the credentials file there"
        ) from None
    if not parser.has_section(profile):
        raise StorageConfigError(
            f"{CREDENTIALS_FILE_VAR}={path} has no [{profile}] section (AWS_PROFILE); write the keys under [{profile}]"
        )
    section = parser[profile]
    return {var: section[opt].strip() for var, opt in _FILE_KEYS.items() if section.get(opt, "").strip()}


def _secret_values() -> list[str]:
    values = [os.environ.get(var) or "" for var in SECRET_VARS]
    try:
        values += list(file_credentials().values())
    except StorageConfigError:
        pass  # nothing read, nothing to scrub
    return [v for v in values if len(v) >= 4]


def redact(text: str) -> str:
    """`text` with the current values of the credentials (variables or file) replaced by `***`."""
    for value in _secret_values():
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
                    f"{url}: {endpoint_var} must look like http://host:port or https://host:port (the scheme decides TLS)"
                )
            if parts.username or parts.password:
                raise StorageConfigError(
                    f"{url}: {endpoint_var} must not embed credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY instead"
                )
            if parts.path not in ("", "/"):
                raise StorageConfigError(f"{url}: {endpoint_var} must not have a path (path-style endpoint: scheme://host:port)")
        key = os.environ.get("AWS_ACCESS_KEY_ID") or None
        secret = os.environ.get("AWS_SECRET_ACCESS_KEY") or None
        token = os.environ.get("AWS_SESSION_TOKEN") or None
        if key is None and secret is None:  # the variables win; else the mounted file
            from_file = file_credentials()
            key, secret = from_file.get("AWS_ACCESS_KEY_ID"), from_file.get("AWS_SECRET_ACCESS_KEY")
            token = token or from_file.get("AWS_SESSION_TOKEN")
        if (key is None) != (secret is None) or (require_keys and key is None):
            missing = "AWS_ACCESS_KEY_ID" if key is None else "AWS_SECRET_ACCESS_KEY"
            named = (os.environ.get(CREDENTIALS_FILE_VAR) or "").strip()
            where = f" (it names {named}, which does not exist)" if named and not os.path.exists(os.path.expanduser(named)) else ""
            raise StorageConfigError(
                f"{url}: {missing} is not set; set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                f"in the environment of every process that uses this store, or put both in the file {CREDENTIALS_FILE_VAR} names{where}"
            )
        return cls(
            endpoint=endpoint.rstrip("/") if endpoint else None,
            region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None,
            access_key=key,
            secret_key=secret,
            session_token=token,
        )

    @property
    def endpoint_for_messages(self) -> str:
        if not self.endpoint:
            return "the default AWS endpoint"
        parts = urlsplit(self.endpoint)
        return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")
