"""MLflow as a tracker: one MLflow run per ratchet run, in the experiment
`tracking.experiment`, continued by id after a resume or a recovery.

The default store is the state folder's SQLite file (uris.py), copied on first use from a
schema template built once per MLflow version (`create_sqlite_store`); `RunTracking` keeps
one client per process (importing MLflow takes seconds). Points carry the metrics line's
own wall-clock stamp, so MLflow's wall-time axis is the run's, not the time the point
reached MLflow.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import Any, Mapping, MutableMapping

from typing import TYPE_CHECKING

from ratchet.config.resume_keys import flatten
from ratchet.private_paths import make_private_dirs

from .base import RunInfo
from .uris import MLFLOW_ARTIFACTS, mlflow_artifacts_dir, mlflow_uri, redact

if TYPE_CHECKING:
    from ratchet.config.schema import TrackingConfig

log = logging.getLogger(__name__)

# MLflow's limits: 100 params / 1000 metrics per batch, 6000 characters per param value.
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
_PARAM_CHARS = 6000
# A key every step line has: its history tells how far a continued run got.
STEP_KEY = "reward_mean"


def quiet_mlflow_env(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """MLflow's telemetry off (no connection leaves the machine for a local store) and a
    remote server given up on after seconds, not minutes of retries: a tracker that is
    down must not hold the tracking thread. A user's own values win."""
    env = os.environ if env is None else env
    for key, value in (
        ("MLFLOW_DISABLE_TELEMETRY", "true"),
        ("DO_NOT_TRACK", "true"),
        ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2"),
        ("MLFLOW_HTTP_REQUEST_TIMEOUT", "10"),
    ):
        env.setdefault(key, value)
    return env


