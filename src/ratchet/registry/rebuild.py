"""Rebuild the registry's runs and checkpoints from an object store root.

The object store is the source of truth (docs/design.md): every run folder holds its config,
`metrics.jsonl` and committed checkpoints, so a lost or stale registry is rebuilt from
them. Lineage (parent, sweep) comes from `lineage.json`, else from the existing row; an ended
run's status is kept from the existing row. A run without a row is `completed` when it has its final model or
all its steps, else `failed`. Sweeps and trials
are not in run folders and are left as they are.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Callable, TypeGuard

from .db import Registry
from .records import END_STATUSES, CheckpointRecord, RunRecord

log = logging.getLogger(__name__)


@dataclass
class RebuildReport:
    runs: list[str] = field(default_factory=list)  # run ids recorded
    checkpoints: int = 0  # checkpoint rows written
    skipped: dict[str, str] = field(default_factory=dict)  # folder -> why it is not a run, or why it failed
    skipped_lines: dict[str, list[str]] = field(default_factory=dict)  # run id -> metrics lines skipped (unreadable)


def config_digest(config: dict[str, Any]) -> str:
    """The digest `prepare_run` gives a stored config (activities/training.config_digest)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def describe_config(run_id: str, config: dict[str, Any]) -> RunRecord:
    """A run's description from its stored config (a dict as `config.json` holds it)."""

    def section(name: str) -> dict[str, Any]:
        value = config.get(name)
        return value if isinstance(value, dict) else {}

    return RunRecord(
        run_id=run_id,
        name=str(section("tracking").get("name") or ""),
        experiment=str(section("tracking").get("experiment") or ""),
        algorithm=str(section("algorithm").get("adv_estimator") or ""),
        loop_mode=str(section("loop").get("mode") or ""),
        model=str(section("model").get("path") or ""),
        config_digest=config_digest(config),
        config=config,
    )


def final_metrics(lines: list[dict[str, Any]]) -> dict[str, float]:
    """A finished run's summary from its metrics lines: the last line's numbers, the
    latest eval reward (evaluations are not on every line) and the number of steps."""
    if not lines:
        return {}
    last = max(lines, key=lambda r: r.get("step", -1))
    out = {k: float(v) for k, v in last.items() if _is_number(v) and k not in ("time_unix",)}
    evals = [r for r in lines if _is_number(r.get("eval_reward"))]
    if evals:
        out["eval_reward"] = float(max(evals, key=lambda r: r.get("step", -1))["eval_reward"])
    out["steps"] = float(int(last.get("step", -1)) + 1)
    return out


def progress(lines: list[dict[str, Any]]) -> tuple[int | None, float | None, float | None]:
    """(last step, its reward, the latest eval reward) from metrics lines."""
    if not lines:
        return None, None, None
    last = max(lines, key=lambda r: r.get("step", -1))
    reward = last.get("reward_mean")
    evals = [r for r in lines if _is_number(r.get("eval_reward"))]
    eval_reward = float(max(evals, key=lambda r: r.get("step", -1))["eval_reward"]) if evals else None
    return int(last["step"]), (float(reward) if _is_number(reward) else None), eval_reward


