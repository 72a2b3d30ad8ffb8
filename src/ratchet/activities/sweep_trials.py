"""Activities of the sweep workflow: ask Optuna for trial k's values, read running trials'
metrics at the early-stopping rungs, and record sweeps and trials in the run registry.

Not to be confused with `activities/sweep.py` (which releases the actors of closed runs).

Everything here may run twice (a retried activity, a worker killed after the write but
before the reply), so every write is keyed: Optuna's trial for index k is found by its
`trial_index` user attribute before a new one is asked for (a retried or replayed ask for
trial k returns the same values), and registry rows are upserted by (sweep_id,
trial_index). Grid and random values are functions of the spec and seed
(config/sweep_search.py) and are handed to Optuna as fixed parameters, so every search
kind takes the same path and every trial is in the study.

Optuna's tables live next to the registry's, not among them: both have a `trials` table
and Optuna's schema has its own version bookkeeping, so SQLite gets a sibling file
(`registry-optuna.db`) and PostgreSQL a schema `optuna` in the same database.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError

from ratchet.config.loader import ConfigError
from ratchet.config.sweep_spec import ParamSpace, SweepSpec, trial_config, trial_params
from ratchet.ids import check_id
from ratchet.storage.metrics_log import MetricsLog
from ratchet.storage.object_store import ObjectStore
from ratchet.sweep_types import (
    FinishTrialInput,
    PlanTrialInput,
    RungInput,
    RungReport,
    SweepBeginInput,
    SweepEndInput,
    TrialPlan,
    TrialResult,
    trial_run_id,
)

log = logging.getLogger(__name__)

TRIAL_INDEX_ATTR = "trial_index"
_ask_lock = threading.Lock()  # one ask at a time per process: a retried ask finds the first


# -- the stores ------------------------------------------------------------------------------


@lru_cache(maxsize=4)
def _registry(url: str):
    from ratchet.registry.db import Registry

    return Registry.open(url)


def registry():
    """The run registry this worker writes (RATCHET_REGISTRY_URL, else the state folder's SQLite)."""
    from ratchet.registry.urls import registry_url

    return _registry(registry_url())


def optuna_url(registry_url: str) -> str:
    """Where Optuna keeps its studies, beside the registry's tables (see the module doc)."""
    from ratchet.registry.urls import parse

    parsed = parse(registry_url)
    if parsed.get_backend_name() == "sqlite":
        db = parsed.database or ""
        if not db or db == ":memory:":
            raise ApplicationError(
                "an in-memory registry cannot hold Optuna's studies; set RATCHET_REGISTRY_URL to a file",
                type="SweepStorage",
                non_retryable=True,
            )
        path = Path(db)
        return parsed.set(database=str(path.with_name(f"{path.stem}-optuna{path.suffix or '.db'}"))).render_as_string(hide_password=False)
    _ensure_schema(parsed.render_as_string(hide_password=False))
    query = dict(parsed.query)
    query["options"] = "-csearch_path=optuna"
    return parsed.set(query=query).render_as_string(hide_password=False)


@lru_cache(maxsize=4)
def _ensure_schema(url: str) -> None:
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE SCHEMA IF NOT EXISTS optuna"))
    finally:
        engine.dispose()


@lru_cache(maxsize=4)
def _storage(url: str):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"timeout": 30}  # the worker's activities share the file
    return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)


def optuna_storage():
    from ratchet.registry.urls import registry_url

    return _storage(optuna_url(registry_url()))


def _study(spec: SweepSpec, sweep_id: str, sampler=None):
    import optuna

    return optuna.create_study(
        storage=optuna_storage(),
        study_name=sweep_id,
        direction="maximize" if spec.objective.direction == "max" else "minimize",
        sampler=sampler,
        load_if_exists=True,
    )


def distributions(space: dict[str, ParamSpace]) -> dict[str, Any]:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, Any] = {}
    for key, p in space.items():
        if p.is_choice:
            out[key] = CategoricalDistribution(p.values)
        elif p.type == "int":
            out[key] = IntDistribution(int(p.bounds[0]), int(p.bounds[1]), log=p.log)
        else:
            out[key] = FloatDistribution(float(p.bounds[0]), float(p.bounds[1]), log=p.log)
    return out


