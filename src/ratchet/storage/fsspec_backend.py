"""The fsspec backend: local folders, s3:// and s3a:// (s3fs), memory://, and how an s3fs
filesystem is configured from the environment."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import fsspec

from ratchet.private_paths import make_private_dirs

from .backends import Readable, fsync_dir, part_size_for, upload_parts
from .keys import check_path
from .s3_env import S3Settings, redact

log = logging.getLogger(__name__)


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

    def put_stream(self, path: str, stream: Readable, size: int) -> None:
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
        # And they are private (0600 in 0700 folders, whatever the umask): a local store
        # holds weights, prompts and responses.
        if self.is_local:
            f.flush()
            os.fchmod(f.fileno(), 0o600)
            os.fsync(f.fileno())

    def _move_into_place(self, tmp: str, path: str) -> None:
        self.fs.mv(tmp, path)
        if self.is_local:
            fsync_dir(os.path.dirname(path))

    def _tmp_for(self, path: str) -> str:
        folder = path.rpartition("/")[0]
        if self.is_local:
            make_private_dirs(folder)
        else:
            self.fs.makedirs(folder, exist_ok=True)
        return f"{path}.tmp-{uuid.uuid4().hex}"

    def _discard(self, tmp: str) -> None:
        # Leave nothing behind: the previous object (if any) is still the visible one.
        try:
            self.fs.rm(tmp)
        except (FileNotFoundError, OSError):
            pass

    def _s3_put_stream(self, path: str, stream: Readable, size: int) -> None:
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
                    out = self.fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data)
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


def open_fsspec(url: str, *, part_size: int, concurrency: int) -> tuple[FsspecBackend, str]:
    """file://, plain paths, s3:// and s3a:// (s3fs), memory://: through fsspec."""
    return FsspecBackend.for_url(url, part_size=part_size, concurrency=concurrency)


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
