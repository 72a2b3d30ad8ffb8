"""A real PostgreSQL server for the registry tests (one per session), and `db_url`: every
registry test runs once on SQLite and once on PostgreSQL.

The server is PostgreSQL 15 from the machine's packages, started with initdb and pg_ctl as
the `postgres` user in a private temp folder, listening on 127.0.0.1 and a free port only
(no unix socket outside that folder), with password authentication so the tests see a
URL that holds a password (it must never reach a log). Where the binaries or the
`postgres` user are missing, the PostgreSQL cases are skipped, saying why.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from ratchet.platform.services import free_ports

PG_BIN = Path(os.environ.get("RATCHET_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
PG_USER = "ratchet"
PG_PASSWORD = "pw-s3cr3t-never-logged"


@dataclass(frozen=True)
class PostgresServer:
    host: str
    port: int

    def url(self, database: str, *, password: str = PG_PASSWORD) -> str:
        return f"postgresql+psycopg://{PG_USER}:{password}@{self.host}:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(
            host=self.host, port=self.port, user=PG_USER, password=PG_PASSWORD, dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def _as_postgres(*cmd: str) -> subprocess.CompletedProcess:
    runner = [] if os.geteuid() != 0 else ["runuser", "-u", "postgres", "--"]
    return subprocess.run([*runner, *cmd], capture_output=True, text=True, timeout=60)


def _why_no_postgres() -> str | None:
    if not (PG_BIN / "initdb").exists():
        return f"PostgreSQL binaries not found in {PG_BIN} (set RATCHET_TEST_PG_BIN)"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser: cannot start PostgreSQL as the postgres user"
    try:
        import pwd

        pwd.getpwnam("postgres")
    except KeyError:
        return "no `postgres` user on this machine"
    return None


@pytest.fixture(scope="session")
def postgres() -> PostgresServer:
    why = _why_no_postgres()
    if why:
        pytest.skip(why)
    import pwd

    pg = pwd.getpwnam("postgres")
    top = Path(tempfile.mkdtemp(prefix="ratchet-pg-"))
    data, sock = top / "data", top / "sock"
    sock.mkdir()
    pwfile = top / "pw"
    pwfile.write_text(PG_PASSWORD + "\n")
    os.chmod(top, 0o700)
    for p in (top, sock, pwfile):
        os.chown(p, pg.pw_uid, pg.pw_gid)
    (port,) = free_ports(1)
    try:
        init = _as_postgres(
            str(PG_BIN / "initdb"), "-D", str(data), "-U", PG_USER, f"--pwfile={pwfile}",
            "--auth=scram-sha-256", "--encoding=UTF8", "--no-sync",
        )  # fmt: skip
        assert init.returncode == 0, init.stderr
        opts = f"-c listen_addresses=127.0.0.1 -p {port} -k {sock} -c fsync=off"
        start = _as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(top / "pg.log"), "-w", "-t", "60", "start")
        assert start.returncode == 0, start.stderr + (top / "pg.log").read_text(errors="replace")
        yield PostgresServer("127.0.0.1", port)
    finally:
        if data.exists():
            _as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(top, ignore_errors=True)


_names = itertools.count()


@pytest.fixture(autouse=True)
def _private_state_dir(tmp_path, monkeypatch):
    """Every test's default state folder (registry, MLflow store) is its own temp folder,
    never the checkout's .ratchet/."""
    monkeypatch.setenv("RATCHET_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("RATCHET_REGISTRY_URL", raising=False)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    """An empty database: a SQLite file, or a fresh database on the session's server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    server: PostgresServer = request.getfixturevalue("postgres")
    return server.create_database(f"t{os.getpid()}_{next(_names)}")
