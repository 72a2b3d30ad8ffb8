"""Follow a run in the terminal: a Rich progress bar fed by the workflow's progress query."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ratchet.storage.layout import RunLayout
from ratchet.types import RunSummary

from .client import RunHandle

POLL_SECONDS = 0.5


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


def summary_table(summary: RunSummary, wall_s: float, ui_url: str | None = None) -> Table:
    table = Table(title=f"run {summary.run_id}", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value")
    table.add_row("steps", str(summary.steps))
    table.add_row("warm-up loss", f"{summary.warmup_loss_first:.3f} -> {summary.warmup_loss_last:.3f}")
    table.add_row("sampled reward, first 10 steps", f"{summary.reward_first10:.3f}")
    table.add_row("sampled reward, last 10 steps", f"{summary.reward_last10:.3f}")
    for step, reward in sorted(summary.eval_rewards.items(), key=lambda kv: int(kv[0])):
        table.add_row(f"eval reward (greedy) at step {step}", f"{reward:.3f}")
    table.add_row("final policy", summary.final_policy_uri or "-")
    table.add_row("metrics", f"{summary.run_uri}/{RunLayout.METRICS}")
    if ui_url:
        table.add_row("Temporal UI", f"{ui_url}/namespaces/default/workflows/{summary.run_id}")
    table.add_row("wall time", f"{wall_s:.1f} s")
    return table

