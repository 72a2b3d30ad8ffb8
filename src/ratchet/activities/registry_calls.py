"""What the training activities tell the run registry: one call per activity, never failing.

The registry is a view of the object store (it can be rebuilt from it: `ratchet registry
rebuild`), so a registry that is down, full or misconfigured must not fail or retry a
training activity: every call here logs a warning and returns. The writes are upserts
keyed by run id (and checkpoint name), so a retried activity writes the same rows again.
The database is RATCHET_REGISTRY_URL (default: SQLite in the state folder); `off` turns
the registry off for this worker.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from typing import TYPE_CHECKING

from ratchet import types as t
from ratchet.extras import missing_message
from ratchet.registry.urls import registry_enabled, registry_url, safe_url
from ratchet.storage.metrics_log import MetricsLog
from ratchet.storage.object_store import ObjectStore

if TYPE_CHECKING:
    from ratchet.registry.db import Registry

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., None])

_registries: dict[str, "Registry"] = {}
_said_not_installed = False
_lock = threading.Lock()
# After a failure the registry is left alone this long: a database that does not answer
# would otherwise hold every step up for its connect timeout.
RETRY_AFTER_S = 60.0
_retry_after = 0.0


def registry() -> Registry | None:
    """This process's registry (opened and migrated on first use, per URL); None when off,
    or when this worker has not the registry extra installed (said once, in its log)."""
    global _said_not_installed
    if not registry_enabled():
        return None
    not_installed = missing_message("registry", "writing the run registry")
    if not_installed:
        if not _said_not_installed:
            log.warning(
                "%s; the registry is not written by this worker (it can be rebuilt later: `ratchet registry rebuild`)", not_installed
            )
            _said_not_installed = True
        return None
    from ratchet.registry.db import Registry

    url = registry_url()
    with _lock:
        if url not in _registries:
            _registries[url] = Registry.open(url)  # a failure is not cached: the next call tries again
        return _registries[url]


def _never_fails(fn: F) -> F:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> None:
        global _retry_after
        if time.monotonic() < _retry_after:
            log.debug("run registry: %s skipped (it failed less than %.0f s ago)", fn.__name__, RETRY_AFTER_S)
            return
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            _retry_after = time.monotonic() + RETRY_AFTER_S
            # The URL only with its password masked; the exception text can quote the URL
            # (a connection error), so it is not logged, only its type.
            url = safe_url(registry_url()) if registry_enabled() else "off"
            log.warning(
                "run registry %s: %s failed (%s); training carries on, the registry is tried again in %.0f s "
                "(rebuild what it missed with `ratchet registry rebuild`)",
                url,
                fn.__name__,
                type(exc).__name__,
                RETRY_AFTER_S,
            )
            log.debug("registry failure", exc_info=_without_secrets(exc))

    return call  # type: ignore[return-value]


def _without_secrets(exc: BaseException) -> bool:
    # Tracebacks of a connection error may hold the URL: only at DEBUG, and only when no
    # password can be in it.
    return "password" not in str(exc).lower() and "@" not in str(exc)


@_never_fails
def run_prepared(inp: t.PrepareInput, stored_config: dict[str, Any], digest: str) -> None:
    """prepare_run: the run's description and lineage (a resume sets it running again)."""
    reg = registry()
    if reg is None:
        return
    lineage = inp.lineage or t.RunLineage()
    from ratchet.registry.records import RunRecord
    from ratchet.registry.rebuild import describe_config

    described = describe_config(inp.run_id, stored_config)
    reg.record_run(
        RunRecord(
            **{
                **{f: getattr(described, f) for f in ("run_id", "name", "experiment", "algorithm", "loop_mode", "model", "config")},
                "config_digest": digest,
                "status": "running",
                "parent_run_id": lineage.parent_run_id,
                "parent_checkpoint": lineage.parent_checkpoint,
                "sweep_id": lineage.sweep_id,
                "trial_index": lineage.trial_index,
            }
        )
    )


# Progress rows are written by one background thread, in step order: record_step is a
# local activity, and the workflow task that schedules the next step waits for it, so a
# database round trip there would be on every step's path. The other calls here are once
# per run or per checkpoint, and flush the progress first so that rows land in order.
_progress = ThreadPoolExecutor(max_workers=1, thread_name_prefix="registry-progress")
FLUSH_TIMEOUT_S = 30.0


def step_recorded(inp: t.StepRecord) -> None:
    """record_step: the latest step and reward (and eval reward, on evaluated steps), written
    in the background (a worker that dies first loses only rows the next step rewrites)."""
    _progress.submit(_step_recorded, inp)


def flush(timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """Wait until the progress rows handed over so far are written (or given up on)."""
    try:
        _progress.submit(lambda: None).result(timeout=timeout_s)
    except Exception:  # noqa: BLE001 - a registry that hangs must not hold up the run's end
        log.warning("run registry: progress rows not written after %.0f s; carrying on", timeout_s)


@_never_fails
def _step_recorded(inp: t.StepRecord) -> None:
    reg = registry()
    if reg is None:
        return
    m = inp.metrics
    reg.record_progress(inp.run.run_id, inp.step, m.get("reward_mean"), m.get("eval_reward"))


@_never_fails
def checkpoints_changed(run: t.RunRef) -> None:
    """checkpoint and finish_run: the run's committed checkpoints as its store lists them
    (one still uploading is recorded by the next call, once its manifest is written)."""
    reg = registry()
    if reg is None:
        return
    from ratchet.registry.rebuild import committed_checkpoints

    reg.sync_checkpoints(run.run_id, committed_checkpoints(ObjectStore(run.run_uri)))


@_never_fails
def run_finished(run: t.RunRef, total_steps: int) -> None:
    """finish_run: completed with its final metrics (stopped when it ended before its
    last step: the `stop` signal), and its checkpoints once the last one landed."""
    flush()
    reg = registry()
    if reg is None:
        return
    store = ObjectStore(run.run_uri)
    from ratchet.registry.rebuild import committed_checkpoints, final_metrics

    summary = final_metrics(MetricsLog(store).read())
    status = "stopped" if summary.get("steps", 0) < total_steps else "completed"
    reg.finish_run(run.run_id, status, summary)
    reg.sync_checkpoints(run.run_id, committed_checkpoints(store))


@_never_fails
def run_released(inp: t.ReleaseInput) -> None:
    """release_run (every end but completion): failed, or cancelled when the input says
    so; a run already marked ended is left as it is."""
    flush()
    reg = registry()
    if reg is None:
        return
    current = reg.run(inp.run_id)
    if current is not None and current.status != "running":
        return
    reason = inp.reason or "failed"
    # "stopped": a stop while the run waited in the admission queue (it never trained).
    reg.finish_run(inp.run_id, reason if reason in ("failed", "cancelled", "stopped") else "failed", None)


__all__ = ["checkpoints_changed", "registry", "run_finished", "run_prepared", "run_released", "step_recorded"]