def _is_number(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _parse_time(text: str) -> datetime | None:
    try:
        value = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def committed_checkpoints(run_store: Any) -> list[CheckpointRecord]:
    """The run's committed checkpoints (manifests present), as registry records."""
    from ratchet.storage.checkpoint_store import CheckpointStore

    out = []
    for info in CheckpointStore(run_store).list():
        if info.step is None:
            continue  # not one the trainer wrote (its manifests always carry the step)
        run_id = run_store.url.rstrip("/").rsplit("/", 1)[-1]
        out.append(CheckpointRecord(run_id=run_id, step=info.step, name=info.name, uri=info.uri, created_at=_parse_time(info.created)))
    return out


_LINEAGE_FIELDS = ("parent_run_id", "parent_checkpoint", "sweep_id", "trial_index")


def _lineage(run_store: Any, existing: RunRecord | None) -> dict[str, Any]:
    """The run's parent and sweep: from its `lineage.json` (written at prepare_run), else
    from the row the registry already had (runs from before that file existed)."""
    from ratchet.storage.layout import RunLayout

    stored: dict[str, Any] = {}
    if run_store.exists(RunLayout.LINEAGE):
        try:
            data = run_store.get_json(RunLayout.LINEAGE)
            stored = data if isinstance(data, dict) else {}
        except Exception as exc:  # noqa: BLE001 - an unreadable file: keep what the registry has
            log.warning("rebuild: unreadable %s: %s", RunLayout.LINEAGE, exc)
    return {f: stored.get(f, getattr(existing, f) if existing else None) for f in _LINEAGE_FIELDS}


def rebuild_from_store(
    registry: Registry,
    root: str,
    *,
    on_start: Callable[[int], None] | None = None,
    on_run: Callable[[str], None] | None = None,
) -> RebuildReport:
    """Record every run folder under `root` (a local folder or an object store URL) in
    `registry`: description, progress, final metrics, status and committed checkpoints.
    Idempotent: rebuilding twice leaves the same rows. `on_start(number of folders)` and
    `on_run(run_id)` after each one drive a progress bar. A folder that cannot be recorded
    is skipped with its reason (`report.skipped`) and the others go on; a torn line in a
    run's `metrics.jsonl` is skipped (`report.skipped_lines`) and the run recorded from the
    lines that read."""
    from ratchet.storage.object_store import ObjectStore
    from ratchet.storage.layout import RunLayout

    store = ObjectStore(root)
    report = RebuildReport()
    folders = sorted({k.split("/", 1)[0] for k in store.list("") if k.endswith("/" + RunLayout.CONFIG) and k.count("/") == 1})
    if on_start is not None:
        on_start(len(folders))
    for run_id in folders:
        try:
            _rebuild_run(registry, store, run_id, report)
        except Exception as exc:  # noqa: BLE001 - one run's failure must not stop the others
            report.skipped[run_id] = f"{type(exc).__name__}: {exc}"
            log.warning("rebuild: skipping %s: %s: %s", run_id, type(exc).__name__, exc)
        if on_run is not None:
            on_run(run_id)
    log.info(
        "rebuilt %d runs (%d checkpoints) from %s into %s; skipped %d folders and %d unreadable metrics lines",
        len(report.runs), report.checkpoints, root, registry.url, len(report.skipped),
        sum(len(v) for v in report.skipped_lines.values()),
    )  # fmt: skip
    return report


def _rebuild_run(registry: Registry, store: Any, run_id: str, report: RebuildReport) -> None:
    """Record one run folder (see `rebuild_from_store`); raises when it cannot."""
    from ratchet.storage.metrics_log import MetricsLog
    from ratchet.storage.layout import RunLayout

    run_store = store.child(run_id)
    config = run_store.get_json(RunLayout.CONFIG)  # a bad id or unreadable JSON: not a run folder ratchet wrote
    if not isinstance(config, dict):
        raise ValueError("config.json is not an object")
    metrics = MetricsLog(run_store).read_checked()  # torn lines skipped (and counted): the rest still counts
    if metrics.skipped:
        report.skipped_lines[run_id] = [f"{RunLayout.METRICS} {why}" for why in metrics.skipped]
    lines = metrics.records
    last_step, reward, eval_reward = progress(lines)
    steps = (config.get("loop") or {}).get("steps") if isinstance(config.get("loop"), dict) else None
    finished = run_store.exists(f"{RunLayout.FINAL_MODEL}/{RunLayout.MODEL_MANIFEST}") or (
        isinstance(steps, int) and last_step is not None and last_step + 1 >= steps
    )
    existing = registry.run(run_id)
    lineage = _lineage(run_store, existing)
    if existing is not None and existing.status in END_STATUSES:
        status = existing.status  # what the run's own activities recorded (e.g. stopped)
    elif finished:
        status = "completed"
    else:
        status = existing.status if existing else "failed"
    record = replace(
        describe_config(run_id, config),
        status=status,
        created_at=run_store.modified(RunLayout.CONFIG),
        **lineage,
    )
    registry.record_run(record)
    if last_step is not None:
        registry.record_progress(run_id, last_step, reward, eval_reward)
    if finished:
        registry.finish_run(run_id, status, final_metrics(lines))
    checkpoints = committed_checkpoints(run_store)
    registry.sync_checkpoints(run_id, checkpoints)
    report.runs.append(run_id)
    report.checkpoints += len(checkpoints)


__all__ = ["RebuildReport", "committed_checkpoints", "config_digest", "describe_config", "final_metrics", "progress", "rebuild_from_store"]
