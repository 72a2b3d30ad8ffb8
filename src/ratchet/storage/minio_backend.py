"""`minio://bucket/prefix`: the same objects as `s3://`, through the `minio` client.

The minio client is small, synchronous and uploads multipart parts in parallel threads; it
talks path-style to any S3-protocol server (MinIO, Ceph, moto, AWS). The endpoint comes
from `AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`) and its scheme decides TLS; the keys come
from `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (and `AWS_SESSION_TOKEN`, if set).
A failed multipart upload is aborted by the client, so no partial object becomes visible.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from urllib.parse import urlsplit

import urllib3
from minio import Minio
from minio.deleteobjects import DeleteObject
from minio.error import S3Error

from .backends import Readable, part_size_for
from .failures import is_not_found
from .s3_env import S3Settings
from .keys import check_path


class MinioBackend:
    protocol = "minio"

    def __init__(self, url: str, *, part_size: int, concurrency: int):
        env = S3Settings.from_env(url, require_endpoint=True, require_keys=True)
        parts = urlsplit(env.endpoint)
        self.endpoint = env.endpoint_for_messages
        self.part_size = part_size
        self.concurrency = concurrency
        # The library's own retries stay short: ObjectStore retries whole operations with
        # backoff, and a long hidden retry loop would make its time bound meaningless.
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=10, read=120),
            maxsize=max(10, concurrency + 2),
            retries=urllib3.Retry(total=2, backoff_factor=0.1, status_forcelist=[500, 502, 503, 504]),
        )
        self._client = Minio(
            parts.netloc,
            access_key=env.access_key,
            secret_key=env.secret_key,
            session_token=env.session_token,
            secure=parts.scheme == "https",
            region=env.region,
            http_client=http,
        )

    def __repr__(self) -> str:
        return f"MinioBackend({self.endpoint})"

    @staticmethod
    def split(path: str) -> tuple[str, str]:
        """(bucket, key) of a full path; every method goes through here, so every key is
        checked (no `..`, backslash or NUL) before it reaches the server."""
        bucket, _, key = check_path(path).partition("/")
        return bucket, key

    # writes

    def put_bytes(self, path: str, data: bytes) -> None:
        self.put_stream(path, io.BytesIO(data), len(data))

    def put_stream(self, path: str, stream: Readable, size: int) -> None:
        bucket, key = self.split(path)
        self._client.put_object(
            bucket, key, stream, size,
            part_size=part_size_for(size, self.part_size, self.concurrency),
            num_parallel_uploads=self.concurrency,
        )  # fmt: skip

    # reads

    def get_bytes(self, path: str) -> bytes:
        bucket, key = self.split(path)
        resp = self._not_found_as_oserror(path, self._client.get_object, bucket, key)
        try:
            return resp.read()
        finally:
            resp.close()
            resp.release_conn()

    def iter_range(self, path: str, start: int, end: int, chunk_size: int) -> Iterator[bytes]:
        if start >= end:
            return
        bucket, key = self.split(path)
        resp = self._not_found_as_oserror(path, self._client.get_object, bucket, key, offset=start, length=end - start)
        try:
            yield from resp.stream(chunk_size)
        finally:
            resp.close()
            resp.release_conn()

    def size(self, path: str) -> int:
        bucket, key = self.split(path)
        return int(self._not_found_as_oserror(path, self._client.stat_object, bucket, key).size)

    def modified(self, path: str) -> float:
        bucket, key = self.split(path)
        return self._not_found_as_oserror(path, self._client.stat_object, bucket, key).last_modified.timestamp()

    def exists(self, path: str) -> bool:
        try:
            self.size(path)
            return True
        except FileNotFoundError:
            return bool(self.find(path))

    def find(self, path: str) -> list[str]:
        bucket, key = self.split(path.rstrip("/"))
        under = f"{key}/" if key else ""
        try:
            names = [o.object_name for o in self._client.list_objects(bucket, prefix=key, recursive=True)]
        except S3Error as exc:
            if exc.code == "NoSuchBucket":
                return []
            raise
        return [f"{bucket}/{n}" for n in names if n == key or n.startswith(under)]

    def abort_stale_uploads(self, path: str, before: float) -> list[str]:
        # The minio client lists and aborts uploads through methods it keeps private;
        # without them, uploads a killed writer left are for a bucket lifecycle rule to reap.
        bucket, key = self.split(path.rstrip("/"))
        lister = getattr(self._client, "_list_multipart_uploads", None)
        abort = getattr(self._client, "_abort_multipart_upload", None)
        if lister is None or abort is None:
            return []
        out = []
        for upload in lister(bucket, prefix=key).uploads:
            when = upload.initiated_time
            inside = not key or upload.object_name == key or upload.object_name.startswith(f"{key}/")
            if inside and when is not None and when.timestamp() < before:
                abort(bucket, upload.object_name, upload.upload_id)
                out.append(f"{bucket}/{upload.object_name}")
        return out

    def delete(self, path: str) -> None:
        bucket, _ = self.split(path)
        keys = [self.split(p)[1] for p in self.find(path)]
        for start in range(0, len(keys), 1000):  # the S3 limit per DeleteObjects request
            errors = self._client.remove_objects(bucket, [DeleteObject(k) for k in keys[start : start + 1000]])
            for err in errors:  # lazy: iterating sends the request
                raise OSError(f"could not delete {bucket}/{err.name}: {err.code} {err.message}")

    @staticmethod
    def _not_found_as_oserror(path: str, fn, *args, **kwargs):
        """Missing objects raise FileNotFoundError, as they do through fsspec."""
        try:
            return fn(*args, **kwargs)
        except S3Error as exc:
            if is_not_found(exc) or exc.code == "NoSuchBucket":
                raise FileNotFoundError(f"{path}: {exc.code}") from None
            raise


def open_minio(url: str, *, part_size: int, concurrency: int) -> tuple[MinioBackend, str]:
    """minio://bucket[/prefix] (catalog/storage_schemes.py's opener for it: this module, and so the minio
    client, is imported only for such a store)."""
    path = url.split("://", 1)[1]
    if not path.strip("/"):
        raise ValueError(f"{url}: a minio URL needs a bucket: minio://bucket[/prefix]")
    return MinioBackend(url, part_size=part_size, concurrency=concurrency), path
