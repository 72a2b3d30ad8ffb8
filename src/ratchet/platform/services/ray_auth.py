"""Token authentication for ratchet's Ray head: the token file (created private, kept
across ``up`` calls) and the variables a process needs to join the head."""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from ratchet.private_paths import create_secret_file

from .settings import ServiceError, ServiceSettings
from .state import recorded

logger = logging.getLogger(__name__)

__all__ = ["APPLIED_VAR", "RAY_AUTH_VARS", "ensure_token", "record_applied", "head_auth", "ray_auth_env", "ray_token_path", "user_ray_auth"]

# The variables through which Ray learns its authentication mode and token.
RAY_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
# Names of the RAY_AUTH_* variables that ratchet itself put into this process's
# environment to join a head (`record_applied`): they are not the user's choice, so a
# later `up()` of another head in the same process must not take them for one.
APPLIED_VAR = "RATCHET_RAY_AUTH_APPLIED"


def record_applied(environ: Any, names: Any) -> None:
    """Note that ratchet set `names` (RAY_AUTH_* variables) in `environ`."""
    applied = set(filter(None, environ.get(APPLIED_VAR, "").split(","))) | set(names)
    environ[APPLIED_VAR] = ",".join(sorted(applied))


def ray_token_path(settings: ServiceSettings) -> Path:
    """The file that holds the token of ratchet's Ray head (``<state>/ray_auth_token``)."""
    return settings.ray_token_file


def user_ray_auth(environ: Any) -> dict[str, str]:
    """The RAY_AUTH_* variables the user set; they win over ratchet's own token."""
    ours = set(environ.get(APPLIED_VAR, "").split(","))
    return {k: environ[k] for k in RAY_AUTH_VARS if environ.get(k) and k not in ours}


def ray_auth_env(settings: ServiceSettings, environ: Any = None) -> dict[str, str]:
    """The variables a process needs to join the Ray head of ``settings`` (the worker,
    a driver, a test): merge them into its environment before it imports ray.

    A user's own RAY_AUTH_MODE / RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH win. Otherwise the
    mode the recorded head runs with and the path of ratchet's token file; never the
    token itself, so that it stays off command lines and out of logs. Empty when there
    is neither a recorded head nor a token file (a Ray cluster ratchet did not start).
    """
    environ = os.environ if environ is None else environ
    user = user_ray_auth(environ)
    if user:
        # A token without a mode: `ray.init(address=...)` would connect without sending it.
        user.setdefault("RAY_AUTH_MODE", "token")
        return user
    rec = recorded(settings).get("ray")
    if rec is not None and rec.get("auth_mode", "token") != "token":
        # A head started without token auth (by an older ratchet, or on the user's
        # request): a driver must use the same mode, or Ray refuses it.
        return {"RAY_AUTH_MODE": str(rec["auth_mode"])}
    path = Path((rec or {}).get("auth_token_path") or settings.ray_token_file)
    if not path.is_file():
        return {}
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}


def ensure_token(settings: ServiceSettings) -> Path:
    """``<state>/ray_auth_token``, created with a random token when missing. A token
    that others could have read (group or world bits set) or an empty file is replaced."""
    path = settings.ray_token_file
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        create_secret_file(path, secrets.token_hex(32))
        logger.info("created a Ray authentication token in %s (mode 0600)", path)
        return path
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise ServiceError(
            f"{path} (the Ray authentication token) must be a regular file owned by you; "
            "remove it and run `ratchet up` again to create a new token."
        )
    if st.st_mode & 0o077 or st.st_size == 0:
        logger.warning("%s was readable by other users or empty; replacing the Ray token", path)
        path.unlink()
        create_secret_file(path, secrets.token_hex(32))
    return path


def head_auth(settings: ServiceSettings) -> tuple[dict[str, str], str]:
    """The RAY_AUTH_* variables to start the head with, and where they came from
    ("environment": the user's own, which win; "ratchet": ratchet's token file)."""
    if user_ray_auth(os.environ):
        return ray_auth_env(settings), "environment"
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ensure_token(settings))}, "ratchet"
