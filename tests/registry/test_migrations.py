"""`alembic upgrade head` from an empty database, on SQLite and PostgreSQL: through
Alembic's command API, through the `alembic` CLI with the repository's alembic.ini, and
programmatically by `Registry.open`; the migrated schema matches the ORM models."""

from __future__ import annotations

import pytest
import argparse
import os
import subprocess
import sys
from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import MetaData, create_engine, inspect

from ratchet.registry.db import Registry
from ratchet.registry.migrate import ALEMBIC_LOCK, current, head
from ratchet.registry.tables import Base

from .conftest import PG_PASSWORD

REPO = Path(__file__).resolve().parents[2]
TABLES = {"runs", "checkpoints", "sweeps", "trials", "alembic_version"}


def _schema_matches_models(url: str) -> None:
    engine = create_engine(url)
    try:
        assert set(inspect(engine).get_table_names()) == TABLES
        with engine.connect() as conn:
            diffs = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diffs == [], diffs  # a model change without a revision shows here
        assert current(engine) == head()
    finally:
        engine.dispose()


def test_upgrade_head_through_the_command_api(db_url):
    cfg = Config(str(REPO / "alembic.ini"))
    cfg.cmd_opts = argparse.Namespace(x=[f"url={db_url}"])
    # Alembic's context is process-wide: the lock keeps other in-process users (an MLflow
    # tracker opening its store that holds it too) out while this test runs it.
    with ALEMBIC_LOCK:
        command.upgrade(cfg, "head")
        _schema_matches_models(db_url)
        command.downgrade(cfg, "base")  # the first revision undoes itself
    engine = create_engine(db_url)
    assert set(inspect(engine).get_table_names()) == {"alembic_version"}
    engine.dispose()


@pytest.mark.slow
def test_upgrade_head_through_the_alembic_cli(db_url):
    alembic = Path(sys.executable).with_name("alembic")
    env = {k: v for k, v in os.environ.items() if k != "RATCHET_REGISTRY_URL"}
    done = subprocess.run([str(alembic), "-x", f"url={db_url}", "upgrade", "head"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Running upgrade  -> 0001_initial" in done.stderr
    assert PG_PASSWORD not in done.stdout + done.stderr  # its log line shows the URL masked
    _schema_matches_models(db_url)
    # RATCHET_REGISTRY_URL works as -x url does; a second upgrade has nothing to do.
    again = subprocess.run([str(alembic), "upgrade", "head"], cwd=REPO, env={**env, "RATCHET_REGISTRY_URL": db_url},
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert again.returncode == 0 and "Running upgrade" not in again.stderr, again.stderr


def test_registry_open_migrates_an_empty_database(db_url):
    reg = Registry.open(db_url)
    try:
        _schema_matches_models(db_url)
        assert reg.upgrade() is False  # once per process and URL
    finally:
        reg.close()


def test_registry_open_leaves_another_alembic_run_in_this_process_alone(db_url, tmp_path):
    """Alembic's `context` is process-wide: the worker's MLflow tracker migrates its own
    store on a background thread while an activity opens the registry. Opening (and
    creating) the registry must not enter or tear down another Alembic environment."""
    from alembic import context
    from alembic.runtime.environment import EnvironmentContext
    from alembic.script import ScriptDirectory

    other = Config()
    other.set_main_option("script_location", str(tmp_path))  # stands for MLflow's migrations
    with EnvironmentContext(other, ScriptDirectory.from_config(Config(str(REPO / "alembic.ini")))):
        reg = Registry.open(db_url)
        assert context.config is other  # still the other run's environment
    _schema_matches_models(db_url)
    reg.close()


def test_an_older_database_is_migrated_in_a_child_process(db_url):
    """A database behind head (here: tables of an interrupted first migration, no
    revision stamped) goes through the revisions in a child process, whose errors come
    back with the password masked."""
    from sqlalchemy import text

    from ratchet.registry import migrate

    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE runs (run_id VARCHAR(200) PRIMARY KEY)"))
    try:
        migrate.upgrade(engine)
    except RuntimeError as exc:  # the revision's CREATE TABLE runs meets the leftover table
        assert "migrating the run registry" in str(exc) and "runs" in str(exc)
        assert PG_PASSWORD not in str(exc)
    else:
        raise AssertionError("a leftover table must stop the migration")
    with engine.begin() as conn:  # the leftovers cleared (SQLite keeps what the failed run made)
        leftovers = MetaData()
        leftovers.reflect(conn)
        leftovers.drop_all(conn)
    migrate._upgrade_in_child(engine.url)  # a real `alembic upgrade head`, in a child
    _schema_matches_models(db_url)
    engine.dispose()
