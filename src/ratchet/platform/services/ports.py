"""Port probes: does something accept connections on a port, and is a port free for a
service to bind (with an error that names the variable that moves it)."""

from __future__ import annotations

import errno
import socket

from .settings import PORT_ENV, ServiceError, ServiceSettings

__all__ = ["can_connect", "check_port_free", "port_in_use"]


def can_connect(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_in_use(host: str, port: int, bind_host: str) -> bool:
    if can_connect(host, port, timeout=0.3):
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def check_port_free(settings: ServiceSettings, field_name: str, service: str, bind_host: str) -> None:
    port = getattr(settings, field_name)
    if port_in_use(settings.host, port, bind_host):
        env = PORT_ENV[field_name]
        raise ServiceError(
            f"port {port} ({service}) is already in use by a process ratchet did not "
            f"start (state dir {settings.state_dir}). Stop that process or choose another "
            f"port: set {env}=<port> (or ServiceSettings({field_name}=...))."
        )
