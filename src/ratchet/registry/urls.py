"""Which database the registry uses, and how its URL may be shown.

`RATCHET_REGISTRY_URL` (or the file `RATCHET_REGISTRY_URL_FILE` names) names it; without it, SQLite in the state folder
(`<RATCHET_STATE_DIR or .ratchet>/registry.db`, as `ServiceSettings.from_env` places the
state folder; `ratchet up` and the demo pass the URL to the worker explicitly). A URL may
hold a password (PostgreSQL): `safe_url` is the only form that goes into logs and errors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ratchet.secret_env import SecretFileError, secret_value

if TYPE_CHECKING:  # SQLAlchemy is imported on use: the CLI and demo import this module
    from sqlalchemy.engine import URL

ENV = "RATCHET_REGISTRY_URL"
STATE_DIR_ENV = "RATCHET_STATE_DIR"
DEFAULT_STATE_DIR = ".ratchet"
DB_FILE = "registry.db"
# RATCHET_REGISTRY_URL=off: activities write no registry (e.g. a worker without a database).
OFF = ("off", "none", "disabled")


class RegistryURLError(ValueError):
    """The registry URL cannot be used; the message says what to set."""


def sqlite_url(state_dir: str | os.PathLike[str]) -> str:
    """`sqlite:////abs/state/registry.db`: the default registry of a state folder."""
    return f"sqlite:///{Path(os.path.abspath(Path(state_dir).expanduser())) / DB_FILE}"


def registry_url(url: str | None = None) -> str:
    """`url` if given, else RATCHET_REGISTRY_URL, else SQLite in the state folder."""
    if url:
        return url
    try:
        env = secret_value(ENV) or ""  # or the file RATCHET_REGISTRY_URL_FILE names (a mounted Secret)
    except SecretFileError as exc:
        raise RegistryURLError(str(exc)) from None
    if env.lower() in OFF:
        raise RegistryURLError(f"the run registry is turned off ({ENV}={env}); set it to a database URL or unset it")
    if env:
        return env
    return sqlite_url(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)


def registry_enabled() -> bool:
    """False when RATCHET_REGISTRY_URL is `off` (or `none`, `disabled`)."""
    return os.environ.get(ENV, "").strip().lower() not in OFF


def parse(url: str) -> "URL":
    """The URL parsed, or an error naming RATCHET_REGISTRY_URL and the accepted forms
    (the message never repeats the URL: it may hold a password)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise RegistryURLError(
            f"the registry URL ({ENV} or --url) is not a database URL; use e.g. "
            "sqlite:////path/registry.db or postgresql+psycopg://user:password@host:5432/db"
        ) from None
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise RegistryURLError(f"the registry ({ENV}) supports sqlite and postgresql, got {parsed.get_backend_name()!r}")
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() in ("", "psycopg2"):
        # psycopg (3) is the driver ratchet ships; psycopg2 is not installed.
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def safe_url(url: "str | URL") -> str:
    """The URL with its password masked ("***"), for logs and messages."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url) if isinstance(url, str) else url
    except ArgumentError:
        return "<unparseable registry URL>"
    return parsed.render_as_string(hide_password=True)


__all__ = ["DB_FILE", "ENV", "OFF", "RegistryURLError", "parse", "registry_enabled", "registry_url", "safe_url", "sqlite_url"]
