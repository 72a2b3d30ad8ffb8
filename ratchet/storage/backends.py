"""The storage backends behind `ObjectStore`, and what they share.

`ObjectStore` keeps its one-argument constructor (`ObjectStore(url)`) and picks a backend
from the URL scheme (the table in `schemes.py`); callers never see which one. A backend does single attempts on full
paths (`bucket/prefix/key`, or a local path); `ObjectStore` adds retries, key mapping and
checksums on top, so each backend stays a thin translation to its client library.

Endpoints and credentials come from the process environment only (the standard AWS
variable names), never from URLs, configs or payloads: a URL can travel through Temporal
history and logs, a secret must not. Nothing here logs or formats a secret; `redact`
scrubs the current secret values from any text that leaves this package.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol
from urllib.parse import urlsplit

import fsspec

from .keys import check_path

log = logging.getLogger(__name__)

MIN_PART_SIZE = 5 << 20  # S3 refuses smaller multipart parts (except the last)
MAX_PARTS = 10_000  # S3's limit on parts per multipart upload

ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
SECRET_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN")


class StorageConfigError(ValueError):
    """The environment does not say how to reach the store (names the variable to set)."""


class Backend(Protocol):
    """Single-attempt operations on full paths. Writes are atomic: a reader sees the old
    object or the new one, never a part; a failed write leaves the old one (or nothing)."""

    protocol: str

    def put_bytes(self, path: str, data: bytes) -> None: ...

    def put_stream(self, path: str, stream: BinaryIO, size: int) -> None:
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


# --------------------------------------------------------------------------- environment


def redact(text: str) -> str:
    """`text` with the current values of the credential variables replaced by `***`."""
    for var in SECRET_VARS:
        value = os.environ.get(var)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


def contains_secret(text: str) -> bool:
    return redact(text) != text


@dataclass(frozen=True)
class S3Settings:
    """How to reach an S3-protocol server, read from the environment. `repr` hides the
    keys; only `endpoint_for_messages` may appear in logs and errors."""

    endpoint: str | None
    region: str | None
    access_key: str | None = field(default=None, repr=False)
    secret_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, url: str, *, require_endpoint: bool, require_keys: bool) -> "S3Settings":
        endpoint_var = next((v for v in ENDPOINT_VARS if os.environ.get(v)), None)
        endpoint = os.environ[endpoint_var].strip() if endpoint_var else None
        if endpoint is None and require_endpoint:
            raise StorageConfigError(
                f"{url}: no S3 endpoint configured; set AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) "
                "in the environment, e.g. AWS_ENDPOINT_URL=http://127.0.0.1:9000"
            )
        if endpoint is not None:
            parts = urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise StorageConfigError(
                    f"{url}: {endpoint_var} must look like http://host:port or https://host:port "
                    "(the scheme decides TLS)"
                )
            if parts.username or parts.password:
                raise StorageConfigError(
                    f"{url}: {endpoint_var} must not embed credentials; "
                    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY instead"
                )
            if parts.path not in ("", "/"):
                raise StorageConfigError(f"{url}: {endpoint_var} must not have a path (path-style endpoint: scheme://host:port)")
        key = os.environ.get("AWS_ACCESS_KEY_ID") or None
        secret = os.environ.get("AWS_SECRET_ACCESS_KEY") or None
        if (key is None) != (secret is None) or (require_keys and key is None):
            missing = "AWS_ACCESS_KEY_ID" if key is None else "AWS_SECRET_ACCESS_KEY"
            raise StorageConfigError(
                f"{url}: {missing} is not set; set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "in the environment of every process that uses this store"
            )
        return cls(
            endpoint=endpoint.rstrip("/") if endpoint else None,
            region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None,
            access_key=key,
            secret_key=secret,
            session_token=os.environ.get("AWS_SESSION_TOKEN") or None,
        )

    @property
    def endpoint_for_messages(self) -> str:
        if not self.endpoint:
            return "the default AWS endpoint"
        parts = urlsplit(self.endpoint)
        return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


# --------------------------------------------------------------------------- errors


_TRANSIENT_CODES = {
    "InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "RequestTimeTooSkewed",
    "Throttling", "ThrottlingException", "RequestLimitExceeded", "OperationAborted", "503", "500", "502", "504",
}  # fmt: skip


def _transient_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        import urllib3.exceptions as u

        types += [u.ProtocolError, u.TimeoutError, u.NewConnectionError, u.MaxRetryError]
    except ImportError:  # pragma: no cover
        pass
    try:
        import botocore.exceptions as b

        types += [b.ConnectionError, b.HTTPClientError]
    except ImportError:  # pragma: no cover
        pass
    try:
        import aiohttp

        types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ServerTimeoutError]
    except ImportError:  # pragma: no cover
        pass
    from fsspec.exceptions import FSTimeoutError

    types.append(FSTimeoutError)
    return tuple(types)


_TRANSIENT_TYPES: tuple[type[BaseException], ...] | None = None


def _status_code(exc: BaseException) -> tuple[str | None, int | None]:
    """(error code, HTTP status) of a botocore ClientError or a minio error, else Nones."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        err = response.get("Error", {})
        return err.get("Code"), response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = getattr(exc, "code", None)  # minio S3Error
    status = getattr(response, "status", None)  # minio S3Error's HTTP response
    for attr in ("_status_code", "_code"):  # minio ServerError, InvalidResponseError
        value = getattr(exc, attr, None)
        if isinstance(value, int):
            status = value
    return (code if isinstance(code, str) else None), (status if isinstance(status, int) else None)


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: a connection, timeout or server-side (5xx, throttling) failure,
    directly or as the cause of the exception a client library raised."""
    global _TRANSIENT_TYPES
    if _TRANSIENT_TYPES is None:
        _TRANSIENT_TYPES = _transient_types()
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, _TRANSIENT_TYPES):
            return True
        code, status = _status_code(exc)
        if code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429)):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def missing_credentials(exc: BaseException) -> bool:
    """botocore found no credentials anywhere (environment, profiles, instance role)."""
    return type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError")


def is_not_found(exc: BaseException) -> bool:
    code, status = _status_code(exc)
    return isinstance(exc, FileNotFoundError) or code in ("NoSuchKey", "NotFound", "404") or status == 404


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


def upload_parts(stream: BinaryIO, size: int, part_size: int, concurrency: int, upload) -> list:
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
        if f.exception() is not None:
            raise f.exception()
    return [f.result() for f in futures]


# --------------------------------------------------------------------------- fsspec


class FsspecBackend:
    """Any fsspec filesystem. Local folders (and other filesystems) write to a temporary
    key and move it into place; S3 (`s3fs`) writes directly, since an S3 PUT or a completed
    multipart upload is already atomic, and aborts a failed multipart upload so that no
    partial object ever becomes visible (s3fs's own `open(..., "wb")` would commit one)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, *, part_size: int, concurrency: int):
        self.fs = fs
        self.protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.is_s3 = self.protocol in ("s3", "s3a")
        self.is_local = self.protocol in ("file", "local")
        self.part_size = part_size
        self.concurrency = concurrency

    @classmethod
    def for_url(cls, url: str, *, part_size: int, concurrency: int) -> tuple["FsspecBackend", str]:
        scheme = urlsplit(url).scheme if "://" in url else ""
        if scheme in ("s3", "s3a"):
            fs = _s3_filesystem(url)
            path = fs._strip_protocol(url)
        else:
            fs, path = fsspec.core.url_to_fs(url)
        return cls(fs, part_size=part_size, concurrency=concurrency), path

    def __repr__(self) -> str:
        return f"FsspecBackend({self.protocol})"

    # writes

    def put_bytes(self, path: str, data: bytes) -> None:
        check_path(path)
        if self.is_s3:
            self.fs.pipe_file(path, data)
            return
        tmp = self._tmp_for(path)
        try:
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
                self._sync(f)
            self._move_into_place(tmp, path)
        except BaseException:
            self._discard(tmp)
            raise

    def put_stream(self, path: str, stream: BinaryIO, size: int) -> None:
        check_path(path)
        if self.is_s3:
            self._s3_put_stream(path, stream, size)
            return
        tmp = self._tmp_for(path)
        try:
            with self.fs.open(tmp, "wb") as f:
                left = size
                while left:
                    data = stream.read(min(self.part_size, left))
                    if not data:
                        raise OSError(f"stream ended after {size - left} of {size} bytes")
                    f.write(data)
                    left -= len(data)
                self._sync(f)
            self._move_into_place(tmp, path)
        except BaseException:
            self._discard(tmp)
            raise

    def _sync(self, f) -> None:
        # Local folders: the bytes reach the disk before the rename publishes them, so a
        # machine crash leaves the old object or the new one, never an empty new name.
        if self.is_local:
            f.flush()
            os.fsync(f.fileno())

    def _move_into_place(self, tmp: str, path: str) -> None:
        self.fs.mv(tmp, path)
        if self.is_local:
            fsync_dir(os.path.dirname(path))

    def _tmp_for(self, path: str) -> str:
        self.fs.makedirs(path.rpartition("/")[0], exist_ok=True)
        return f"{path}.tmp-{uuid.uuid4().hex}"

    def _discard(self, tmp: str) -> None:
        # Leave nothing behind: the previous object (if any) is still the visible one.
        try:
            self.fs.rm(tmp)
        except (FileNotFoundError, OSError):
            pass

    def _s3_put_stream(self, path: str, stream: BinaryIO, size: int) -> None:
        bucket, key, _ = self.fs.split_path(path)
        part_size = part_size_for(size, self.part_size, self.concurrency)
        if size <= part_size:
            data = stream.read(size)
            if len(data) != size:
                raise OSError(f"stream ended after {len(data)} of {size} bytes")
            self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data)
        else:
            upload_id = self.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
            try:

                def one(number: int, data: bytes) -> dict:
                    out = self.fs.call_s3(
                        "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data
                    )
                    return {"PartNumber": number, "ETag": out["ETag"]}

                parts = upload_parts(stream, size, part_size, self.concurrency, one)
                self.fs.call_s3(
                    "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )  # fmt: skip
            except BaseException:
                try:
                    self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
                except Exception as exc:  # the upload stays invisible; a lifecycle rule reaps it
                    log.warning("could not abort multipart upload of %s: %s", path, redact(f"{type(exc).__name__}: {exc}"))
                raise
        self.fs.invalidate_cache(path)

    # reads

    def get_bytes(self, path: str) -> bytes:
        check_path(path)
        with self.fs.open(path, "rb") as f:
            return f.read()

    def iter_range(self, path: str, start: int, end: int, chunk_size: int) -> Iterator[bytes]:
        check_path(path)
        if start >= end:
            return
        if self.is_s3:
            yield from self._s3_iter_range(path, start, end, chunk_size)
            return
        with self.fs.open(path, "rb", block_size=chunk_size) as f:
            f.seek(start)
            pos = start
            while pos < end:
                data = f.read(min(chunk_size, end - pos))
                if not data:
                    raise OSError(f"{path}: object ended at byte {pos}, expected {end}")
                pos += len(data)
                yield data

    def _s3_iter_range(self, path: str, start: int, end: int, chunk_size: int) -> Iterator[bytes]:
        # One streaming GET read in chunks: s3fs's file objects issue a request per block
        # and its `cat_file` buffers through aiohttp several times slower.
        from fsspec.asyn import sync

        bucket, key, _ = self.fs.split_path(path)
        resp = self.fs.call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        body = resp["Body"]

        async def read_chunk() -> bytes:
            # body.read(n) returns what the socket has (often ~100 KiB); gather a whole chunk
            # per hop between threads.
            parts, got = [], 0
            while got < chunk_size:
                data = await body.read(chunk_size - got)
                if not data:
                    break
                parts.append(data)
                got += len(data)
            return b"".join(parts)

        async def close() -> None:
            body.close()

        try:
            while data := sync(self.fs.loop, read_chunk):
                yield data
        finally:
            try:
                sync(self.fs.loop, close)
            except Exception:  # pragma: no cover - closing a broken connection
                pass

    def size(self, path: str) -> int:
        info = self.fs.info(check_path(path))
        if info.get("type") == "directory":
            raise FileNotFoundError(path)
        return int(info["size"])

    def modified(self, path: str) -> float:
        return self.fs.modified(check_path(path)).timestamp()

    def exists(self, path: str) -> bool:
        return self.fs.exists(check_path(path))

    def find(self, path: str) -> list[str]:
        base = check_path(path).rstrip("/")
        if not self.fs.exists(base):
            return []
        return list(self.fs.find(base))

    def delete(self, path: str) -> None:
        if self.fs.exists(check_path(path)):
            self.fs.rm(path, recursive=True)

    def abort_stale_uploads(self, path: str, before: float) -> list[str]:
        if not self.is_s3:
            return []  # local writes leave `.tmp-` files instead; ObjectStore removes those
        bucket, key, _ = self.fs.split_path(check_path(path))
        out = []
        for upload in self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key).get("Uploads", []):
            inside = not key or upload["Key"] == key or upload["Key"].startswith(f"{key}/")
            if inside and upload["Initiated"].timestamp() < before:
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                out.append(f"{bucket}/{upload['Key']}")
        return out


