"""A throw-away certificate authority for TLS tests: a CA, a server certificate for
127.0.0.1 / localhost and a client certificate, written as PEM files (RSA 2048: the key
type every TLS stack in the chain, rustls included, accepts)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CertFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _key():
    from cryptography.hazmat.primitives.asymmetric import rsa

    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write(path: Path, key=None, cert=None) -> Path:
    from cryptography.hazmat.primitives import serialization

    if key is not None:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        path.chmod(0o600)
    else:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def make_certs(folder: Path, server_name: str = "temporal.test", *, local_names: bool = True) -> CertFiles:
    """CA, server (SAN: `server_name`, and localhost, 127.0.0.1 with `local_names`) and
    client certificates."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.timezone.utc)
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ratchet test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(common_name: str, usage, sans):
        key = _key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return key, builder.sign(ca_key, hashes.SHA256())

    server_key, server = leaf(
        server_name,
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.DNSName(server_name)]
        + ([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))] if local_names else []),
    )
    client_key, client = leaf("ratchet-worker", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("ratchet-worker")])
    folder.mkdir(parents=True, exist_ok=True)
    return CertFiles(
        ca=_write(folder / "ca.pem", cert=ca),
        server_cert=_write(folder / "server.pem", cert=server),
        server_key=_write(folder / "server-key.pem", key=server_key),
        client_cert=_write(folder / "client.pem", cert=client),
        client_key=_write(folder / "client-key.pem", key=client_key),
    )
