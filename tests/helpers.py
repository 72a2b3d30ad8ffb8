"""Shared test helpers (imported by test modules; fixtures live in conftest.py)."""

from __future__ import annotations

import socket

from ratchet.platform.services import RAY_WORKER_PORTS

# Ports `ray start` reserves or uses by default, which a picked port must avoid.
AVOID_PORTS = set(range(RAY_WORKER_PORTS[0], RAY_WORKER_PORTS[1] + 1)) | {6379, 7233, 8233, 8265, 10001, 52365}


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that were free a moment ago, outside Ray's reserved ranges."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port not in AVOID_PORTS and port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports
