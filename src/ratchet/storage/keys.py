"""The one check every object key passes before it becomes a path or an S3 key.

Keys are `/`-separated and relative to a store's root. A `..` segment, a leading `/`, a
backslash, a NUL or control character, or an empty or `.` segment could reach outside the
root on a local folder (`../../etc/hostname`) or name another object on S3 than the one
meant, so `ObjectStore` refuses them (and the backends refuse full paths with `..` as a
second guard). Run ids and checkpoint names are checked with `ratchet.ids.check_id`
before they are joined into keys.
"""

from __future__ import annotations


class UnsafeKey(ValueError):
    """An object key (or a file name from a manifest) that could leave its folder."""

    def __init__(self, key: object, why: str, what: str = "object key"):
        self.key = key
        super().__init__(
            f"unsafe {what} {key!r}: {why}; use '/'-separated names of letters, digits, '_', '.', '-' "
            "under the store's root (no '..', no leading '/', no backslash)"
        )


def _problem(key: str, *, allow_absolute: bool) -> str | None:
    if "\x00" in key or any(ord(c) < 0x20 or c == "\x7f" for c in key):
        return "it contains a NUL or control character"
    if "\\" in key:
        return "it contains a backslash"
    if key.startswith("/"):
        if not allow_absolute:
            return "it is absolute (starts with '/')"
        key = key[1:]
    for segment in key.split("/"):
        if segment == "..":
            return "it has a '..' segment"
        if segment == ".":
            return "it has a '.' segment"
        if segment == "":
            return "it has an empty segment ('//' or a trailing '/')"
    return None


def check_key(key: object, *, allow_empty: bool = True, what: str = "object key") -> str:
    """`key` when it is a safe relative key (`""`, the root itself, only if `allow_empty`);
    else UnsafeKey naming the key and what is wrong with it."""
    if not isinstance(key, str):
        raise UnsafeKey(key, f"expected a string, got {type(key).__name__}", what)
    if key == "":
        if allow_empty:
            return key
        raise UnsafeKey(key, "it is empty", what)
    why = _problem(key, allow_absolute=False)
    if why:
        raise UnsafeKey(key, why, what)
    return key


def check_path(path: str) -> str:
    """A backend's full path (a local absolute path or `bucket/prefix/key`): no `..` or `.`
    segment, no backslash or NUL. The second guard behind `check_key`."""
    if not isinstance(path, str) or path == "":
        raise UnsafeKey(path, "a backend path must be a non-empty string", "storage path")
    why = _problem(path, allow_absolute=True)
    if why:
        raise UnsafeKey(path, why, "storage path")
    return path


def check_file_name(name: object, what: str = "file name") -> str:
    """A single plain file name (no `/` at all): what a flat manifest may list."""
    check_key(name, allow_empty=False, what=what)
    if "/" in name:  # type: ignore[operator]
        raise UnsafeKey(name, "it is a path, not a plain file name", what)
    return name  # type: ignore[return-value]


__all__ = ["UnsafeKey", "check_file_name", "check_key", "check_path"]
