"""A small key-value view of object storage, rooted at a URL.

`ObjectStore(url)` works with local folders (plain paths or `file://`), `s3://bucket/prefix`
(s3fs), `minio://bucket/prefix` (the minio client) and `memory://` (tests). The backend is
chosen from the URL's scheme by the table in `ratchet/catalog/storage_schemes.py` (where a backend is added);
callers only ever pass the URL, and endpoints and credentials come from the environment
(see `s3_env.py`).

Writes are atomic: a local folder writes a temporary key and moves it into place, S3 relies
on PUT and multipart completion being atomic. A reader never sees a half-written object
and a retried writer simply overwrites its own output (docs/design.md, rule 2).

Every operation is retried with exponential backoff on transient errors (connection
refused or reset, timeouts, 5xx, throttling) for up to `retry_timeout_s` seconds (60 by
default, so an outage of half a minute passes unnoticed). Other errors surface at once.
Large files stream in parts (`put_file`), and downloads resume from the bytes already on
disk (`get_file`); both compute the sha256 of the bytes as they pass.

Why one module of ~450 lines: every public method is a few lines that route through the
same retry wrapper (`_call`) and key check; the streaming upload and the resuming
download share the digest helpers above them. Splitting by operation would copy that
wrapping, not remove it.
"""

from __future__ import annotations


import builtins
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import tenacity

from ratchet.ids import check_id
from ratchet.private_paths import make_private_dirs

from ratchet.catalog import storage_schemes as schemes
from .backends import Backend, fsync_dir, fsync_file
from .failures import is_transient, missing_credentials
from .s3_env import StorageConfigError, contains_secret, redact
from .keys import check_key

log = logging.getLogger(__name__)

T = TypeVar("T")

# Leftovers of interrupted writes older than this are removed (`clean_leftovers`): far
# longer than any single object write takes, so a write in flight is never touched.
LEFTOVER_AGE_S = 3600.0


class ObjectStoreError(OSError):
    """A storage failure whose original message had to be withheld (it held a secret)."""


class StoreUnavailable(ConnectionError):
    """A transient failure that outlasted the retry window."""


@dataclass(frozen=True)
class Transfer:
    """What `put_file`/`get_file` moved: the object's URI, size and sha256, and how many
    bytes crossed the network in this call (less than `size` when a download resumed)."""

    uri: str
    size: int
    sha256: str
    transferred: int


class _Digest:
    """A sha256 and the number of bytes it has seen."""

    def __init__(self):
        self.hash = hashlib.sha256()
        self.count = 0

    def update(self, data: bytes) -> None:
        self.hash.update(data)
        self.count += len(data)

    @classmethod
    def of_file(cls, path: Path, size: int, chunk_size: int) -> "_Digest":
        """The digest of the first `size` bytes of a local file."""
        digest = cls()
        with open(path, "rb") as f:
            while digest.count < size and (data := f.read(min(chunk_size, size - digest.count))):
                digest.update(data)
        return digest


class _HashingReader:
    """Reads from `raw`, feeding every byte to a digest on its way to the uploader, so a
    file is read once for both."""

    def __init__(self, raw: BinaryIO):
        self.raw = raw
        self.digest = _Digest()

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.digest.update(data)
        return data


