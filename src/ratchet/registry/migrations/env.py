"""Alembic's entry point for the run registry's migrations.

The database comes from, in order: a connection handed over by `ratchet.registry.migrate`
(`config.attributes["connection"]`), `alembic -x url=...`, RATCHET_REGISTRY_URL, then the
default SQLite file in the state folder. The URL is logged only with its password masked.
"""

from __future__ import annotations

import logging
from logging.config import fileConfig
from pathlib import Path

from alembic import context
from sqlalchemy import create_engine, pool

from ratchet.registry.tables import Base
from ratchet.registry.urls import parse, registry_url, safe_url

config = context.config
target_metadata = Base.metadata
# Under "alembic" so the CLI's alembic.ini shows it at INFO, as it shows alembic's own lines.
log = logging.getLogger("alembic.ratchet")
if config.config_file_name and "connection" not in config.attributes:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    x_url = context.get_x_argument(as_dictionary=True).get("url")
    return parse(registry_url(x_url or None)).render_as_string(hide_password=False)


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    conn = config.attributes.get("connection")
    if conn is not None:
        context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = _url()
    parsed = parse(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    log.info("migrating run registry %s", safe_url(url))
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
