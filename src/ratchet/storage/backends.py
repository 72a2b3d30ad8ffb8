"""The contract of a storage backend behind `ObjectStore`, and what backends share
(multipart sizing and uploads, local fsync).

`ObjectStore` keeps its one-argument constructor (`ObjectStore(url)`) and picks a backend
from the URL scheme (the table in `ratchet/catalog/storage_schemes.py`); callers never see which one. A backend
does single attempts on full paths (`bucket/prefix/key`, or a local path); `ObjectStore`
adds retries, key mapping and checksums on top, so each backend stays a thin translation
to its client library: `fsspec_backend.py` (local folders, s3fs, memory) and
`minio_backend.py`. Endpoints and credentials: `s3_env.py`; which failures to retry:
`failures.py`.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Protocol

MIN_PART_SIZE = 5 << 20  # S3 refuses smaller multipart parts (except the last)
MAX_PARTS = 10_000  # S3's limit on parts per multipart upload


class Readable(Protocol):
    """What an upload reads its bytes from: an open binary file, or a reader that hashes
    what passes through it (object_store.py)."""

    def read(self, n: int = -1, /) -> bytes: ...


class Backend(Protocol):
    """Single-attempt operations on full paths. Writes are atomic: a reader sees the old
    object or the new one, never a part; a failed write leaves the old one (or nothing)."""

    protocol: str

    def put_bytes(self, path: str, data: bytes) -> None: ...

    def put_stream(self, path: str, stream: Readable, size: int) -> None:
        """Upload exactly `size` bytes read from `stream`, in parts, without holding the
        whole object in memory."""

    def get_bytes(self, path: str) -> bytes: ...

    def iter_range(self, path: str, start: int, end: int, chunk_size: int) -> Iterator[bytes]:
        """Bytes [start, end) of the object, streamed in chunks of about `chunk_size`."""

    def size(self, path: str) -> int:
        """Object size in bytes; FileNotFoundError when there is no such object."""

    def modified(self, path: str) -> float:
        """Last-modified time of the object (seconds since the epoch, the store's clock)."""

    def exists(self, path: str) -> bool:
        """True for an object, or for a prefix with objects under it."""

    def find(self, path: str) -> list[str]:
        """Full paths of the object at `path` and of every object under `path/`."""

    def delete(self, path: str) -> None:
        """Remove the object at `path` and everything under `path/`; missing is fine."""

    def abort_stale_uploads(self, path: str, before: float) -> list[str]:
        """Abort multipart uploads under `path` started before `before` (seconds since the
        epoch) that never completed; their keys. Backends without such uploads return []."""


# --------------------------------------------------------------------------- local durability


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a local file's bytes to disk (before it is renamed into place)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a local folder's entries to disk (after a rename into it), so a crash of the
    machine cannot lose a rename that a reader, or a manifest, already relied on."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - a filesystem that cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on a folder
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- multipart helper


def part_size_for(size: int, part_size: int, concurrency: int) -> int:
    """The part size for an object of `size` bytes: `part_size` at most, smaller when that
    keeps all `concurrency` upload slots busy (a 25 MB file is 4 parts, not 2), never under
    S3's 5 MiB minimum, and large enough to stay within 10,000 parts."""
    spread = math.ceil(size / concurrency)
    return max(MIN_PART_SIZE, min(part_size, spread), math.ceil(size / MAX_PARTS))


def upload_parts(stream: Readable, size: int, part_size: int, concurrency: int, upload) -> list:
    """Read `stream` part by part in this thread (so the caller's checksum sees the bytes in
    order) and run `upload(part_number, data)` for up to `concurrency` parts at once. At most
    `concurrency + 1` parts are in memory. Returns the results in part order; the first
    failure stops reading and is raised."""
    slots = threading.BoundedSemaphore(concurrency)
    futures: list[Future] = []

    def run(number: int, data: bytes):
        try:
            return upload(number, data)
        finally:
            slots.release()

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="ratchet-upload") as pool:
        try:
            done = 0
            while done < size:
                slots.acquire()
                if any(f.done() and f.exception() is not None for f in futures):
                    slots.release()
                    break  # a part failed: stop reading, raise it below
                data = stream.read(min(part_size, size - done))
                if not data:
                    slots.release()
                    raise OSError(f"stream ended after {done} of {size} bytes")
                done += len(data)
                futures.append(pool.submit(run, len(futures) + 1, data))
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        wait(futures)
    for f in futures:
        failed = f.exception()
        if failed is not None:
            raise failed
    return [f.result() for f in futures]