@lru_cache(maxsize=1)
def _quiet_experimental() -> None:
    """PartialFixedSampler is "experimental" since Optuna 2.4 and unchanged since; the
    filter is set once (catch_warnings is not thread-safe, and activities run in threads)."""
    import optuna

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning, module=__name__)


def _find(study, index: int):
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get(TRIAL_INDEX_ATTR) == index:
            return t
    return None


def ask(spec: SweepSpec, sweep_id: str, index: int) -> dict[str, Any]:
    """Trial `index`'s values, asked of Optuna once: the same values on every later call."""
    import optuna

    fixed = trial_params(spec, index)
    # Seeded per trial: a sampler object lives for one ask, and one seeded alike for every
    # trial would repeat its first draw.
    seed = (spec.seed * 1_000_003 + index) % 2**32
    if fixed is not None:
        _quiet_experimental()
        sampler = optuna.samplers.PartialFixedSampler(fixed, optuna.samplers.RandomSampler(seed=seed))
    else:
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, min(10, spec.num_trials // 3)))
    with _ask_lock:
        study = _study(spec, sweep_id, sampler)
        found = _find(study, index)
        if found is not None:
            return {k: found.params[k] for k in spec.space}
        trial = study.ask(distributions(spec.space))
        trial.set_user_attr(TRIAL_INDEX_ATTR, index)
        return {k: trial.params[k] for k in spec.space}


def _tell(spec: SweepSpec, sweep_id: str, index: int, state: str, value: float | None) -> None:
    """Close Optuna's trial k (once: a finished one is left as it is)."""
    from optuna.trial import TrialState

    with _ask_lock:
        study = _study(spec, sweep_id)
        found = _find(study, index)
        if found is None or found.state != TrialState.RUNNING:
            return
        if state == "completed" and value is not None and math.isfinite(value):
            study.tell(found.number, value)
        elif state == "pruned":
            study.tell(found.number, state=TrialState.PRUNED)
        else:
            study.tell(found.number, state=TrialState.FAIL)


# -- activities ------------------------------------------------------------------------------


def _spec(raw: dict) -> SweepSpec:
    return SweepSpec.model_validate(raw)


@activity.defn(name="sweep_begin")
def sweep_begin(inp: SweepBeginInput) -> None:
    """Record the sweep (running) and create its Optuna study."""
    from ratchet.registry.records import SweepRecord

    spec = _spec(inp.spec)
    registry().record_sweep(
        SweepRecord(
            sweep_id=check_id(inp.sweep_id, "sweep id"),
            name=spec.name,
            spec=inp.spec,
            status="running",
            objective=spec.objective.metric,
            direction="maximize" if spec.objective.direction == "max" else "minimize",
        )
    )
    _study(spec, inp.sweep_id)


@activity.defn(name="plan_trial")
def plan_trial(inp: PlanTrialInput) -> TrialPlan:
    """Trial k's values (Optuna), its validated config and loop plan; the trial recorded as running."""
    from ratchet.config.loop_plan import loop_plan
    from ratchet.registry.records import TrialRecord

    spec = _spec(inp.spec)
    run_id = check_id(trial_run_id(inp.sweep_id, inp.trial_index), "trial run id")
    params = ask(spec, inp.sweep_id, inp.trial_index)
    try:
        cfg = trial_config(inp.base_config, params)
    except ConfigError as exc:
        raise ApplicationError(f"trial {inp.trial_index} ({params}): {exc}", type="TrialConfigInvalid", non_retryable=True) from None
    registry().record_trial(TrialRecord(sweep_id=inp.sweep_id, trial_index=inp.trial_index, run_id=run_id, params=params, state="running"))
    log.info("sweep %s: trial %d is %s with %s", inp.sweep_id, inp.trial_index, run_id, params)
    return TrialPlan(
        trial_index=inp.trial_index,
        run_id=run_id,
        params=params,
        config=cfg.model_dump(mode="json"),
        plan=loop_plan(cfg),
        storage_root=cfg.storage.root,
    )


def _metrics(storage_root: str, run_id: str) -> list[dict]:
    return MetricsLog(ObjectStore(storage_root).child(check_id(run_id))).read()


def rung_value(lines: list[dict], rung: int, metric: str, window: int) -> float | None:
    """The mean of `metric` over steps rung-window .. rung-1 (0-based: the last `window` of
    the first `rung` steps); None when none of them has it."""
    vals = [float(x[metric]) for x in lines if rung - window <= x.get("step", -1) < rung and _finite(x.get(metric))]
    return sum(vals) / len(vals) if vals else None


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def read_rungs(inp: RungInput) -> list[RungReport]:
    """Each watched trial's steps so far and its metric at the rungs it newly reached."""
    out = []
    for w in inp.trials:
        lines = _metrics(w.storage_root, w.run_id)
        steps = len({x.get("step") for x in lines})
        values = [rung_value(lines, r, inp.metric, inp.window) for r in inp.rungs[w.rungs_seen :] if r <= steps]
        out.append(RungReport(trial_index=w.trial_index, steps=steps, values=values))
    return out


@activity.defn(name="trial_rungs")
def trial_rungs(inp: RungInput) -> list[RungReport]:
    """Wait until a watched trial reaches a new rung (or max_wait_seconds pass, or the
    sweep cancels this call because its running trials changed), then report them all."""
    waited = 0.0
    while True:
        reports = read_rungs(inp)
        if any(r.values for r in reports) or waited >= inp.max_wait_seconds:
            return reports
        activity.heartbeat()
        if activity.wait_for_cancelled_sync(inp.poll_seconds):
            raise asyncio.CancelledError()
        waited += inp.poll_seconds


def objective_value(spec: SweepSpec, inp: FinishTrialInput) -> float | None:
    """The trial's objective: eval_reward at its last step (the evaluation the run makes
    when it ends), or a metrics.jsonl key averaged over its last `last_k` steps."""
    metric, k = spec.objective.metric, spec.objective.last_k
    if metric == "eval_reward":
        if str(inp.steps) in inp.eval_rewards:
            return float(inp.eval_rewards[str(inp.steps)])
        return None
    lines = sorted(_metrics(inp.storage_root, inp.run_id), key=lambda x: x.get("step", 0))
    vals = [float(x[metric]) for x in lines[-k:] if _finite(x.get(metric))]
    return sum(vals) / len(vals) if vals else None


@activity.defn(name="finish_trial")
def finish_trial(inp: FinishTrialInput) -> TrialResult:
    """The trial's objective, told to Optuna and recorded in the registry (once: upserts)."""
    from ratchet.registry.records import TRIAL_STATES, TrialRecord

    spec = _spec(inp.spec)
    value = objective_value(spec, inp) if inp.state in ("completed", "pruned", "cancelled") and inp.steps > 0 else None
    _tell(spec, inp.sweep_id, inp.trial_index, inp.state, value)
    # The registry knows no "cancelled" trial: one the sweep's cancel stopped is a failed trial there.
    state = inp.state if inp.state in TRIAL_STATES else "failed"
    registry().record_trial(
        TrialRecord(
            sweep_id=inp.sweep_id,
            trial_index=inp.trial_index,
            run_id=inp.run_id,
            params=inp.params,
            state=state,
            objective_value=value,
            last_reported_step=inp.steps,
        )
    )
    return TrialResult(
        trial_index=inp.trial_index,
        run_id=inp.run_id,
        state=inp.state,
        params=inp.params,
        objective=value,
        steps=inp.steps,
        pruned_at=inp.pruned_at,
        error=inp.error,
    )


@activity.defn(name="sweep_status")
def sweep_status(inp: SweepEndInput) -> None:
    """The sweep's status (paused, running, completed, cancelled) and best trial in the registry."""
    registry().set_sweep_status(inp.sweep_id, inp.status, inp.best_trial_index)


SWEEP_ACTIVITIES = [sweep_begin, plan_trial, trial_rungs, finish_trial, sweep_status]
