"""Every storage URL scheme ratchet supports, in one table: where a storage backend is added.

`ObjectStore(url)` picks its backend here from the URL's scheme (a plain path is a local
folder, `file`), and the config schema accepts `storage.root` only with a scheme listed
here, naming them all when it refuses one.

To add a backend (say `gs://`): write a class that fulfils `backends.Backend` (single
attempts on full paths; atomic writes; FileNotFoundError for a missing object), and a
function `open_x(url, *, part_size, concurrency) -> (backend, root path)` in the backend's
module (as `open_fsspec` in fsspec_backend.py, `open_minio` in minio_backend.py); add its
line below; run tests/unit/test_storage.py's store tests against it (they take a store) and
add a line to tests/unit/test_registries.py's table check.

This module imports nothing outside the standard library: an entry names its opener as
"module:function", imported when a store is opened, so the config schema reads the table
without loading fsspec, the S3 clients or torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from .registry import Registry, resolve

LOCAL = "file"  # the scheme of a plain path
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")  # two letters at least: C: is a Windows drive


@dataclass(frozen=True)
class Scheme:
    opener: str  # "module:function": fn(url, *, part_size, concurrency) -> (Backend, root path)
    description: str
    needs_bucket: bool = False  # the URL must name a bucket: scheme://bucket[/prefix]

    @property
    def open(self) -> Callable[..., tuple[Any, str]]:
        return resolve(self.opener)


_FSSPEC = "ratchet.storage.fsspec_backend:open_fsspec"
SCHEMES: Registry[Scheme] = Registry("storage scheme")
SCHEMES.register("file", Scheme(_FSSPEC, "a local folder (a plain path works too)"))
SCHEMES.register(
    "s3", Scheme(_FSSPEC, "S3 or any S3-protocol server, through s3fs (endpoint and keys from AWS_* variables)", needs_bucket=True)
)
SCHEMES.register("s3a", Scheme(_FSSPEC, "the same as s3://", needs_bucket=True))
SCHEMES.register(
    "minio",
    Scheme(
        "ratchet.storage.minio_backend:open_minio", "any S3-protocol server, through the minio client (AWS_* variables)", needs_bucket=True
    ),
)
SCHEMES.register("memory", Scheme(_FSSPEC, "fsspec's in-process memory filesystem, for tests"))


class UnknownScheme(ValueError):
    """A storage URL whose scheme is not in `SCHEMES`."""

    def __init__(self, scheme: str, url: str):
        super().__init__(f"unknown storage scheme {scheme + '://'!r} in {url!r}; supported: {supported()}")


def supported() -> str:
    """The accepted forms, for error messages: 'a local folder, file://, s3://, ...'."""
    return "a local folder, " + ", ".join(f"{name}://" for name in SCHEMES)


def scheme_of(url: str) -> str:
    """The lower-cased scheme of `url` ("file" for a plain path)."""
    match = _SCHEME.match(url)
    return match.group(1).lower() if match else LOCAL


def lookup(url: str) -> Scheme:
    """The table entry for `url`'s scheme; UnknownScheme (naming the supported ones) if none."""
    scheme = scheme_of(url)
    if scheme not in SCHEMES:
        raise UnknownScheme(scheme, url)
    return SCHEMES.get(scheme)
