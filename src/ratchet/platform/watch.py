"""Follow a run in the terminal: a Rich progress bar fed by the workflow's progress query,
the run's summary once it has ended, and the facts that summary links to (the run's wall
time and its page in the Temporal UI). `ratchet train` and `ratchet watch` share it, so
the bar a user re-attaches to is the one they left."""

from __future__ import annotations

import os
from datetime import datetime

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ratchet.storage.layout import RunLayout
from ratchet.types import RunSummary

from .client import RunHandle
from .tables import fact_column

POLL_SECONDS = 0.5
# Where links to the Temporal UI point when the server is not the embedded one.
UI_URL_ENV = "RATCHET_TEMPORAL_UI_URL"
# Printed when the user leaves a run's progress bar (Ctrl-C): the run is a workflow and
# does not stop with the terminal.
LEFT_RUNNING = "the run goes on without you: follow it with `ratchet watch {run_id}`, stop it with `ratchet stop {run_id}`"


class RunNotFound(LookupError):
    """No workflow with the run's id on the Temporal server."""


class RunEnded(RuntimeError):
    """The run ended without a summary (failed, cancelled, terminated, timed out); the
    message says how and what to do next, on one line."""


def watch(handle: RunHandle, console: Console) -> RunSummary:
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TextColumn("[dim]{task.fields[phase]}"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(handle.run_id, total=None, reward="-", tps="-", phase="starting")
        for p in handle.follow(POLL_SECONDS):
            bar.update(
                task,
                total=p.total_steps or None,
                completed=p.step,
                reward=f"{p.reward_mean:.3f}" if p.reward_mean is not None else "-",
                tps=f"{p.tokens_per_second:,.0f}" if p.tokens_per_second else "-",
                phase=p.phase,
            )
        summary = handle.result()
        bar.update(task, completed=summary.steps, phase="completed")
    return summary


def follow_run(handle: RunHandle, console: Console) -> RunSummary:
    """The run's summary: after the progress bar while it is open (running or paused),
    at once when it has completed. RunNotFound when there is no such run; RunEnded when it
    ended without one. KeyboardInterrupt passes through: the caller says the run goes on."""
    from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
    from temporalio.service import RPCError, RPCStatusCode

    try:
        open_ = handle.client._run(handle._handle().describe()).status == WorkflowExecutionStatus.RUNNING
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise RunNotFound(
                f"no run {handle.run_id!r} on the Temporal server (namespace {handle.client._temporal.namespace!r}): "
                "`ratchet status` lists the runs in flight, `ratchet runs` the runs the registry knows"
            ) from None
        raise
    try:
        if not open_:
            return handle.result()
        console.print(f"following run {handle.run_id} (Ctrl-C leaves it running)", soft_wrap=True, highlight=False)
        return watch(handle, console)
    except WorkflowFailureError as exc:
        raise RunEnded(_ended(handle, exc)) from None


def _ended(handle: RunHandle, exc: Exception) -> str:
    status = handle.status().lower().replace("_", " ")
    cause, why = getattr(exc, "cause", None), ""
    while cause is not None:  # the innermost message says what went wrong
        why = getattr(cause, "message", None) or str(cause) or why
        cause = getattr(cause, "cause", None)
    run_id = handle.run_id
    return (
        f"run {run_id} {status}" + (f": {why}" if why else "")
        + f"; its checkpoints: `ratchet checkpoints {run_id}`, continue it with `ratchet resume {run_id}`"
    )  # fmt: skip


def wall_seconds(handle: RunHandle) -> float | None:
    """Seconds from the start of the run's (latest) workflow execution to its close, as the
    Temporal server recorded them; None if it has not closed or cannot be asked."""
    try:
        desc = handle.client._run(handle._handle().describe())
    except Exception:  # noqa: BLE001 - a missing fact, not a failure of the command
        return None
    start, close = desc.start_time, desc.close_time
    if not isinstance(start, datetime) or not isinstance(close, datetime):
        return None
    return (close - start).total_seconds()


def temporal_ui_url(temporal_address: str) -> str | None:
    """The web UI of the Temporal server at `temporal_address`, for links: $RATCHET_TEMPORAL_UI_URL;
    else the embedded server's UI when that server is the one (as services.json records it,
    or as the settings' ports say); else None (a cluster's UI address is not knowable here)."""
    explicit = os.environ.get(UI_URL_ENV, "").strip()
    if explicit:
        return explicit.rstrip("/")
    from .services import ServiceSettings, temporal_address as embedded_address, temporal_ui_url as embedded_ui
    from .services.state import recorded

    settings = ServiceSettings.from_env()
    rec = recorded(settings).get("temporal") or {}
    if rec.get("address") == temporal_address and rec.get("ui_url"):
        return str(rec["ui_url"])
    return embedded_ui(settings) if embedded_address(settings) == temporal_address else None


def run_link(ui_url: str, run_id: str, namespace: str = "default") -> str:
    """The run's page in the Temporal UI."""
    return f"{ui_url.rstrip('/')}/namespaces/{namespace}/workflows/{run_id}"


def summary_table(summary: RunSummary, wall_s: float | None, ui_url: str | None = None, namespace: str = "default") -> Table:
    """The run's facts as a key/value table; print it with `tables.show` so that the paths
    and the link stay whole at any width."""
    table = Table(title=f"run {summary.run_id}", show_header=False)
    table.add_column("metric", style="bold", no_wrap=True)
    fact_column(table, "value")
    table.add_row("steps", str(summary.steps) + (" (stopped early)" if summary.stopped else ""))
    # A cross-entropy loss is never exactly 0: both 0.0 means the run had no warm-up.
    no_warmup = summary.warmup_loss_first == summary.warmup_loss_last == 0.0
    table.add_row("warm-up loss", "- (no warm-up)" if no_warmup else f"{summary.warmup_loss_first:.3f} -> {summary.warmup_loss_last:.3f}")
    table.add_row("sampled reward, first 10 steps", f"{summary.reward_first10:.3f}")
    table.add_row("sampled reward, last 10 steps", f"{summary.reward_last10:.3f}")
    for step, reward in sorted(summary.eval_rewards.items(), key=lambda kv: int(kv[0])):
        table.add_row(f"eval reward (greedy) at step {step}", f"{reward:.3f}")
    if summary.unsafe_tools:
        table.add_row("UNSAFE", f"model code ran without the sandbox (unsafe_local): {', '.join(summary.unsafe_tools)}")
    table.add_row("final policy", summary.final_policy_uri or "-")
    table.add_row("metrics", f"{summary.run_uri}/{RunLayout.METRICS}")
    if ui_url:
        table.add_row("Temporal UI", run_link(ui_url, summary.run_id, namespace))
    table.add_row("wall time", "-" if wall_s is None else f"{wall_s:.1f} s")
    return table
