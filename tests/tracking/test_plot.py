"""`ratchet plot`: the PNG of one or several runs' metrics.jsonl, its panels drawn or
marked empty, and bad input refused with a clear message."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from ratchet.platform.cli import app
from ratchet.platform.plot import DPI, FIGSIZE, PlotError, load_run, plot

WIDTH, HEIGHT = int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI)


def _write_run(root, run_id: str, steps: int, gain: float, *, with_eval: bool = True) -> None:
    folder = root / run_id
    folder.mkdir(parents=True)
    lines = []
    for s in range(steps):
        line = {
            "step": s, "time_unix": 1.8e9 + 0.4 * s, "time_utc": "x",
            "reward_mean": 0.1 + gain * (1 - math.exp(-s / 10)), "kl": 0.002 * s, "entropy": 2.8 - 0.01 * s,
            "response_length": 5 + (s % 3), "staleness": float(s % 2), "step_seconds": 0.2 + 0.01 * (s % 4),
            "generate_seconds": 0.05, "score_seconds": 0.01, "train_seconds": 0.1, "sync_seconds": 0.02,
        }  # fmt: skip
        if with_eval and s % 5 == 4:
            line["eval_reward"] = 0.1 + gain * s / steps
        lines.append(json.dumps(line))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _panels(png) -> list[np.ndarray]:
    """The 3 x 3 panel areas of the figure, as grey pixels (the legend strip on top cut off)."""
    grey = np.asarray(Image.open(png).convert("L"), dtype=float)
    top = int(HEIGHT * 0.05)
    body = grey[top:]
    h, w = body.shape[0] // 3, body.shape[1] // 3
    return [body[r * h : (r + 1) * h, c * w : (c + 1) * w] for r in range(3) for c in range(3)]


def _colour_pixels(png, region) -> int:
    """Pixels of a run's colour (matplotlib's C0 blue, C1 orange) inside one panel."""
    rgb = np.asarray(Image.open(png).convert("RGB"), dtype=int)
    top = int(HEIGHT * 0.05)
    body = rgb[top:]
    h, w = body.shape[0] // 3, body.shape[1] // 3
    r, c = divmod(region, 3)
    tile = body[r * h : (r + 1) * h, c * w : (c + 1) * w]
    blue = (abs(tile[..., 0] - 31) < 30) & (abs(tile[..., 1] - 119) < 30) & (abs(tile[..., 2] - 180) < 30)
    orange = (abs(tile[..., 0] - 255) < 30) & (abs(tile[..., 1] - 127) < 30) & (abs(tile[..., 2] - 14) < 40)
    return int(blue.sum()), int(orange.sum())


@pytest.mark.slow
def test_two_runs_overlaid_every_panel_drawn(tmp_path):
    _write_run(tmp_path / "runs", "run-a", 30, 0.4)
    _write_run(tmp_path / "runs", "run-b", 20, 0.2)
    out = plot(["run-a", "run-b"], tmp_path / "out" / "cmp.png", root=str(tmp_path / "runs"))
    assert out.is_file()
    assert Image.open(out).size == (WIDTH, HEIGHT)
    for i, panel in enumerate(_panels(out)):
        assert panel.std() > 10, f"panel {i} is blank"
        blue, orange = _colour_pixels(out, i)
        assert blue > 50 and orange > 50, f"panel {i}: run-a drew {blue} pixels, run-b {orange}"


def test_missing_metric_leaves_its_panel_empty_with_a_note(tmp_path):
    _write_run(tmp_path / "runs", "no-eval", 12, 0.3, with_eval=False)
    out = plot(["no-eval"], tmp_path / "one.png", root=str(tmp_path / "runs"))
    blue_eval, _ = _colour_pixels(out, 1)  # eval reward: nothing to draw
    blue_reward, _ = _colour_pixels(out, 0)
    assert blue_eval == 0 and blue_reward > 50
    assert _panels(out)[1].std() > 5  # the note and the frame are there: not a blank tile


def test_a_run_folder_or_file_path_works_too(tmp_path):
    _write_run(tmp_path, "by-path", 5, 0.1)
    assert [r["step"] for r in load_run(str(tmp_path / "by-path")).records] == [0, 1, 2, 3, 4]
    assert load_run(str(tmp_path / "by-path" / "metrics.jsonl")).run_id == "by-path"


def test_bad_input_is_a_clear_error(tmp_path):
    (tmp_path / "runs").mkdir()
    with pytest.raises(PlotError, match=r"unknown run 'nope-1'.*--root"):
        plot(["nope-1"], tmp_path / "x.png", root=str(tmp_path / "runs"))
    started = tmp_path / "runs" / "started"
    started.mkdir()
    (started / "config.json").write_text("{}")
    with pytest.raises(PlotError, match="has no metrics yet"):
        plot(["started"], tmp_path / "x.png", root=str(tmp_path / "runs"))
    (started / "metrics.jsonl").write_text('{"step": 0}\nnot json\n')
    with pytest.raises(PlotError, match="line 2: not JSON"):
        plot(["started"], tmp_path / "x.png", root=str(tmp_path / "runs"))
    assert not (tmp_path / "x.png").exists()


def test_cli_plot(tmp_path):
    _write_run(tmp_path / "runs", "cli-run", 8, 0.2)
    runner = CliRunner()
    ok = runner.invoke(app, ["plot", "cli-run", "--root", str(tmp_path / "runs"), "--out", str(tmp_path / "c.png")])
    assert ok.exit_code == 0, ok.output
    assert "wrote" in ok.output and (tmp_path / "c.png").is_file()
    bad = runner.invoke(app, ["plot", "ghost", "--root", str(tmp_path / "runs"), "--out", str(tmp_path / "g.png")])
    assert bad.exit_code == 2
    assert "unknown run 'ghost'" in bad.output
