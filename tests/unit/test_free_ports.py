"""free_ports: the ports tests and benchmarks give their own services."""

import socket

from ratchet.platform.services import RAY_WORKER_PORTS, free_ports
from ratchet.platform.services.settings import _ephemeral_range, _is_free


def test_ports_are_distinct_free_and_outside_the_ranges_others_take_from():
    """A port from the kernel's ephemeral range can be taken by any outgoing connection
    before the service binds it (a Ray GCS in CI failed so: 'Address already in use')."""
    ports = free_ports(50)
    low, _ = _ephemeral_range()
    assert len(set(ports)) == 50
    for port in ports:
        assert RAY_WORKER_PORTS[1] < port < low, port
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))


def test_a_port_in_use_is_not_free():
    (port,) = free_ports(1)
    assert _is_free(port)
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        assert not _is_free(port)
