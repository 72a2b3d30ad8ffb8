"""Is a service there? One-line reasons for a Temporal frontend or a Ray GCS that accepts no
connection, each naming the service, its address, why, and the command that starts it
(`ratchet worker` checks both before joining either; the CLI prints the same lines)."""

from __future__ import annotations

import asyncio
import logging
import time

# `ratchet worker` prints this logger plainly (see worker.py): the waiting line goes there.
status_log = logging.getLogger("ratchet.platform.worker.status")

TEMPORAL_FIX = "start the services with `ratchet up` (or set RATCHET_TEMPORAL_ADDRESS)"
RAY_FIX = "start the services with `ratchet up` (or set RATCHET_RAY_ADDRESS)"


class ServiceUnreachable(RuntimeError):
    """A service does not accept connections: `str()` is the one line a user reads, naming
    it, its address, why, and the command that starts it. A RuntimeError, as the SDK's own
    connection failure is, so that code retrying those retries this too."""

    def __init__(self, problems: list[tuple[str, str, str]], fix: str):
        self.problems = problems  # (service, address, reason)
        self.fix = fix
        named = " or ".join(f"the {service} at {address} ({reason})" for service, address, reason in problems)
        super().__init__(f"cannot reach {named}: {fix}")

    @classmethod
    def temporal(cls, address: str, reason: str) -> "ServiceUnreachable":
        tls = reason.startswith("TLS")
        fix = "check the RATCHET_TEMPORAL_TLS_* settings (docs/deploy.md)" if tls else TEMPORAL_FIX
        return cls([("Temporal server", address, reason)], fix)


def host_port(address: str) -> tuple[str, int] | None:
    """`host:port` (a scheme such as `ray://` or `http://` dropped); None when there is
    no port to probe (Ray's `auto`, a bare name): such an address is left to its library."""
    rest = address.split("://", 1)[-1].rsplit("/", 1)[0] if "://" in address else address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def socket_error_reason(exc: OSError) -> str:
    import errno
    import socket

    if isinstance(exc, socket.gaierror):
        return "host not found"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    if exc.errno == errno.ECONNREFUSED:
        return "connection refused"
    return (exc.strerror or type(exc).__name__).lower()


def unreachable_reason(address: str, timeout: float = 2.0) -> str | None:
    """Why nothing accepts a TCP connection at `address` ("connection refused", "timed
    out", "host not found"), or None when something does (or it has no port to probe)."""
    import socket

    target = host_port(address)
    if target is None:
        return None
    try:
        with socket.create_connection(target, timeout=timeout):
            return None
    except OSError as exc:
        return socket_error_reason(exc)


def temporal_unreachable_reason(text: str) -> str:
    """The short reason inside the SDK's `Failed client connect: ...` error text."""
    lowered = text.lower()
    for needle, reason in (
        ("connectionrefused", "connection refused"), ("connection refused", "connection refused"),
        ("dns error", "host not found"), ("failed to lookup", "host not found"), ("name or service not known", "host not found"),
        ("timed out", "timed out"), ("timeout", "timed out"), ("deadline", "timed out"),
        ("certificate", "TLS handshake failed"), ("tls", "TLS handshake failed"),
    ):  # fmt: skip
        if needle in lowered:
            return reason
    return "connection failed"


def check_services(temporal: str, ray: str | None, wait_s: float = 0.0, every_s: float = 1.0) -> None:
    """Raise ServiceUnreachable naming every one of the Temporal frontend and the Ray GCS
    (`ray` None: not checked) that accepts no connection, after waiting up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        problems = [
            (service, address, reason)
            for service, address in (("Temporal server", temporal), ("Ray head (GCS)", ray))
            if address is not None and (reason := unreachable_reason(address)) is not None
        ]
        if not problems:
            return
        error = ServiceUnreachable(problems, TEMPORAL_FIX if problems[0][0].startswith("Temporal") else RAY_FIX)
        if len(problems) == 2:
            error = ServiceUnreachable(
                problems, "start the services with `ratchet up` (or set RATCHET_TEMPORAL_ADDRESS and RATCHET_RAY_ADDRESS)"
            )
        if time.monotonic() >= deadline:
            raise error
        if not said:
            status_log.warning("%s; waiting up to %g s", error, wait_s)
            said = True
        time.sleep(every_s)


async def tcp_unreachable_reason(address: str, timeout: float = 2.0) -> str | None:
    """unreachable_reason, without blocking the event loop."""
    target = host_port(address)
    if target is None:
        return None
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*target), timeout)
    except asyncio.TimeoutError:
        return "timed out"
    except OSError as exc:
        return socket_error_reason(exc)
    writer.close()
    return None
