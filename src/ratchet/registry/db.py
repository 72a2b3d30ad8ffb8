"""`Registry`: the run registry's reads and writes, every write an idempotent upsert.

Each write is keyed by the ids of its row (run id; run id and checkpoint name; sweep id;
sweep id and trial index), so a retried activity writes the same row again instead of a
second one. Writes that describe progress (`record_progress`, `record_checkpoint`) create
a minimal run row when the run is missing (its `prepare_run` write failed, or the registry
was created after the run began) rather than failing.

The upserts use `INSERT ... ON CONFLICT DO UPDATE`, which SQLite and PostgreSQL both speak.

Why one class of ~26 methods: one read or one upsert per question a caller asks of the
four tables (runs, checkpoints, sweeps, trials), each a few lines over the same session
and dialect handling; grouping them by table would split that handling, not shrink it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

from sqlalchemy import Engine, create_engine, event, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from ratchet.private_paths import create_private_file, make_private_dirs

from . import migrate
from .records import (
    DIRECTIONS,
    RUN_STATUSES,
    SWEEP_STATUSES,
    TRIAL_STATES,
    CheckpointRecord,
    RunRecord,
    SweepRecord,
    TrialRecord,
)
from .tables import Checkpoint, Run, Sweep, Trial
from .urls import parse, registry_url, safe_url

log = logging.getLogger(__name__)

# `runs(sort=...)`: the accepted keys and the column each sorts by.
SORT_KEYS = {
    "created": Run.created_at,
    "updated": Run.updated_at,
    "step": Run.last_step,
    "reward": Run.last_reward,
    "eval_reward": Run.eval_reward,
    "run_id": Run.run_id,
    "experiment": Run.experiment,
    "status": Run.status,
}

_migrated: set[str] = set()  # URLs this process has brought to head already
_migrate_lock = threading.Lock()


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _utc(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes (stored as UTC): make them aware."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=timezone.utc)


def _check(value: str, allowed: Iterable[str], what: str) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)}; got {value!r}")


def _record(cls: type, row: Any) -> Any:
    values = {f.name: getattr(row, f.name) for f in fields(cls)}
    for key in ("created_at", "updated_at"):
        if key in values:
            values[key] = _utc(values[key])
    return cls(**values)


class Registry:
    """The run registry behind one database URL. Thread-safe (SQLAlchemy's pool)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    # -- opening --------------------------------------------------------------------------

    @classmethod
    def open(cls, url: str | None = None, *, upgrade: bool = True) -> Registry:
        """The registry at `url` (None: RATCHET_REGISTRY_URL, else SQLite in the state
        folder), migrated to the newest revision unless `upgrade` is False."""
        parsed = parse(registry_url(url))
        kwargs: dict[str, Any] = {"pool_pre_ping": True}
        if parsed.get_backend_name() == "sqlite":
            if parsed.database and parsed.database != ":memory:":
                # Private: run configs, metrics and checkpoint URIs. SQLite gives its WAL
                # and shared-memory files the database file's mode.
                db_file = Path(parsed.database).expanduser()
                make_private_dirs(db_file.parent)
                create_private_file(db_file)
            # Worker and CLI share the file: wait for a lock instead of failing at once.
            kwargs["connect_args"] = {"timeout": 30}
        else:
            # A database that is down fails a write in seconds (activities log and go on).
            kwargs["connect_args"] = {"connect_timeout": 5}
        engine = create_engine(parsed, **kwargs)
        if parsed.get_backend_name() == "sqlite":
            event.listen(engine, "connect", _sqlite_pragmas)
        registry = cls(engine)
        if upgrade:
            registry.upgrade()
        return registry

    def upgrade(self) -> bool:
        """Migrate to the newest revision (once per process and URL); True if applied."""
        key = self.engine.url.render_as_string(hide_password=False)
        with _migrate_lock:
            if key in _migrated:
                return False
            applied = migrate.upgrade(self.engine)
            _migrated.add(key)
            return applied

    @property
    def url(self) -> str:
        """The database URL, password masked: safe to log or print."""
        return safe_url(self.engine.url)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Registry({self.url!r})"

    # -- upsert plumbing ------------------------------------------------------------------

    def _insert(self, table: Any) -> Any:
        dialect = self.engine.dialect.name
        if dialect == "postgresql":
            return postgresql.insert(table)
        if dialect == "sqlite":
            return sqlite.insert(table)
        raise NotImplementedError(f"the registry supports sqlite and postgresql, not {dialect}")

    def _upsert(self, model: Any, values: dict[str, Any], keys: Sequence[str], update: dict[str, Any]) -> None:
        stmt = self._insert(model.__table__).values(**values)
        set_ = {name: (expr(stmt.excluded) if callable(expr) else expr) for name, expr in update.items()}
        stmt = stmt.on_conflict_do_update(index_elements=list(keys), set_=set_)
        with self.engine.begin() as conn:
            conn.execute(stmt)

    def _update_run(self, run_id: str, update: dict[str, Any]) -> None:
        """Set `update` on the run's row, one statement: a run the registry has not seen
        gets a minimal row with these values (its description fills in later)."""
        now = _now()
        values = {"run_id": run_id, "created_at": now, "updated_at": now, "config": {}, "status": "running", **update}
        self._upsert(Run, values, ["run_id"], {**update, "updated_at": now})

    def _ensure_run(self, run_id: str, now: datetime) -> None:
        """A minimal row for a run the registry has not seen (its fields fill in later)."""
        stmt = self._insert(Run.__table__).values(run_id=run_id, created_at=now, updated_at=now, config={}, status="running")
        with self.engine.begin() as conn:
            conn.execute(stmt.on_conflict_do_nothing(index_elements=["run_id"]))

    # -- runs -----------------------------------------------------------------------------

    def record_run(self, record: RunRecord) -> None:
        """Insert or update a run's description (a resume sets it running again). Its
        progress, final metrics and creation time are kept."""
        _check(record.status, RUN_STATUSES, "run status")
        now = _now()
        described = {
            "name": record.name,
            "experiment": record.experiment,
            "algorithm": record.algorithm,
            "loop_mode": record.loop_mode,
            "model": record.model,
            "config_digest": record.config_digest,
            "config": dict(record.config),
            "status": record.status,
        }
        # Lineage is fixed at submit: a later write without it (a resume) keeps it.
        lineage = {
            "parent_run_id": record.parent_run_id,
            "parent_checkpoint": record.parent_checkpoint,
            "sweep_id": record.sweep_id,
            "trial_index": record.trial_index,
        }
        values = {
            "run_id": record.run_id,
            **described,
            **lineage,
            # A rebuild gives the run folder's time; an existing row keeps its own.
            "created_at": record.created_at or now,
            "updated_at": now,
            "last_step": record.last_step,
            "last_reward": record.last_reward,
            "eval_reward": record.eval_reward,
            "final_metrics": record.final_metrics,
        }
        update: dict[str, Any] = {k: (lambda ex, k=k: getattr(ex, k)) for k in described}
        r = Run.__table__.c
        update.update({k: (lambda ex, k=k: func.coalesce(getattr(ex, k), r[k])) for k in lineage})
        update["updated_at"] = now
        self._upsert(Run, values, ["run_id"], update)

    def record_progress(self, run_id: str, step: int, reward: float | None, eval_reward: float | None = None) -> None:
        """The run's latest step and reward (and eval reward, when this step evaluated)."""
        update: dict[str, Any] = {"last_step": int(step)}
        if reward is not None:
            update["last_reward"] = float(reward)
        if eval_reward is not None:
            update["eval_reward"] = float(eval_reward)
        self._update_run(run_id, update)

    def finish_run(self, run_id: str, status: str, final_metrics: dict[str, float] | None = None) -> None:
        """Mark the run ended (`completed`, `failed`, `cancelled` or `stopped`); final
        metrics replace earlier ones when given."""
        _check(status, RUN_STATUSES, "run status")
        update: dict[str, Any] = {"status": status}
        if final_metrics is not None:
            update["final_metrics"] = {str(k): float(v) for k, v in final_metrics.items()}
        self._update_run(run_id, update)

    def run(self, run_id: str) -> RunRecord | None:
        with Session(self.engine) as s:
            row = s.get(Run, run_id)
            return None if row is None else _record(RunRecord, row)

    def runs(
        self,
        *,
        experiment: str | None = None,
        status: str | None = None,
        sweep_id: str | None = None,
        parent_run_id: str | None = None,
        run_ids: Iterable[str] | None = None,
        sort: str = "created",
        descending: bool = True,
        limit: int | None = None,
    ) -> list[RunRecord]:
        """Runs matching every filter given, sorted by `sort` (a key of SORT_KEYS; runs
        without a value sort last). `run_ids` restricts to those runs (e.g. the ones a
        Temporal visibility query found)."""
        if sort not in SORT_KEYS:
            raise ValueError(f"sort must be one of {', '.join(SORT_KEYS)}; got {sort!r}")
        if status is not None:
            _check(status, RUN_STATUSES, "status")
        q = select(Run)
        if experiment is not None:
            q = q.where(Run.experiment == experiment)
        if status is not None:
            q = q.where(Run.status == status)
        if sweep_id is not None:
            q = q.where(Run.sweep_id == sweep_id)
        if parent_run_id is not None:
            q = q.where(Run.parent_run_id == parent_run_id)
        if run_ids is not None:
            q = q.where(Run.run_id.in_(list(run_ids)))
        col = SORT_KEYS[sort]
        q = q.order_by(col.is_(None), col.desc() if descending else col.asc(), Run.run_id)
        if limit is not None:
            q = q.limit(limit)
        with Session(self.engine) as s:
            return [_record(RunRecord, row) for row in s.scalars(q)]

    # -- checkpoints ----------------------------------------------------------------------

    def record_checkpoint(self, run_id: str, step: int, name: str, uri: str, created_at: datetime | None = None) -> None:
        """A committed checkpoint, keyed by (run_id, name); `created_at`: its manifest's
        time (default: now; an existing row keeps its own)."""
        now = _now()
        self._ensure_run(run_id, now)
        values = {"run_id": run_id, "name": name, "step": int(step), "uri": uri, "created_at": created_at or now}
        self._upsert(Checkpoint, values, ["run_id", "name"], {"step": int(step), "uri": uri})

    def sync_checkpoints(self, run_id: str, committed: Sequence[CheckpointRecord]) -> None:
        """Make the run's checkpoint rows exactly `committed` (what its checkpoint store
        lists now): new ones recorded, deleted or retired ones forgotten."""
        for c in committed:
            self.record_checkpoint(run_id, c.step, c.name, c.uri, c.created_at)
        names = [c.name for c in committed]
        with self.engine.begin() as conn:
            conn.execute(Checkpoint.__table__.delete().where(Checkpoint.run_id == run_id, Checkpoint.name.not_in(names)))

    def checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        q = select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step, Checkpoint.name)
        with Session(self.engine) as s:
            return [_record(CheckpointRecord, row) for row in s.scalars(q)]

    # -- sweeps and trials ----------------------------------------------------------------

    def record_sweep(self, record: SweepRecord) -> None:
        """Insert or update a sweep; a spec or best trial already known is kept when the
        record has none."""
        _check(record.status, SWEEP_STATUSES, "sweep status")
        _check(record.direction, DIRECTIONS, "sweep direction")
        now = _now()
        described = {
            "name": record.name,
            "spec": dict(record.spec),
            "status": record.status,
            "objective": record.objective,
            "direction": record.direction,
        }
        values = {
            "sweep_id": record.sweep_id,
            **described,
            "best_trial_index": record.best_trial_index,
            "created_at": now,
            "updated_at": now,
        }
        update: dict[str, Any] = {k: (lambda ex, k=k: getattr(ex, k)) for k in described}
        if not record.spec:
            del update["spec"]  # a status-only write keeps the spec
        update["best_trial_index"] = lambda ex: func.coalesce(ex.best_trial_index, Sweep.__table__.c.best_trial_index)
        update["updated_at"] = now
        self._upsert(Sweep, values, ["sweep_id"], update)

    def set_sweep_status(self, sweep_id: str, status: str, best_trial_index: int | None = None) -> None:
        _check(status, SWEEP_STATUSES, "sweep status")
        update: dict[str, Any] = {"status": status, "updated_at": _now()}
        if best_trial_index is not None:
            update["best_trial_index"] = int(best_trial_index)
        with self.engine.begin() as conn:
            result = conn.execute(Sweep.__table__.update().where(Sweep.sweep_id == sweep_id).values(**update))
        if result.rowcount == 0:
            raise KeyError(f"no sweep {sweep_id!r} in the registry; record_sweep it first")

    def record_trial(self, record: TrialRecord) -> None:
        """Insert or update a trial, keyed by (sweep_id, trial_index). Params, a run id,
        objective value or reported step already known are kept when the record has none."""
        _check(record.state, TRIAL_STATES, "trial state")
        now = _now()
        t = Trial.__table__.c
        values = {
            "sweep_id": record.sweep_id,
            "trial_index": int(record.trial_index),
            "run_id": record.run_id,
            "params": dict(record.params),
            "state": record.state,
            "objective_value": record.objective_value,
            "last_reported_step": record.last_reported_step,
            "created_at": now,
            "updated_at": now,
        }
        update: dict[str, Any] = {
            "state": lambda ex: ex.state,
            "run_id": lambda ex: func.coalesce(ex.run_id, t.run_id),
            "objective_value": lambda ex: func.coalesce(ex.objective_value, t.objective_value),
            "last_reported_step": lambda ex: func.coalesce(ex.last_reported_step, t.last_reported_step),
            "updated_at": now,
        }
        if record.params:  # a state-only write keeps the params
            update["params"] = lambda ex: ex.params
        self._upsert(Trial, values, ["sweep_id", "trial_index"], update)

    def sweep(self, sweep_id: str) -> SweepRecord | None:
        with Session(self.engine) as s:
            row = s.get(Sweep, sweep_id)
            return None if row is None else _record(SweepRecord, row)

    def sweeps(self, *, status: str | None = None, limit: int | None = None) -> list[SweepRecord]:
        q = select(Sweep)
        if status is not None:
            q = q.where(Sweep.status == status)
        q = q.order_by(Sweep.created_at.desc(), Sweep.sweep_id)
        if limit is not None:
            q = q.limit(limit)
        with Session(self.engine) as s:
            return [_record(SweepRecord, row) for row in s.scalars(q)]

    def trials(self, sweep_id: str) -> list[TrialRecord]:
        q = select(Trial).where(Trial.sweep_id == sweep_id).order_by(Trial.trial_index)
        with Session(self.engine) as s:
            return [_record(TrialRecord, row) for row in s.scalars(q)]


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL: the CLI reads while the worker writes; a busy timeout instead of "database is locked".
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


__all__ = ["SORT_KEYS", "Registry"]
