"""Alembic migrations of the registry, run from Python: `upgrade(engine)` brings a database
(empty or older) to the newest revision.

The revisions live in this package (`migrations/`), so an installed ratchet migrates its
own database without the repository's `alembic.ini`; that file points the `alembic` CLI
at the same folder for people who prefer the shell.

Alembic's `context` and `op` are process-wide proxies: two migrations running at once in
one process (the worker's MLflow tracker migrates its own SQLite store on a background
thread) would send each other's operations to the wrong database. So `upgrade` never runs
Alembic's environment in-process by default:

- an empty database gets the models' tables and is stamped at head in one transaction
  (Alembic's "build from scratch" recipe; `tests/registry/test_migrations.py` checks that
  the revisions build exactly these tables);
- an older database is migrated by `alembic upgrade head` in a child process
  (`python -m ratchet.registry.migrate`, the URL passed in its environment, not argv).

`ratchet registry upgrade` and the `alembic` CLI run the revisions themselves.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect
from sqlalchemy.engine import URL, Engine

from .tables import Base
from .urls import ENV, safe_url

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).with_name("migrations")
# Held around every in-process Alembic run of this package; other code in the process that
# runs Alembic (e.g. opening an MLflow SQL store) can hold it too to stay clear of ours.
ALEMBIC_LOCK = threading.RLock()


def alembic_config() -> Config:
    """An Alembic config for the packaged migrations (no ini file needed)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def head() -> str:
    """The newest revision shipped."""
    rev = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert rev is not None
    return rev


def current(engine: Engine) -> str | None:
    """The database's revision (None: never migrated)."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, *, isolated: bool = True) -> bool:
    """Bring the database to the newest revision; True when anything was applied.
    `isolated=False` runs Alembic's migrations in this process (under ALEMBIC_LOCK)."""
    target = head()
    if current(engine) == target:
        return False
    ours = {t.name for t in Base.metadata.sorted_tables}
    if not ours & set(inspect(engine).get_table_names()):
        try:
            _create_at_head(engine)
        except Exception:
            if current(engine) != target:  # not another process that got there first
                raise
    elif isolated and not _in_memory(engine.url):
        _upgrade_in_child(engine.url)
    else:
        _upgrade_here(engine)
    log.info("run registry %s at revision %s", safe_url(engine.url), target)
    return True


def _in_memory(url: URL) -> bool:
    return url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")


def _create_at_head(engine: Engine) -> None:
    script = ScriptDirectory.from_config(alembic_config())
    with engine.begin() as conn:
        Base.metadata.create_all(conn)
        MigrationContext.configure(conn).stamp(script, "head")


def _upgrade_here(engine: Engine, revision: str = "head") -> None:
    cfg = alembic_config()
    with ALEMBIC_LOCK, engine.begin() as conn:
        cfg.attributes["connection"] = conn  # env.py migrates over this connection
        command.upgrade(cfg, revision)


def _upgrade_in_child(url: URL) -> None:
    env = {**os.environ, ENV: url.render_as_string(hide_password=False)}
    done = subprocess.run([sys.executable, "-m", __name__], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        tail = done.stderr[-2000:]
        if url.password:
            tail = tail.replace(str(url.password), "***")
        raise RuntimeError(f"migrating the run registry {safe_url(url)} failed:\n{tail}")


if __name__ == "__main__":
    # The child of `_upgrade_in_child`: the URL is in RATCHET_REGISTRY_URL (env.py reads it).
    logging.basicConfig(level=logging.INFO)
    command.upgrade(alembic_config(), "head")


__all__ = ["ALEMBIC_LOCK", "MIGRATIONS", "alembic_config", "current", "head", "upgrade"]
