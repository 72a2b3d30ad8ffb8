"""Files and folders that only this user may touch, and code that only this user (or root)
may have written. Stdlib only: the storage, registry and tracking layers, the services
and the user-code loader all share it.

- `ensure_private_dir`: a folder ratchet keeps private data in (the state folder, the
  cache, Ray's temp folder) must be a real folder, owned by this user, writable by nobody
  else; one that others can only read is narrowed to 0700.
- `create_secret_file`: a new random secret (the Ray token, the payload key, the Ray temp
  folder's key), 0600 from its first byte and whole before anyone can open it.
- `make_private_dirs`, `create_private_file`, `chmod_private`: what ratchet creates
  under such a folder is 0700 (folders) and 0600 (files) whatever the process umask, so a
  copy, a move or a looser parent never exposes it.
- `PRIVATE_UMASK`: the umask of the services ratchet starts (Temporal, Ray, MLflow, the
  node workers), so the files they create themselves are private too.
- `check_trusted_code`: a reward/cost/filter/tool file runs with the worker's rights;
  one that another user owns or can write (or that sits in a folder another user can
  write) is refused, since that user could make the worker run anything.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import tempfile
from pathlib import Path

__all__ = [
    "PRIVATE_UMASK", "UnsafeLocalDir", "UntrustedCode", "check_trusted_code", "chmod_private",
    "create_private_file", "create_secret_file", "ensure_private_dir", "make_private_dirs",
]  # fmt: skip

PRIVATE_UMASK = 0o077


class UnsafeLocalDir(PermissionError):
    """A local folder ratchet would write private data into is owned, or writable, by
    someone else."""


class UntrustedCode(PermissionError):
    """A file of user code that another user owns or can change."""


def ensure_private_dir(path: str | os.PathLike, fix: str) -> Path:
    """`path` as a folder owned by this user with mode 0700 (created if missing; missing
    parents are created 0700 too). UnsafeLocalDir when it is a link, not a folder, owned
    by another user, or writable by the group or others (someone else may already have put
    files in it); `fix` ends the message (how to choose another folder)."""
    path = Path(path)
    make_private_dirs(path.parent)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeLocalDir(f"{path} is a link or not a folder; ratchet keeps private files there only in a real folder: {fix}")
    if st.st_uid != os.getuid():
        raise UnsafeLocalDir(f"{path} is owned by uid {st.st_uid}, not by you (uid {os.getuid()}): {fix}")
    if st.st_mode & 0o022:
        raise UnsafeLocalDir(
            f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}), so its contents cannot be trusted: "
            f"{fix} (or empty it and `chmod 700 {path}`)"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)  # readable by others: only narrowed, nobody else could write in it
    return path


def make_private_dirs(path: str | os.PathLike) -> Path:
    """`mkdir -p` where every folder it creates is 0700 (`os.makedirs` applies its mode to
    the last level only); folders that exist are left as they are."""
    path = Path(path)
    missing, at = [], path
    while not at.exists() and at != at.parent:
        missing.append(at)
        at = at.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            continue
        os.chmod(folder, 0o700)  # mkdir's mode is masked by the umask; 0700 is the point
    return path


def create_private_file(path: str | os.PathLike) -> None:
    """Create `path` empty with mode 0600 when it is missing (an existing file is left
    alone), so a library that opens it next (SQLite, a log) never makes it readable by others."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return
    os.close(fd)


def create_secret_file(path: str | os.PathLike, text: str) -> bool:
    """Write `text` to `path` (mode 0600) unless something is there already; True when this
    call made it. The text goes to a private temporary file beside it (0600, fsynced),
    which is then hard-linked to `path`: the link fails if another process got there first
    (or anyone put a file or link there), so two processes starting together agree on one
    secret and no reader ever sees a half-written one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)  # O_EXCL, 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(tmp)


def chmod_private(path: str | os.PathLike) -> None:
    """Narrow `path` to 0600 (a file) or 0700 (a folder) when group or others have bits."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o077:
        return
    os.chmod(path, 0o700 if stat.S_ISDIR(st.st_mode) else 0o600)


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _private_group(st: os.stat_result) -> bool:
    """The file's group is its owner's own group with nobody else in it (the "user private
    group" many distributions give each user, with umask 002): group write is then the
    owner's alone."""
    try:
        group = grp.getgrgid(st.st_gid)
        owner = pwd.getpwuid(st.st_uid)
    except KeyError:
        return False
    return group.gr_name == owner.pw_name and owner.pw_gid == st.st_gid and not [m for m in group.gr_mem if m != owner.pw_name]


def _writable_by_others(st: os.stat_result) -> bool:
    if st.st_mode & 0o002:
        return True
    return bool(st.st_mode & 0o020) and not _private_group(st)


def check_trusted_code(path: str | os.PathLike) -> None:
    """Refuse (UntrustedCode) a code file that another user (not you, not root) owns or
    that group or others can write, and one whose folder is such: that user could change
    what the worker runs. A world-writable folder with the sticky bit (/tmp) is allowed:
    nobody else can replace or remove a file of yours there."""
    path = Path(path)
    me = os.getuid()
    for what, item in (("file", path), ("folder", path.parent)):
        st = os.stat(item)
        fix = f"`chmod go-w {item}`" if st.st_uid in (me, 0) else f"`chown {me} {item}` (or copy the code into a folder of your own)"
        if st.st_uid not in (me, 0):
            raise UntrustedCode(
                f"user code {path}: its {what} {item} is owned by {_owner(st.st_uid)}, not by you or root; code runs with "
                f"the worker's rights, so only your own code runs: {fix}"
            )
        sticky_dir = what == "folder" and st.st_mode & stat.S_ISVTX
        if _writable_by_others(st) and not sticky_dir:
            raise UntrustedCode(
                f"user code {path}: its {what} {item} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}), "
                f"who could change what the worker runs: {fix}"
            )
