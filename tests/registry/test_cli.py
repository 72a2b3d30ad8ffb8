"""`ratchet runs` (filter, sort, compare) and `ratchet registry upgrade|rebuild`, through
the real Typer app on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from ratchet.platform.cli import app
from ratchet.platform.runs_view import config_diff, curve_rows
from ratchet.registry.db import Registry
from ratchet.registry.records import RunRecord

from .conftest import PG_PASSWORD
from .runfolders import write_run

runner = CliRunner()


def invoke(*args: str):
    """The command's exit code and output, drawn 250 columns wide (its tables as tables),
    on a console of its own: the CLI's module console may carry a width another test in
    this process gave it."""
    from rich.console import Console

    from ratchet.platform import cli

    before, cli.console = cli.console, Console(width=250)
    try:
        result = runner.invoke(app, list(args), env={"COLUMNS": "250"})
    finally:
        cli.console = before
    return result.exit_code, result.output


@pytest.fixture
def store(db_url, tmp_path):
    """Two finished runs and a failed one, rebuilt into the registry by the CLI."""
    root = tmp_path / "runs"
    write_run(root, "base-1", rewards=[0.1, 0.2, 0.3], evals={2: 0.25}, final=True, loop={"steps": 3},
              tracking={"experiment": "exp-a"})  # fmt: skip
    write_run(root, "lr-2", rewards=[0.1, 0.4, 0.6], evals={2: 0.5}, final=True, loop={"steps": 3},
              tracking={"experiment": "exp-a"}, trainer={"lr": 0.002})  # fmt: skip
    write_run(root, "other-3", rewards=[0.05], loop={"steps": 3}, tracking={"experiment": "exp-b"})
    code, out = invoke("registry", "rebuild", "--root", str(root), "--url", db_url)
    assert code == 0, out
    assert "rebuilt 3 runs (0 checkpoints)" in out
    return db_url, root


def test_runs_lists_filters_and_sorts(store):
    url, _ = store
    code, out = invoke("runs", "--url", url, "--sort", "reward")
    assert code == 0, out
    lines = [line for line in out.splitlines() if any(r in line for r in ("base-1", "lr-2", "other-3"))]
    assert [next(r for r in ("base-1", "lr-2", "other-3") if r in line) for line in lines] == ["lr-2", "base-1", "other-3"]
    lr = next(line for line in lines if "lr-2" in line)
    assert "completed" in lr and "0.600" in lr and "0.500" in lr and "exp-a" in lr
    code, out = invoke("runs", "--url", url, "--experiment", "exp-a", "--status", "completed", "--sort", "run_id", "--asc", "--limit", "1")
    assert code == 0 and "base-1" in out and "lr-2" not in out and "other-3" not in out
    code, out = invoke("runs", "--url", url, "--status", "failed")
    assert code == 0 and "other-3" in out and "base-1" not in out
    if PG_PASSWORD in url:
        assert PG_PASSWORD not in out and "***" in out  # the title shows the URL masked


def test_runs_compare_shows_config_differences_and_curves(store):
    url, root = store
    code, out = invoke("runs", "--url", url, "--compare", "base-1", "lr-2", "--root", str(root))
    assert code == 0, out
    assert "trainer.lr" in out and "0.001" in out and "0.002" in out
    assert "loop.steps" not in out  # equal values are not differences
    curve = [line for line in out.splitlines() if "│" in line and line.split("│")[1].strip() == "3"]
    assert curve and "0.300" in curve[0] and "0.600" in curve[0] and "0.250" in curve[0] and "0.500" in curve[0]
    code, out = invoke("runs", "--url", url, "--compare", "base-1", "nope-9")
    assert code == 2 and "nope-9" in out


def test_bad_options_fail_before_the_database_is_opened(tmp_path):
    # The URL names a server that is not there: the option errors come first, exit 2.
    url = f"postgresql+psycopg://u:{PG_PASSWORD}@127.0.0.1:9/none"
    code, out = invoke("runs", "--url", url, "--status", "done")
    assert code == 2 and "--status must be one of running, completed, failed, cancelled, stopped" in out
    code, out = invoke("runs", "--url", url, "--sort", "loss")
    assert code == 2 and "--sort must be one of created" in out
    code, out = invoke("runs", "--url", "mysql://x/y")
    assert code == 2 and "supports sqlite and postgresql" in out
    code, out = invoke("runs", "--url", url)
    assert code == 1 and "cannot open the run registry" in out and PG_PASSWORD not in out and "u:***@" in out


def test_registry_upgrade_and_default_url(tmp_path, monkeypatch):
    state = tmp_path / "st"
    code, out = invoke("registry", "upgrade", "--state-dir", str(state))
    assert code == 0, out
    assert f"sqlite:///{state}/registry.db" in out.replace("\n", "") and "0001_initial" in out
    assert Registry.open(f"sqlite:///{state}/registry.db").runs() == []
    monkeypatch.setenv("RATCHET_REGISTRY_URL", f"sqlite:///{tmp_path}/env.db")
    reg = Registry.open()
    reg.record_run(RunRecord(run_id="env-run"))
    code, out = invoke("runs")
    assert code == 0 and "env-run" in out


def test_config_diff_and_curve_rows():
    assert config_diff({"a": {"b": 1, "c": [1]}, "d": 2}, {"a": {"b": 2, "c": [1]}, "e": 3}) == [
        ("a.b", 1, 2), ("d", 2, config_diff.__globals__["_MISSING"]), ("e", config_diff.__globals__["_MISSING"], 3),
    ]  # fmt: skip
    lines = [{"step": s, "reward_mean": s / 100} for s in range(100)]
    rows = curve_rows([lines, lines[:10]], ["reward_mean"], max_rows=10)
    assert len(rows) == 10 and rows[0] == ["1", "0.000", "0.000"] and rows[-1][0] == "100" and rows[-1][2] == ""
