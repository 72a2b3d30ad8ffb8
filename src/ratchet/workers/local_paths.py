"""Private local folders of this user: the model cache and checkpoint staging.

Where: `$RATCHET_CACHE_DIR` when set, else `$XDG_CACHE_HOME/ratchet` (by default
`~/.cache/ratchet`). Why not the system temp folder: a fixed name there
(`/tmp/ratchet-models/<sha>`) is predictable and shared by every user of the machine, so
another user can create it first, plant files in it, or read what is staged there. A
folder under the home is the user's alone, so nobody else can create it first. Why not a
`tempfile.mkdtemp` per process: the folder must be shared by this user's processes: the
trainer, rollout and reward actors of one node load the same model (one download, not
three). Checkpoint staging (`staging_dir`) and restores (`restore_dir`) use a folder per
trainer rank: nothing here is shared between nodes, and nothing needs to be (checkpoints
go to and come from the object store). Each node has its own base: set $RATCHET_CACHE_DIR
per node (or per process) to choose it. When the home folder cannot be written (a
read-only container), a `mkdtemp` folder is the fallback: private too, only not shared.

Whatever the place, the base folder is checked on first use: it must be a real folder
(not a link), owned by this user and writable by nobody else; a folder that other users
can read is narrowed to 0700, one that others can write (or own) is refused, with the fix
in the error. Everything below it is created with mode 0700.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path

from ratchet.ids import check_id
from ratchet.private_paths import UnsafeLocalDir
from ratchet.private_paths import ensure_private_dir as _ensure_private_dir

log = logging.getLogger(__name__)

ENV_VAR = "RATCHET_CACHE_DIR"


_lock = threading.Lock()
_fallback: Path | None = None


def ensure_private_dir(path: str | os.PathLike) -> Path:
    """`path` as a folder owned by this user with mode 0700 (created if missing); the
    check is `ratchet.private_paths.ensure_private_dir`, shared with the state folder."""
    return _ensure_private_dir(path, f"remove it, or set {ENV_VAR} to a folder of your own")


def private_base() -> Path:
    """This user's private ratchet folder (see the module docstring)."""
    configured = os.environ.get(ENV_VAR)
    if configured:
        return ensure_private_dir(Path(configured).expanduser())
    try:
        cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return ensure_private_dir(Path(cache_home).expanduser() / "ratchet")
    except UnsafeLocalDir:
        raise
    except (OSError, RuntimeError) as exc:  # a read-only or unknown home: private, only not shared
        return _fallback_base(exc)


def _fallback_base(exc: Exception) -> Path:
    global _fallback
    with _lock:
        if _fallback is None or not _fallback.is_dir():
            _fallback = Path(tempfile.mkdtemp(prefix="ratchet-"))
            log.warning(
                "cannot use ~/.cache/ratchet (%s); using %s for this process (set %s to share a cache)",
                exc, _fallback, ENV_VAR,
            )  # fmt: skip
        return _fallback


def private_subdir(*parts: str) -> Path:
    """`<base>/<parts...>`, each level created with mode 0700."""
    path = private_base()
    for part in parts:
        path = path / part
        path.mkdir(mode=0o700, exist_ok=True)
    return path


def models_dir() -> Path:
    """The model cache: one folder per model URI (hf_io.local_hf_path)."""
    return private_subdir("models")


def staging_dir(run_id: str, name: str, rank: int | None = None) -> Path:
    """Where a checkpoint is written before it is uploaded: `staging/<run>/<name>`, and
    with `rank`, that trainer rank's own folder in it (`rank-00001`). Each rank writes and
    uploads only its own folder, so the ranks of a checkpoint need no disk in common (they
    may be on different nodes) and two ranks on one node never clear each other's files.
    The name is fixed and private (under the 0700 base); the run id and checkpoint name
    are checked, so neither can escape."""
    check_id(run_id, "run id")
    check_id(name, "checkpoint name")
    _prune_empty(private_subdir("staging"), keep=run_id)
    folder = private_subdir("staging", run_id) / name
    if rank is None:
        return folder
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"trainer rank {rank!r}: expected an integer >= 0")
    return folder / f"rank-{rank:05d}"


def restore_dir(run_id: str) -> Path:
    """A fresh private folder on this node for a trainer rank restoring run `run_id`'s
    state from the object store (`restore/<run>-XXXX`); the caller removes it once
    loaded. One per call: ranks on one node, or a retried restore, never share one."""
    check_id(run_id, "run id")
    return Path(tempfile.mkdtemp(prefix=f"{run_id}-", dir=private_subdir("restore")))


def _prune_empty(folder: Path, keep: str, older_than_s: float = 3600.0) -> None:
    """Remove the empty run folders an hour old that finished runs left (each checkpoint's
    folder is removed after its upload; the run's stays). `rmdir` never removes a folder
    with anything in it."""
    cutoff = time.time() - older_than_s
    for child in folder.iterdir():
        try:
            if child.name != keep and child.is_dir() and child.stat().st_mtime < cutoff:
                child.rmdir()
        except OSError:  # not empty, or removed meanwhile
            continue


__all__ = [
    "ENV_VAR", "UnsafeLocalDir", "ensure_private_dir", "models_dir", "private_base", "private_subdir", "restore_dir", "staging_dir",
]  # fmt: skip
