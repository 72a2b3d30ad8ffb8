"""The state file ``<state>/services.json`` (what ``up`` started) and the lock that
serialises ``up``, ``down`` and ``restart_ray`` on one state folder."""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import logging
import os
from typing import Any, Iterator

from .settings import ServiceSettings

logger = logging.getLogger(__name__)

__all__ = ["LOCK_FILE", "STATE_VERSION", "load_state", "locked", "now", "recorded", "save_state"]

LOCK_FILE = "services.lock"
STATE_VERSION = 1


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _empty() -> dict[str, Any]:
    return {"version": STATE_VERSION, "services": {}}


def load_state(settings: ServiceSettings) -> dict[str, Any]:
    """``{"version", "services": {"temporal": {...}, "ray": {...}}, ...}``; empty when
    the file is missing or unreadable."""
    try:
        data = json.loads(settings.state_file.read_text())
    except FileNotFoundError:
        return _empty()
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable %s: %s", settings.state_file, e)
        return _empty()
    data.setdefault("services", {})
    return data


def recorded(settings: ServiceSettings) -> dict[str, Any]:
    """The recorded services, reading nothing (and creating nothing) when there is no
    state file."""
    return load_state(settings)["services"] if settings.state_file.exists() else {}


def save_state(settings: ServiceSettings, data: dict[str, Any]) -> None:
    """Replace the state file atomically (a reader sees the old or the new file)."""
    data["version"] = STATE_VERSION
    data["state_dir"] = str(settings.state_dir)
    data["updated_at"] = now()
    tmp = settings.state_file.with_suffix(".json.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # a stray tmp file from before keeps its mode otherwise
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, settings.state_file)


@contextlib.contextmanager
def locked(settings: ServiceSettings) -> Iterator[None]:
    settings.ensure_state_dir()
    fd = os.open(settings.state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