def create_sqlite_store(path: Path) -> None:
    """Create MLflow's SQLite store at `path` unless it exists, atomically: it is made in a
    file of its own and linked into place only when complete. A process killed half-way
    (a worker, a test's interpreter exiting under the tracking thread) leaves a stray
    temporary file, never a store that is half a schema, which MLflow would refuse for good.

    The schema (about a hundred migrations: a second of CPU, several on a busy machine, on
    every new state folder's first run) is built once per MLflow version into the user's
    cache (`schema_template`) and copied from there; only the Default experiment's
    artifact location (the one path MLflow writes into a new store) and times are set."""
    if path.exists():
        return
    make_private_dirs(path.parent)
    artifacts = make_private_dirs(path.parent / MLFLOW_ARTIFACTS)  # MLflow writes what runs log here
    template = schema_template()
    if template is None:
        _build_store(path, artifacts)
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        shutil.copyfile(template, tmp)
        with closing(sqlite3.connect(tmp)) as db, db:
            db.execute(
                "UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? WHERE experiment_id = 0",
                (f"{artifacts.as_uri()}/0", *[int(time.time() * 1000)] * 2),
            )
        _link_into_place(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def schema_template() -> Path | None:
    """An empty MLflow store of this MLflow version in the user's cache
    (`$XDG_CACHE_HOME/ratchet`, else ~/.cache/ratchet), built on first use; None where
    that folder cannot be written (each store is then built where it goes)."""
    import mlflow

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ratchet"
    template = cache / f"mlflow-{mlflow.__version__}-schema.db"
    if template.exists():
        return template
    try:
        make_private_dirs(cache)
        _build_store(template, cache / "mlflow-template-artifacts")
    except OSError:
        return None
    return template


def _build_store(path: Path, artifacts: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.unlink(missing_ok=True)
    try:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        store = SqlAlchemyStore(f"sqlite:///{tmp}", artifacts.as_uri())
        store.engine.dispose()
        _link_into_place(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _link_into_place(tmp: Path, path: Path) -> None:
    os.chmod(tmp, 0o600)  # the store holds every run's params and metrics: its user's alone
    try:
        os.link(tmp, path)  # fails if another process got there first: theirs stays
    except FileExistsError:
        pass


def from_config(tracking: "TrackingConfig") -> "MlflowTracker":
    """The catalog's builder (ratchet/catalog/trackers.py): `tracking.mlflow_uri`, else the default store."""
    from ratchet.extras import require

    require("mlflow", "tracking.mlflow (on by default)")
    return MlflowTracker(tracking.mlflow_uri)


class MlflowTracker:
    name = "mlflow"
    saves_last_step = False

    def __init__(self, uri: str | None = None):
        quiet_mlflow_env()
        from mlflow import MlflowClient  # imported here: seconds, and only when MLflow is on

        self.uri = mlflow_uri(uri)
        if self.uri.startswith("sqlite:///"):
            create_sqlite_store(Path(self.uri[len("sqlite:///") :]))
        self.client = MlflowClient(tracking_uri=self.uri)
        self.run_id: str | None = None

    def __repr__(self) -> str:
        return f"MlflowTracker({redact(self.uri)!r}, run {self.run_id})"

    # -- the run ----------------------------------------------------------------------

    def _experiment_id(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            if found.lifecycle_stage == "deleted":
                self.client.restore_experiment(found.experiment_id)
            return found.experiment_id
        # The local SQLite store keeps artifacts next to it (MLflow's default is ./mlruns).
        location = mlflow_artifacts_dir().as_uri() if self.uri.startswith("sqlite:") else None
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except Exception:  # noqa: BLE001 - another process created it first
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def start_or_continue(self, run: RunInfo, saved: Mapping[str, Any]) -> dict[str, Any]:
        run_id = saved.get("run_id")
        if run_id:
            existing = self._existing(run_id)
            if existing is not None:
                self.run_id = run_id
                if existing.info.status != "RUNNING":
                    self.client.update_run(run_id, status="RUNNING")
                return dict(saved)
            log.warning("MLflow run %s of %s is not in %s; starting a new one", run_id, run.run_id, redact(self.uri))
        # A run written by this ratchet run before tracking.json was (a process died in
        # between) is found by its tag, so a retry does not make a second one.
        experiment_id = self._experiment_id(run.experiment)
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`ratchet.run_id` = '{run.run_id}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
        else:
            tags = {**run.labels(), "mlflow.runName": run.run_id}
            if run.lineage.sweep_id:
                tags["mlflow.note.content"] = f"trial {run.lineage.trial_index} of sweep {run.lineage.sweep_id}"
            self.run_id = self.client.create_run(experiment_id, tags=tags, run_name=run.run_id).info.run_id
        return {"run_id": self.run_id, "experiment_id": experiment_id, "uri": redact(self.uri)}

    def _existing(self, run_id: str):
        from mlflow.exceptions import MlflowException

        try:
            found = self.client.get_run(run_id)
        except MlflowException:
            return None
        return None if found.info.lifecycle_stage == "deleted" else found

    def last_step(self) -> int | None:
        history = self.client.get_metric_history(self._run(), STEP_KEY)
        return max((m.step for m in history), default=None)

    def _run(self) -> str:
        if self.run_id is None:
            raise RuntimeError("MlflowTracker: start_or_continue first")
        return self.run_id

    # -- logging ----------------------------------------------------------------------

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Params once; a value that differs from the run's (a resume that changed it) is
        kept as the tag `param_changed.<key>`, since MLflow params cannot change."""
        from mlflow.entities import Param, RunTag

        run_id = self._run()
        have = self.client.get_run(run_id).data.params
        params, tags = [], []
        for key, value in flatten(config).items():
            text = str(value)[:_PARAM_CHARS]
            if key not in have:
                params.append(Param(key, text))
            elif have[key] != text:
                tags.append(RunTag(f"param_changed.{key}", text))
        for i in range(0, max(len(params), 1), _PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=params[i : i + _PARAMS_PER_BATCH], tags=tags if i == 0 else [])

    def log_step(self, step: int, metrics: Mapping[str, float], time_unix: float | None = None) -> None:
        from mlflow.entities import Metric

        stamp = int((time_unix if time_unix is not None else time.time()) * 1000)
        points = [Metric(key, value, stamp, step) for key, value in metrics.items()]
        for i in range(0, len(points), _METRICS_PER_BATCH):
            self.client.log_batch(self._run(), metrics=points[i : i + _METRICS_PER_BATCH])

    def log_summary(self, summary: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        self.client.log_batch(self._run(), metrics=[Metric(f"summary/{k}", v, stamp, 0) for k, v in summary.items()])
        self.client.set_terminated(self._run(), "FINISHED")

    def close(self, failed: bool = False) -> None:
        if failed and self.run_id is not None:
            self.client.set_terminated(self.run_id, "FAILED")
        self.run_id = None
