"""What `ratchet runs` and `ratchet registry ...` show: the run registry as Rich tables.

Kept out of cli.py so the command functions stay one screen each; everything here is
plain data in, tables out, and is tested without a terminal (tests/registry/test_cli.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

from rich.table import Table

from ratchet.registry.records import RunRecord

from .tables import fact_column, text_column

# Metrics compared side by side by `ratchet runs --compare`.
CURVE_METRICS = ("reward_mean", "eval_reward")


def open_registry(url: str | None = None, state_dir: Path | None = None):
    """The registry at `url`; else RATCHET_REGISTRY_URL; else SQLite in `state_dir` (the
    CLI's --state-dir) or the default state folder."""
    from ratchet.registry.db import Registry
    from ratchet.registry.urls import ENV, sqlite_url
    import os

    if url is None and state_dir is not None and not os.environ.get(ENV, "").strip():
        url = sqlite_url(state_dir)
    return Registry.open(url)


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def runs_table(records: Sequence[RunRecord], title: str) -> Table:
    """Print it with `tables.show`: ids, experiments, parents and sweeps are never cut."""
    table = Table(title=title)
    for col in ("run id", "experiment", "algorithm", "status", "step", "reward", "eval reward", "parent", "sweep"):
        if col in ("step", "reward", "eval reward", "algorithm"):
            text_column(table, col, justify="right" if col != "algorithm" else "left")
        else:
            fact_column(table, col)
    colors = {"completed": "green", "failed": "red", "cancelled": "yellow", "stopped": "yellow", "running": "cyan"}
    for r in records:
        parent = f"{r.parent_run_id}@{r.parent_checkpoint}" if r.parent_run_id and r.parent_checkpoint else (r.parent_run_id or "")
        sweep = f"{r.sweep_id}#{r.trial_index}" if r.sweep_id is not None and r.trial_index is not None else (r.sweep_id or "")
        table.add_row(
            r.run_id, r.experiment, r.algorithm, f"[{colors.get(r.status, 'white')}]{r.status}[/]",
            # Steps done, as the progress query counts them (metrics.jsonl numbers steps from 0).
            "-" if r.last_step is None else str(r.last_step + 1),
            _num(r.last_reward), _num(r.eval_reward), parent, sweep,
        )  # fmt: skip
    return table


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """`{"trainer": {"lr": 1e-3}}` -> `{"trainer.lr": 1e-3}` (lists stay values)."""
    if not isinstance(config, dict):
        return {prefix: config}
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


_MISSING = object()


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """The dotted keys whose values differ, sorted; a key one side lacks shows as missing."""
    fa, fb = flatten(a), flatten(b)
    rows = []
    for key in sorted(set(fa) | set(fb)):
        va, vb = fa.get(key, _MISSING), fb.get(key, _MISSING)
        if va != vb:
            rows.append((key, va, vb))
    return rows


def _show(value: Any) -> str:
    return "(missing)" if value is _MISSING else json.dumps(value) if not isinstance(value, str) else value


def diff_table(a: RunRecord, b: RunRecord) -> Table:
    table = Table(title=f"config: {a.run_id} vs {b.run_id}")
    for col in ("key", a.run_id, b.run_id):  # keys and values (paths among them) stay whole
        fact_column(table, col)
    rows = config_diff(a.config, b.config)
    for key, va, vb in rows:
        table.add_row(key, _show(va), _show(vb))
    if not rows:
        table.add_row("(no differences)", "", "")
    return table


def read_metrics(record: RunRecord, root: str | None = None) -> list[dict[str, Any]]:
    """The run's metrics.jsonl lines, from `root` or the storage.root in its config."""
    from ratchet.storage.metrics_log import MetricsLog
    from ratchet.storage.object_store import ObjectStore
    from ratchet.storage.layout import RunLayout

    storage_root = root or (record.config.get("storage") or {}).get("root") or RunLayout.DEFAULT_ROOT
    try:
        return MetricsLog(ObjectStore(storage_root).child(record.run_id)).read()
    except (FileNotFoundError, OSError, ValueError):
        return []


def curve_rows(curves: Sequence[list[dict[str, Any]]], metrics: Iterable[str] = CURVE_METRICS, max_rows: int = 25) -> list[list[str]]:
    """Rows of `step, run1 metric1, run2 metric1, run1 metric2, ...`, at most `max_rows`
    steps (evenly spaced, the last always kept)."""
    metrics = list(metrics)
    by_step = [{int(r["step"]): r for r in lines if "step" in r} for lines in curves]
    steps = sorted(set().union(*[set(s) for s in by_step])) if by_step else []
    if len(steps) > max_rows > 1:  # evenly spaced, the first and the last kept
        n = len(steps)
        steps = [steps[i] for i in sorted({round(k * (n - 1) / (max_rows - 1)) for k in range(max_rows)})]
    rows = []
    for step in steps:
        row = [str(step + 1)]
        for m in metrics:
            for s in by_step:
                v = s.get(step, {}).get(m)
                row.append(_num(v) if isinstance(v, (int, float)) else "")
        rows.append(row)
    return rows


def curves_table(a: RunRecord, b: RunRecord, root: str | None = None, max_rows: int = 25) -> Table:
    table = Table(title=f"curves: {a.run_id} vs {b.run_id} (metrics.jsonl)")
    text_column(table, "step", justify="right")
    for m in CURVE_METRICS:
        for r in (a, b):
            text_column(table, f"{m} {r.run_id}", justify="right")
    rows = curve_rows([read_metrics(a, root), read_metrics(b, root)], CURVE_METRICS, max_rows)
    for row in rows:
        table.add_row(*row)
    if not rows:
        table.add_row("(no metrics found)", *[""] * (2 * len(CURVE_METRICS)))
    return table


__all__ = ["config_diff", "curve_rows", "curves_table", "diff_table", "flatten", "open_registry", "read_metrics", "runs_table"]
