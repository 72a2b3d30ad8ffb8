"""`ratchet plot`: one PNG of how runs trained, read from their `metrics.jsonl`.

Panels: reward, eval reward, KL, entropy, response length, staleness, step time split
per phase, and reward and step time against wall-clock minutes; several runs overlaid in
one colour each, with a legend. A metric that none of the runs logged (say, eval reward
of a run without eval data) leaves its panel empty with a note instead of failing: old
runs and other loop modes log different keys. Matplotlib's Agg canvas draws it; no
display and no pyplot state are involved, so the worker, tests and CI can call it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout

# (title, metrics.jsonl key) of the panels against step; the key names are those of
# workflows/scheduling.step_metrics and the trainer's metrics.
STEP_PANELS: tuple[tuple[str, str], ...] = (
    ("reward (mean)", "reward_mean"),
    ("eval reward", "eval_reward"),
    ("KL to reference", "kl"),
    ("entropy", "entropy"),
    ("response length (tokens)", "response_length"),
    ("staleness (policy versions)", "staleness"),
)
# Step time split per phase: (label, key, line style).
PHASES: tuple[tuple[str, str, str], ...] = (
    ("generate", "generate_seconds", "-"),
    ("score", "score_seconds", ":"),
    ("train", "train_seconds", "--"),
    ("sync", "sync_seconds", "-."),
    ("checkpoint stall", "checkpoint_stall_seconds", (0, (6, 2, 1, 2, 1, 2))),  # type: ignore[assignment]
)
FIGSIZE = (16.0, 12.0)  # inches
DPI = 100  # 1600 x 1200 pixels


class PlotError(ValueError):
    """A run to plot cannot be read (unknown run, no metrics yet, not JSON Lines)."""


@dataclass
class RunCurves:
    """One run's metrics lines, as columns."""

    run_id: str
    records: list[dict] = field(default_factory=list)

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of the lines that carry `key` as a number."""
        xs, ys = [], []
        for r in self.records:
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                xs.append(float(r["step"]))
                ys.append(float(v))
        return xs, ys

    def minutes(self, key: str) -> tuple[list[float], list[float]]:
        """(minutes since the run's first line, values) of the lines that carry `key`."""
        t0 = min((r["time_unix"] for r in self.records if isinstance(r.get("time_unix"), (int, float))), default=None)
        xs, ys = [], []
        for r in self.records:
            v, t = r.get(key), r.get("time_unix")
            if t0 is not None and isinstance(t, (int, float)) and isinstance(v, (int, float)) and not isinstance(v, bool):
                xs.append((t - t0) / 60.0)
                ys.append(float(v))
        return xs, ys


def load_run(run: str, root: str | None = None) -> RunCurves:
    """A run by id under `root` (default .ratchet/runs), or by the path of its folder or
    of its metrics.jsonl file."""
    path = Path(run)
    if path.is_file():
        return RunCurves(path.parent.name, _parse(path.read_text(), str(path)))
    if path.is_dir() and (path / RunLayout.METRICS).is_file():
        return RunCurves(path.name, _parse((path / RunLayout.METRICS).read_text(), str(path / RunLayout.METRICS)))
    base = root or RunLayout.DEFAULT_ROOT
    try:
        store = ObjectStore(base).child(run)
    except ValueError as exc:  # not a valid run id (and not an existing path)
        raise PlotError(f"{run!r} is neither a run id nor a run folder or metrics.jsonl file: {exc}") from None
    if not store.exists(RunLayout.METRICS):
        where = store.uri(RunLayout.METRICS)
        if not store.exists(RunLayout.CONFIG):
            raise PlotError(f"unknown run {run!r}: no run folder at {store.url}; check the run id, or give --root (the run's storage.root)")
        raise PlotError(f"run {run!r} has no metrics yet ({where} is missing): it has not finished a step")
    return RunCurves(run, _parse(store.get_bytes(RunLayout.METRICS).decode(), store.uri(RunLayout.METRICS)))


def _parse(text: str, where: str) -> list[dict]:
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise PlotError(f"{where}, line {n}: not JSON ({exc})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise PlotError(f"{where}, line {n}: not a metrics line (no integer 'step')")
        records.append(record)
    return sorted(records, key=lambda r: r["step"])


def plot_runs(runs: Sequence[RunCurves], out: str | Path) -> Path:
    """Draw the panels for `runs` into the PNG `out`; returns its path."""
    from ratchet.extras import require

    require("plots")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not runs:
        raise PlotError("no runs to plot")
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 3).ravel()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for ax, (title, key) in zip(axes, STEP_PANELS):
        drawn = False
        for run, color in zip(runs, colors):
            xs, ys = run.series(key)
            if xs:
                ax.plot(xs, ys, color=color, marker="o" if len(xs) < 30 else None, markersize=3, label=run.run_id)
                drawn = True
        _finish(ax, title, "step", drawn, key)
    _phase_panel(axes[6], runs, colors)
    for ax, (title, key) in (
        (axes[7], ("reward against wall-clock", "reward_mean")),
        (axes[8], ("step time against wall-clock (s)", "step_seconds")),
    ):
        drawn = False
        for run, color in zip(runs, colors):
            xs, ys = run.minutes(key)
            if xs:
                ax.plot(xs, ys, color=color, label=run.run_id)
                drawn = True
        _finish(ax, title, "minutes since the first step", drawn, key)
    handles, labels = [], []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels and not label.startswith("_"):
                handles.append(h)
                labels.append(label)
    runs_only = [(h, label) for h, label in zip(handles, labels) if label in {r.run_id for r in runs}]
    fig.legend([h for h, _ in runs_only], [label for _, label in runs_only], loc="upper center", ncol=min(len(runs_only), 4), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def _phase_panel(ax, runs: Sequence[RunCurves], colors: list[str]) -> None:
    """Seconds per phase per step: one colour per run, one line style per phase."""
    drawn = False
    for run, color in zip(runs, colors):
        for label, key, style in PHASES:
            xs, ys = run.series(key)
            if xs and any(ys):
                ax.plot(xs, ys, color=color, linestyle=style, label=f"_{run.run_id} {label}")
                drawn = True
    if drawn:
        from matplotlib.lines import Line2D

        present = [(label, style) for label, key, style in PHASES if any(any(r.series(key)[1]) for r in runs)]
        ax.legend(
            [Line2D([], [], color="0.3", linestyle=s) for _, s in present], [lbl for lbl, _ in present], fontsize=8, loc="upper right"
        )
    _finish(ax, "step time per phase (s)", "step", drawn, "generate/score/train/sync_seconds")


def _finish(ax, title: str, xlabel: str, drawn: bool, key: str) -> None:
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.grid(True, alpha=0.3)
    if not drawn:
        ax.text(0.5, 0.5, f"no '{key}' in these runs", ha="center", va="center", transform=ax.transAxes, color="0.4")
        ax.set_xticks([])
        ax.set_yticks([])


def plot(runs: Sequence[str], out: str | Path | None = None, root: str | None = None) -> Path:
    """Load `runs` (ids or paths) and write the PNG; default name `<first run>.png` here."""
    if not runs:
        raise PlotError("name at least one run")
    curves = [load_run(r, root) for r in runs]
    if out is None:
        out = Path(f"{curves[0].run_id}.png" if len(curves) == 1 else f"{curves[0].run_id}-and-{len(curves) - 1}-more.png")
    return plot_runs(curves, out)


def plot_or_reason(runs: Sequence[str], out: str | Path, root: str | None = None) -> str:
    """The PNG's path, or why there is none: for the demo, whose run is done either way."""
    try:
        return str(plot(runs, out, root))
    except Exception as exc:  # noqa: BLE001 - a plot is a by-product; say why, never fail the demo
        return f"(no plot: {type(exc).__name__}: {exc})"
