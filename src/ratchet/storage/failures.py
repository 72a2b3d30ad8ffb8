"""Which storage failures are worth retrying (connection, timeout, 5xx, throttling), and
which mean "no credentials" or "no such object", whatever client library raised them."""

from __future__ import annotations

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
    current: BaseException | None = exc
    while current is not None and seen < 8:
        if isinstance(current, _TRANSIENT_TYPES):
            return True
        code, status = _status_code(current)
        if code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status == 429)):
            return True
        current = current.__cause__ or current.__context__
        seen += 1
    return False


def missing_credentials(exc: BaseException) -> bool:
    """botocore found no credentials anywhere (environment, profiles, instance role)."""
    return type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError")


def is_not_found(exc: BaseException) -> bool:
    code, status = _status_code(exc)
    return isinstance(exc, FileNotFoundError) or code in ("NoSuchKey", "NotFound", "404") or status == 404