# --------------------------------------------------------------------------- openers
# What `schemes.SCHEMES` names: fn(url, *, part_size, concurrency) -> (backend, root path).


def open_fsspec(url: str, *, part_size: int, concurrency: int) -> tuple[FsspecBackend, str]:
    """file://, plain paths, s3:// and s3a:// (s3fs), memory://: through fsspec."""
    return FsspecBackend.for_url(url, part_size=part_size, concurrency=concurrency)


def open_minio(url: str, *, part_size: int, concurrency: int) -> tuple[Backend, str]:
    """minio://bucket[/prefix]: through the minio client (imported only for such a store)."""
    from .minio_backend import MinioBackend

    path = url.split("://", 1)[1]
    if not path.strip("/"):
        raise ValueError(f"{url}: a minio URL needs a bucket: minio://bucket[/prefix]")
    return MinioBackend(url, part_size=part_size, concurrency=concurrency), path


def _s3_filesystem(url: str) -> fsspec.AbstractFileSystem:
    """An s3fs filesystem configured from the environment. botocore does not retry and s3fs
    retries only a connection dropped mid-request (a blip inside a multipart upload), so
    that ObjectStore's backoff, with its time bound and its log lines, decides the rest."""
    import s3fs

    env = S3Settings.from_env(url, require_endpoint=False, require_keys=False)
    client_kwargs = {}
    if env.endpoint:
        client_kwargs["endpoint_url"] = env.endpoint
    if env.region:
        client_kwargs["region_name"] = env.region
    fs = s3fs.S3FileSystem(
        key=env.access_key,
        secret=env.secret_key,
        token=env.session_token,
        client_kwargs=client_kwargs,
        config_kwargs={"retries": {"total_max_attempts": 1, "mode": "standard"}, "connect_timeout": 10, "read_timeout": 120},
        # Listings from another process (another worker committing) must be seen at once.
        use_listings_cache=False,
    )
    fs.retries = 3  # s3fs's own attempts per request (a class attribute, not an argument)
    return fs
