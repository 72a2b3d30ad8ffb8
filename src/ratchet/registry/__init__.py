"""The run registry: runs, checkpoints, sweeps and trials in a SQL database (SQLite by
default, PostgreSQL by URL), with Alembic migrations shipped in the package.

A leaf package: it imports SQLAlchemy and Alembic, and from ratchet only `storage` (for
`rebuild_from_store`). Activities write it, the CLI and the sweep code read it; it can be
rebuilt from the object store (`rebuild.py`). See docs/registry.md.

The names below are imported on first use (PEP 562), so `ratchet.registry.urls` (the
demo and the CLI read the default URL from it) loads neither SQLAlchemy nor Alembic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .db import SORT_KEYS, Registry
    from .rebuild import RebuildReport, rebuild_from_store
    from .records import (
        DIRECTIONS,
        END_STATUSES,
        RUN_STATUSES,
        SWEEP_STATUSES,
        TRIAL_STATES,
        CheckpointRecord,
        RunRecord,
        SweepRecord,
        TrialRecord,
    )
    from .urls import ENV, RegistryURLError, registry_enabled, registry_url, safe_url, sqlite_url

_EXPORTS = {
    "db": ("SORT_KEYS", "Registry"),
    "rebuild": ("RebuildReport", "rebuild_from_store"),
    "records": (
        "DIRECTIONS", "END_STATUSES", "RUN_STATUSES", "SWEEP_STATUSES", "TRIAL_STATES",
        "CheckpointRecord", "RunRecord", "SweepRecord", "TrialRecord",
    ),
    "urls": ("ENV", "RegistryURLError", "registry_enabled", "registry_url", "safe_url", "sqlite_url"),
}  # fmt: skip
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