class ObjectStore:
    """Keys are `/`-separated paths under the root URL.

    Keyword options (all optional; `child` stores inherit them):
      retry_timeout_s   give up on transient errors after this long (0: no retries)
      retry_initial_s   first backoff; doubles per attempt, with jitter
      retry_max_s       longest single backoff
      part_size         multipart part size and download chunk size (>= 5 MiB on S3)
      max_concurrency   parts uploaded in parallel
    """

    def __init__(
        self,
        root: str,
        *,
        retry_timeout_s: float = 60.0,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 8.0,
        part_size: int = 16 << 20,
        max_concurrency: int = 4,
    ):
        if retry_timeout_s < 0 or retry_initial_s <= 0 or retry_max_s < retry_initial_s:
            raise ValueError(
                "ObjectStore retry options: need retry_timeout_s >= 0 and 0 < retry_initial_s <= retry_max_s "
                f"(got {retry_timeout_s}, {retry_initial_s}, {retry_max_s})"
            )
        if part_size < 1 or max_concurrency < 1:
            raise ValueError(f"ObjectStore: part_size and max_concurrency must be >= 1 (got {part_size}, {max_concurrency})")
        self._options: dict[str, Any] = dict(
            retry_timeout_s=retry_timeout_s, retry_initial_s=retry_initial_s, retry_max_s=retry_max_s,
            part_size=part_size, max_concurrency=max_concurrency,
        )  # fmt: skip
        self.retry_timeout_s = retry_timeout_s
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.part_size = part_size
        self._backend: Backend
        self._backend, path = schemes.lookup(root).open(root, part_size=part_size, concurrency=max_concurrency)
        self.root = path.rstrip("/")
        self.protocol = self._backend.protocol

    # ------------------------------------------------------------------ naming

    @property
    def fs(self):
        """The fsspec filesystem underneath (not for `minio://` stores)."""
        fs = getattr(self._backend, "fs", None)
        if fs is None:
            raise AttributeError(f"{self.url} is served by the minio client and has no fsspec filesystem")
        return fs

    @property
    def url(self) -> str:
        return self.root if self.protocol == "file" else f"{self.protocol}://{self.root}"

    def child(self, key: str) -> "ObjectStore":
        """The store rooted at `key` under this one. A single segment is a run id (or a
        sweep id) and must satisfy `ratchet.ids.check_id`; a longer key passes `check_key`
        segment by segment, so a child never reaches above its parent."""
        if isinstance(key, str) and "/" not in key:
            check_id(key, "run id")
        check_key(key, allow_empty=False)
        return ObjectStore(self.uri(key), **self._options)

    def path(self, key: str) -> str:
        """The backend path of `key`; every key-taking method goes through here, so an
        unsafe key (`..`, absolute, backslash, NUL, empty segment) raises UnsafeKey before
        any byte is read or written."""
        check_key(key)
        return f"{self.root}/{key}" if key else self.root

    def uri(self, key: str) -> str:
        path = self.path(key)
        return path if self.protocol == "file" else f"{self.protocol}://{path}"

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def __reduce__(self):
        # Pickles (Ray) carry the URL and options only; the receiving process reads its
        # own credentials from its environment.
        return (_rebuild, (self.url, self._options))

    # ------------------------------------------------------------------ small objects

    def put_bytes(self, key: str, data: bytes) -> str:
        self._call("put", key, self._backend.put_bytes, self.path(key), data)
        return self.uri(key)

    def get_bytes(self, key: str) -> bytes:
        return self._call("get", key, self._backend.get_bytes, self.path(key))

    def put_json(self, key: str, obj: Any) -> str:
        return self.put_bytes(key, json.dumps(obj, indent=1, sort_keys=True).encode())

    def get_json(self, key: str) -> Any:
        return json.loads(self.get_bytes(key))

    def exists(self, key: str) -> bool:
        return self._call("exists", key, self._backend.exists, self.path(key))

    def size(self, key: str) -> int:
        """Bytes in the object at `key` (FileNotFoundError when missing)."""
        return self._call("size", key, self._backend.size, self.path(key))

    def modified(self, key: str) -> datetime:
        """When the object at `key` was last written, by the store's clock (UTC)."""
        ts = self._call("stat", key, self._backend.modified, self.path(key))
        return datetime.fromtimestamp(ts, tz=timezone.utc)

    def list(self, prefix: str = "") -> list[str]:
        """Keys under `prefix`, relative to the root, sorted."""
        paths = self._call("list", prefix, self._backend.find, self.path(prefix))
        keys = [p[len(self.root) + 1 :] for p in paths]
        return sorted(k for k in keys if ".tmp-" not in k)

    def delete(self, key: str) -> None:
        self._call("delete", key, self._backend.delete, self.path(key))

    def clean_leftovers(self, prefix: str = "", older_than_s: float = LEFTOVER_AGE_S, now: float | None = None) -> builtins.list[str]:
        """Remove what interrupted writes left under `prefix`: the `.tmp-` objects of an
        atomic write to a local folder whose writer died, and (S3) multipart uploads never
        completed. Only those older than `older_than_s` go: a write in flight is younger
        (a temporary file's mtime moves with every write it receives). `now` is the
        current time in seconds since the epoch (default: this machine's clock). Returns
        the keys removed, relative to the root."""
        if older_than_s < 0:
            raise ValueError(f"clean_leftovers: older_than_s must be >= 0 (got {older_than_s})")
        before = (time.time() if now is None else now) - older_than_s
        removed = []
        for path in self._call("list", prefix, self._backend.find, self.path(prefix)):
            key = path[len(self.root) + 1 :]
            if ".tmp-" not in key.rpartition("/")[2]:
                continue
            try:
                if self._call("stat", key, self._backend.modified, path) < before:
                    self.delete(key)
                    removed.append(key)
            except FileNotFoundError:  # its writer finished (renamed it) or removed it meanwhile
                continue
        aborted = self._call("abort", prefix, self._backend.abort_stale_uploads, self.path(prefix), before)
        removed += [p[len(self.root) + 1 :] for p in aborted]
        if removed:
            log.info("%s: removed %d leftovers of interrupted writes: %s", self.uri(prefix), len(removed), ", ".join(removed[:10]))
        return removed

    def remove_empty_folders(self, prefix: str) -> bool:
        """A local folder store: remove the folder `prefix` and the folders below it that
        hold no file (a folder outlives its last file there; object stores have no
        folders). Only empty folders go (`rmdir`), so a write that has just begun in one
        keeps it. True when `prefix` is gone afterwards."""
        if self.protocol != "file":
            return False
        top = self.path(prefix)
        for folder, _, _ in os.walk(top, topdown=False):
            try:
                os.rmdir(folder)
            except OSError:  # not empty (or gone): kept
                continue
        return not os.path.exists(top)

    # ------------------------------------------------------------------ large objects

    def put_file(self, key: str, local_path: str | os.PathLike) -> Transfer:
        """Upload a local file in parts (never whole in memory); atomic like `put_bytes`."""
        with open(local_path, "rb") as f:
            return self.put_stream(key, f, os.fstat(f.fileno()).st_size)

    def put_stream(self, key: str, stream: BinaryIO, size: int) -> Transfer:
        """Upload exactly `size` bytes from `stream`. A seekable stream is rewound and sent
        again when a transient error interrupts the upload; any other stream is tried once."""
        start = stream.tell() if stream.seekable() else None
        sent = 0
        digest = ""

        def attempt() -> None:
            nonlocal sent, digest
            if start is not None:
                stream.seek(start)
            reader = _HashingReader(stream)
            try:
                self._backend.put_stream(self.path(key), reader, size)
            finally:
                sent += reader.digest.count
            if reader.digest.count != size:
                raise OSError(f"{self.uri(key)}: read {reader.digest.count} bytes from the stream, expected {size}")
            digest = reader.digest.hash.hexdigest()

        self._call("put", key, attempt, retry=start is not None)
        return Transfer(self.uri(key), size, digest, sent)

    def get_file(self, key: str, local_path: str | os.PathLike, *, checksum: bool = True) -> Transfer:
        """Download to `local_path`, through `<local_path>.part`, renamed into place at the
        end. Bytes already in the `.part` file (an interrupted earlier call, or an earlier
        attempt of this one) are kept and only the rest is requested. `checksum=False`
        skips the sha256 (Transfer.sha256 is then empty)."""
        local = Path(local_path)
        part = local.with_name(local.name + ".part")
        path = self.path(key)
        size = self.size(key)
        make_private_dirs(local.parent)
        if part.exists() and part.stat().st_size > size:  # not a prefix of this object
            part.unlink()
        digest = _Digest() if checksum else None
        fetched = 0

        def attempt() -> None:
            nonlocal digest, fetched
            # 0600: a download is a checkpoint's weights or a run's batches
            with open(os.open(part, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as f:
                offset = f.tell()
                if digest is not None and digest.count != offset:
                    # bytes from an earlier call, or hashed but never written when an
                    # attempt broke off: hash what is on disk
                    digest = _Digest.of_file(part, offset, self.part_size)
                chunks = _prefetch(
                    self._backend.iter_range(path, offset, size, self.part_size),
                    on_chunk=digest.update if digest is not None else None,
                )
                with closing(chunks):
                    for data in chunks:
                        f.write(data)
                        fetched += len(data)

        self._call("get", key, attempt)
        got = part.stat().st_size
        if got != size:
            raise OSError(f"{self.uri(key)}: downloaded {got} bytes, the object has {size}; was it replaced meanwhile?")
        fsync_file(part)  # on disk before the name says the download is complete
        os.replace(part, local)
        fsync_dir(local.parent)
        return Transfer(self.uri(key), size, digest.hash.hexdigest() if digest is not None else "", fetched)

    def sha256(self, key: str) -> tuple[int, str]:
        """(size, sha256) of the stored object, streamed; resumes after a transient error."""
        path = self.path(key)
        size = self.size(key)
        digest = _Digest()

        def attempt() -> None:
            with closing(_prefetch(self._backend.iter_range(path, digest.count, size, self.part_size), on_chunk=digest.update)) as chunks:
                for _ in chunks:
                    pass

        self._call("read", key, attempt)
        if digest.count != size:
            raise OSError(f"{self.uri(key)}: read {digest.count} bytes, the object has {size}")
        return size, digest.hash.hexdigest()

    # ------------------------------------------------------------------ retries

    def _call(self, op: str, key: str, fn: Callable[..., T], *args, retry: bool = True) -> T:
        """Run `fn(*args)`, retrying transient errors; failures name the operation and key
        and never carry a secret."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_transient),
            stop=tenacity.stop_after_delay(self.retry_timeout_s if retry else 0),
            wait=tenacity.wait_exponential_jitter(initial=self.retry_initial_s, max=self.retry_max_s, jitter=self.retry_initial_s / 2),
            before_sleep=lambda state: self._log_retry(op, key, state),
            reraise=True,
        )
        started = time.monotonic()
        try:
            return retrying(fn, *args)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                raise
            text = f"{type(exc).__name__}: {exc}"
            if missing_credentials(exc):
                raise StorageConfigError(
                    f"{self.uri(key)}: no S3 credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                    "in the environment (or give botocore a profile or an instance role)"
                ) from None
            if is_transient(exc):
                if retry:
                    message = (
                        f"{self.uri(key)}: {op} still failing after {time.monotonic() - started:.1f}s of retries "
                        f"({redact(text)}); is the store reachable? ObjectStore(..., retry_timeout_s=...) waits longer"
                    )
                else:
                    message = f"{self.uri(key)}: {op} failed ({redact(text)}); not retried: the stream cannot be rewound"
                raise StoreUnavailable(message) from (None if _chain_has_secret(exc) else exc)
            if _chain_has_secret(exc):
                raise ObjectStoreError(f"{self.uri(key)}: {op} failed: {redact(text)}") from None
            raise

    def _log_retry(self, op: str, key: str, state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning(
            "%s: %s failed (%s), retry %d in %.1fs",
            self.uri(key), op, redact(f"{type(exc).__name__}: {exc}"), state.attempt_number,
            state.next_action.sleep if state.next_action else 0.0,
        )  # fmt: skip


def _rebuild(url: str, options: dict) -> ObjectStore:
    return ObjectStore(url, **options)


def _chain_has_secret(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 8:
        if contains_secret(f"{exc!r} {exc}"):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


_DONE = object()


def _prefetch(chunks: Iterator[bytes], depth: int = 3, on_chunk: Callable[[bytes], None] | None = None) -> Generator[bytes, None, None]:
    """Pull `chunks` in a helper thread, `depth` ahead, so that network reads (and
    `on_chunk`, the checksum) overlap the caller's disk writes. Errors are raised in the
    caller's thread, after the chunks that came before them."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def pump() -> None:
        try:
            for data in chunks:
                if on_chunk is not None:
                    on_chunk(data)
                if not put(data):
                    return
            put(_DONE)
        except BaseException as exc:  # handed to the consumer
            put(_Failure(exc))
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=pump, name="ratchet-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item
    finally:
        stop.set()
        thread.join()


@dataclass
class _Failure:
    exc: BaseException
