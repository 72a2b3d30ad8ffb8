"""How the CLI shows sweeps: a live progress display while one runs, tables of sweeps and
of one sweep's trials (from the run registry), and a sweep's result."""

from __future__ import annotations

from typing import Any, Sequence

from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ratchet.sweep_types import SweepSummary, TrialResult

from .tables import fact_column, show, text_column


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def watch_sweep(handle, console: Console, every: float = 1.0) -> SweepSummary:
    """Follow the sweep with a bar of finished trials and a line per running trial."""
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[line]}"), TimeElapsedColumn(),
        console=console, transient=False,
    ) as bar:  # fmt: skip
        task = bar.add_task(handle.sweep_id, total=None, line="starting")
        for p in handle.follow(every):
            best = p.best
            line = f"{p.status} · running {p.running or '-'}"
            if best is not None:
                line += f" · best t{best.trial_index} {_fmt(best.objective)}"
            pruned = sum(1 for r in p.finished if r.state == "pruned")
            if pruned:
                line += f" · pruned {pruned}"
            bar.update(task, total=p.total, completed=len(p.finished), line=line)
    return handle.result()


def trials_table(trials: Sequence[TrialResult], title: str, best: TrialResult | None = None) -> Table:
    table = Table(title=title)
    text_column(table, "trial")
    fact_column(table, "run")
    for col in ("state", "objective", "steps", "pruned at", "params"):
        text_column(table, col)
    for r in trials:
        mark = " [green]best[/green]" if best is not None and r.trial_index == best.trial_index else ""
        table.add_row(
            f"{r.trial_index}{mark}", r.run_id, r.state, _fmt(r.objective), str(r.steps),
            "-" if r.pruned_at is None else str(r.pruned_at), _params(r.params),
        )  # fmt: skip
    return table


def summary_view(summary: SweepSummary) -> Group:
    best = summary.best
    head = f"sweep [bold]{summary.sweep_id}[/bold]: {summary.status}, {len(summary.trials)} trials"
    head += (
        f"; best: trial {best.trial_index} ({best.run_id}) objective {_fmt(best.objective)} with {_params(best.params)}"
        if best
        else "; no completed trial"
    )
    return Group(head, trials_table(summary.trials, "trials", best))


def show_summary(console: Console, summary: SweepSummary) -> None:
    """`summary_view` printed so that no run id or parameter name is cut (`tables.show`)."""
    head, table = summary_view(summary).renderables
    console.print(head, soft_wrap=True)
    show(console, table)


def sweeps_table(sweeps: Sequence[Any], trials_by_sweep: dict[str, Sequence[Any]], title: str) -> Table:
    """Sweeps from the registry (SweepRecord) with their trial counts and best trial."""
    table = Table(title=title)
    fact_column(table, "sweep")  # ids a user copies into the next command: never cut (print with tables.show)
    for col in ("status", "trials", "done", "pruned", "objective", "best trial", "best value", "created"):
        text_column(table, col)
    for s in sweeps:
        trials = trials_by_sweep.get(s.sweep_id, [])
        best = next((t for t in trials if t.trial_index == s.best_trial_index), None)
        table.add_row(
            s.sweep_id, s.status, str(len(trials)), str(sum(1 for t in trials if t.state in ("completed", "pruned", "failed"))),
            str(sum(1 for t in trials if t.state == "pruned")), f"{s.objective} ({s.direction})",
            "-" if s.best_trial_index is None else str(s.best_trial_index), _fmt(best.objective_value if best else None),
            str(s.created_at or "")[:19],
        )  # fmt: skip
    return table


def registry_trials_table(sweep: Any, trials: Sequence[Any]) -> Table:
    """One sweep's trials from the registry (TrialRecord)."""
    table = Table(title=f"sweep {sweep.sweep_id} ({sweep.status}); objective {sweep.objective} ({sweep.direction})")
    text_column(table, "trial")
    fact_column(table, "run")
    for col in ("state", "objective", "steps", "params"):
        text_column(table, col)
    for t in trials:
        mark = " [green]best[/green]" if t.trial_index == sweep.best_trial_index else ""
        table.add_row(
            f"{t.trial_index}{mark}", t.run_id or "-", t.state, _fmt(t.objective_value), str(t.last_reported_step or "-"), _params(t.params)
        )
    return table
