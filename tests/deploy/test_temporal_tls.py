"""TLS to Temporal, for real: a dev server behind a TLS-terminating proxy that demands a
client certificate (what a secured cluster's frontend does), reached through the
RATCHET_TEMPORAL_TLS_* variables by the client (`Client.connect`) and by the worker's
connect path (`worker._connect_temporal`). The proxy only decrypts and forwards bytes, so
a connection that works proved the CA, the client certificate and the server name were
all used; the two refusals prove they are not ignored. (The dev server itself has no TLS.)"""

from __future__ import annotations

import asyncio
import ssl
import threading

import pytest

from ratchet.platform.services import free_ports
from tests.deploy.certs import make_certs

SERVER_NAME = "temporal.test"  # only in the certificate's SAN: connecting needs the server-name variable


class _TLSProxy:
    """The dev server and a TLS proxy in front of it, on an event loop in a thread (the
    ratchet client runs its own loop in the test's thread)."""

    def __init__(self, certs):
        self.certs = certs
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.stop: asyncio.Event | None = None
        self.error: BaseException | None = None
        self.port = free_ports(1)[0]
        self.handshakes = 0
        self.writers: set = set()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.certs.ca))
        ctx.load_cert_chain(str(self.certs.server_cert), str(self.certs.server_key))
        ctx.verify_mode = ssl.CERT_REQUIRED  # mTLS: no client certificate, no connection
        ctx.set_alpn_protocols(["h2"])  # gRPC
        return ctx

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc
            self.ready.set()

    async def _serve(self) -> None:
        from tests.faults.standins import dev_server

        self.stop = asyncio.Event()
        async with dev_server() as env:
            host, port = env.client.service_client.config.target_host.rsplit(":", 1)

            async def pump(reader, writer):
                try:
                    while data := await reader.read(65536):
                        writer.write(data)
                        await writer.drain()
                except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
                    pass
                finally:
                    writer.close()

            async def handle(client_reader, client_writer):
                self.handshakes += 1
                up_reader, up_writer = await asyncio.open_connection(host, int(port))
                self.writers |= {client_writer, up_writer}
                await asyncio.gather(pump(client_reader, up_writer), pump(up_reader, client_writer))
                self.writers -= {client_writer, up_writer}

            server = await asyncio.start_server(handle, "127.0.0.1", self.port, ssl=self._ssl())
            async with server:
                self.ready.set()
                await self.stop.wait()
            # Connections the clients left open: close them, let their pumps finish.
            for writer in list(self.writers):
                writer.close()
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            await asyncio.wait(pending, timeout=5)

    def __enter__(self) -> "_TLSProxy":
        self.thread.start()
        assert self.ready.wait(60), "dev server and proxy did not start"
        if self.error:
            raise self.error
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    # The server's certificate names SERVER_NAME only, not 127.0.0.1, as a cluster's would.
    certs = make_certs(tmp_path_factory.mktemp("certs"), server_name=SERVER_NAME, local_names=False)
    with _TLSProxy(certs) as p:
        yield p


def _mtls_env(monkeypatch, certs, **overrides):
    from ratchet.platform.temporal_connection import ALL_VARS

    for name in ALL_VARS:
        monkeypatch.delenv(name, raising=False)
    env = {
        "RATCHET_TEMPORAL_TLS_CA": str(certs.ca),
        "RATCHET_TEMPORAL_TLS_CERT": str(certs.client_cert),
        "RATCHET_TEMPORAL_TLS_KEY": str(certs.client_key),
        "RATCHET_TEMPORAL_TLS_SERVER_NAME": SERVER_NAME,
        **overrides,
    }
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


def test_client_and_worker_connect_over_mtls(proxy, monkeypatch):
    from temporalio.client import Client as TemporalClient

    from ratchet.platform.client import Client
    from ratchet.platform.worker import WorkerSettings, _connect_temporal

    _mtls_env(monkeypatch, proxy.certs)
    before = proxy.handshakes
    client = Client.connect(proxy.address)
    # A real round trip through the proxy: the dev server answers a visibility query.
    assert client._run(client._temporal.count_workflows()).count == 0
    worker_client = asyncio.run(_connect_temporal(TemporalClient, WorkerSettings(temporal_address=proxy.address), timeout_s=10))
    assert worker_client.namespace == "default"
    assert proxy.handshakes > before


@pytest.mark.parametrize(
    "unset, reason",
    [
        # No client certificate: the server ends the connection (TLS 1.3 reports it at the
        # first read, worded by whichever layer sees it first).
        (
            ("RATCHET_TEMPORAL_TLS_CERT", "RATCHET_TEMPORAL_TLS_KEY"),
            "transport error|close_notify|UnexpectedEof|connection closed|CertificateRequired|reset",
        ),
        # The certificate names temporal.test, not the address connected to.
        (("RATCHET_TEMPORAL_TLS_SERVER_NAME",), "NotValidForName"),
        # The system's roots do not know the test CA.
        (("RATCHET_TEMPORAL_TLS_CA",), "UnknownIssuer"),
    ],
)
def test_each_tls_setting_is_needed(proxy, monkeypatch, unset, reason):
    from ratchet.platform.client import Client

    _mtls_env(monkeypatch, proxy.certs, **{name: None for name in unset})
    with pytest.raises(RuntimeError, match=f"Failed client connect.*({reason})"):
        Client.connect(proxy.address)


def test_a_server_outside_the_trusted_ca_is_refused(proxy, monkeypatch, tmp_path):
    from ratchet.platform.client import Client

    other = make_certs(tmp_path / "other")  # a CA that did not sign the proxy's certificate
    _mtls_env(monkeypatch, proxy.certs, RATCHET_TEMPORAL_TLS_CA=str(other.ca))
    with pytest.raises(RuntimeError, match="Failed client connect.*(UnknownIssuer|BadSignature)"):
        Client.connect(proxy.address)
