"""The key that seals ratchet's Temporal payloads (`payload_codec`): where its file is, how
the first process that needs it creates it, and which files are refused. Stdlib only: the
CLI and the services read it without importing temporalio.

The file: 32 random bytes written as 64 hex characters (`openssl rand -hex 32` makes one),
at RATCHET_PAYLOAD_KEY_FILE, else `<state folder>/payload.key`. Created 0600 (in a 0700
folder when it makes the folder), atomically: a client and a worker starting together end
with the same key. Refused, naming the file and the fix: a file that the group or others
can write or read, one owned by another user, one that is not 64 hex characters. A
root-owned file may be group-readable: that is a Kubernetes Secret mounted with an fsGroup
(defaultMode 0440), how a non-root pod reads it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from ratchet.private_paths import create_secret_file

log = logging.getLogger(__name__)

KEY_FILE_VAR = "RATCHET_PAYLOAD_KEY_FILE"
KEY_FILE_NAME = "payload.key"
_KEY_BYTES = 32
_FIX_CREATE = (
    f"remove it and let ratchet create a new one (every process must then use the new file), or point {KEY_FILE_VAR} at the right file"
)


class PayloadKeyError(ValueError):
    """The payload key file is missing, unsafe or malformed; the message names the file
    and the fix. A ValueError: the worker's connect retry never retries it."""


class PayloadKeyMismatch(RuntimeError):
    """A payload sealed with another key than this process holds (a process started with
    the wrong key file): retryable, so the run waits for a process with the right key."""


def key_file_path(state_dir: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Path:
    """RATCHET_PAYLOAD_KEY_FILE, else `<state_dir>/payload.key` (the state folder of
    `ServiceSettings.from_env()` when `state_dir` is None)."""
    env = os.environ if env is None else env
    named = (env.get(KEY_FILE_VAR) or "").strip()
    if named:
        return Path(os.path.abspath(Path(named).expanduser()))
    if state_dir is None:
        from .services.settings import ServiceSettings

        state_dir = ServiceSettings.from_env().state_dir
    return Path(os.path.abspath(Path(state_dir).expanduser())) / KEY_FILE_NAME


@dataclasses.dataclass(frozen=True)
class PayloadKey:
    """The key (never in the repr) and where it came from."""

    secret: bytes = dataclasses.field(repr=False)
    path: Path

    @property
    def key_id(self) -> str:
        return hashlib.sha256(b"ratchet payload key id\0" + self.secret).hexdigest()[:16]

    def describe(self) -> str:
        return f"{KEY_FILE_VAR}={self.path}, key id {self.key_id}"


def _create(path: Path) -> None:
    """A new key at `path` unless a file is there (another process's key wins a race)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if create_secret_file(path, os.urandom(_KEY_BYTES).hex() + "\n"):
        log.info("created the Temporal payload key %s (0600)", path)


def _check(path: Path, st: os.stat_result) -> None:
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISREG(st.st_mode):
        raise PayloadKeyError(f"payload key {path} ({KEY_FILE_VAR}) is not a regular file; point {KEY_FILE_VAR} at the key file")
    if st.st_uid not in (os.geteuid(), 0):
        raise PayloadKeyError(
            f"payload key {path} is owned by uid {st.st_uid}, not by you (uid {os.geteuid()}) or root: that user could "
            f"read or replace it. Use a key file of your own ({KEY_FILE_VAR}=<path>, or {_FIX_CREATE})"
        )
    # Group-readable is allowed for a root-owned file only: a Kubernetes Secret mounted with
    # fsGroup (defaultMode 0440) is how a non-root pod reads it.
    too_open = mode & 0o037 if st.st_uid == 0 and st.st_uid != os.geteuid() else mode & 0o077
    if too_open:
        raise PayloadKeyError(
            f"payload key {path} has mode {mode:o}: other users can read or change it, so anyone of them could start "
            f"runs as the worker. Run `chmod 600 {path}` (and check who read it; if in doubt, {_FIX_CREATE})"
        )


def load_key(path: str | os.PathLike | None = None, *, create: bool = True) -> PayloadKey:
    """The key in `path` (default `key_file_path()`), created first when missing and
    `create`; PayloadKeyError when it is unsafe or malformed."""
    path = key_file_path() if path is None else Path(path)
    if not path.exists() and create:
        try:
            _create(path)
        except OSError as exc:
            raise PayloadKeyError(
                f"cannot create the payload key {path} ({exc.strerror}); set {KEY_FILE_VAR} to a file you can write"
            ) from None
    try:
        st = os.stat(path)  # follows links: a Kubernetes Secret file is one
    except FileNotFoundError:
        raise PayloadKeyError(
            f"payload key {path} ({KEY_FILE_VAR}) does not exist; mount the run's key there (docs/deploy.md) or unset {KEY_FILE_VAR}"
        ) from None
    _check(path, st)
    try:
        text = path.read_text(encoding="ascii").strip()
        secret = bytes.fromhex(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not hex text"
        raise PayloadKeyError(f"payload key {path} cannot be read ({why}); it must hold 64 hex characters: {_FIX_CREATE}") from None
    if len(secret) != _KEY_BYTES:
        # Never echo the content: it is (part of) a key.
        raise PayloadKeyError(f"payload key {path} holds {len(secret)} bytes, not {_KEY_BYTES} (64 hex characters): {_FIX_CREATE}")
    return PayloadKey(secret, path)
