"""The run registry: runs, checkpoints, sweeps and trials in a SQL database (SQLite by
default, PostgreSQL by URL), with Alembic migrations shipped in the package.

A leaf package: it imports SQLAlchemy and Alembic, and from ratchet only `storage` (for
`rebuild_from_store`). Activities write it, the CLI and the sweep code read it; it can be
rebuilt from the object store (`rebuild.py`). See docs/registry.md.

Its `__init__` imports nothing: `ratchet.registry.urls` (the demo and the CLI read the
default URL from it) loads neither SQLAlchemy nor Alembic. Import each name from its module:
`db` (Registry), `records`, `rebuild`, `urls`.
"""
