"""MLflow as the activities drive it (activities/tracking_calls.py), read back from the
real MLflow store: metrics per step, params, tags, the summary; one MLflow run per
ratchet run, continued by a later process; a retried step adds no point; a tracker that
is down never fails a step and leaks no secret."""

from __future__ import annotations

import json
import logging

import pytest

from ratchet import types as t
from ratchet.activities import tracking_calls
from ratchet.config import ConfigError, load_config
from ratchet.platform.services import free_ports
from ratchet.tracking import TRACKING_KEY, redact
from ratchet.tracking.uris import default_mlflow_uri

from .conftest import make_run, step_metrics


def _mlflow_run(state, run_id: str, experiment: str = "tracking-tests"):
    from mlflow import MlflowClient  # here, not at collection: 1.5 CPU-s in each test process

    client = MlflowClient(tracking_uri=default_mlflow_uri(state))
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r}"
    found = client.search_runs([exp.experiment_id], filter_string=f"tags.`ratchet.run_id` = '{run_id}'")
    assert len(found) == 1, f"{len(found)} MLflow runs for {run_id}; want exactly one"
    return client, found[0]


def _history(client, mlflow_run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(mlflow_run_id, key))


def test_steps_params_lineage_and_summary(state, tmp_path, process):
    run = make_run(tmp_path)
    lineage = t.RunLineage(sweep_id="sweep-1", trial_index=3)
    tracking_calls.run_prepared(t.PrepareInput(run.ref.run_id, run.config, lineage), run.ref.run_uri, run.config)
    for step in range(5):
        tracking_calls.step_recorded(run.record(step, step_metrics(step)))
    # A retried record_step (same step, same line): no second point.
    tracking_calls.step_recorded(run.record(4, step_metrics(4)))
    tracking_calls.run_finished(t.FinishInput(run.ref, policy_version=5))  # waits for the tracking thread

    client, found = _mlflow_run(state, run.ref.run_id)
    history = _history(client, found.info.run_id, "reward_mean")
    assert [s for s, _ in history] == [0, 1, 2, 3, 4]
    assert [v for _, v in history] == pytest.approx([0.1 + 0.01 * s for s in range(5)])
    assert [s for s, _ in _history(client, found.info.run_id, "off_policy/is_weight_mean")] == [0, 1, 2, 3, 4]
    assert found.data.params["trainer.lr"] == "1e-05"
    assert found.data.params["algorithm.adv_estimator"] == "grpo"
    assert found.data.params["tracking.experiment"] == "tracking-tests"
    tags = found.data.tags
    assert (tags["ratchet.sweep_id"], tags["ratchet.trial_index"]) == ("sweep-1", "3")
    assert tags["mlflow.runName"] == run.ref.run_id and tags["ratchet.tag.smoke"] == "true"
    assert found.info.status == "FINISHED"
    assert found.data.metrics["summary/steps"] == 5
    assert found.data.metrics["summary/reward_last10"] == pytest.approx(sum(0.1 + 0.01 * s for s in range(5)) / 5)
    saved = json.loads((tmp_path / "runs" / run.ref.run_id / TRACKING_KEY).read_text())
    assert saved["mlflow"]["run_id"] == found.info.run_id
    assert saved["lineage"]["sweep_id"] == "sweep-1"
    # The wall-clock axis is the metrics line's own time.
    line3 = run.store.get_bytes("metrics.jsonl").decode().splitlines()[3]
    (point3,) = [m for m in client.get_metric_history(found.info.run_id, "reward_mean") if m.step == 3]
    assert abs(point3.timestamp / 1000 - json.loads(line3)["time_unix"]) < 5


def test_a_later_process_continues_the_same_run(state, tmp_path, process):
    run = make_run(tmp_path, "copy-20261201-000000-cont")
    prep = t.PrepareInput(run.ref.run_id, run.config)
    tracking_calls.run_prepared(prep, run.ref.run_uri, run.config)
    for step in range(3):
        tracking_calls.step_recorded(run.record(step, step_metrics(step)))
    process.flush()
    # The worker dies. Steps 3 and 4 reach metrics.jsonl (another worker's record_step)
    # while no tracker hears of them; then the run is resumed with a new lr in a new
    # worker process, which retries step 4 and goes on.
    process.new()
    for step in (3, 4):
        run.record(step, step_metrics(step))
    resumed = {**run.config, "trainer": {**run.config["trainer"], "lr": 2e-5}}
    tracking_calls.run_prepared(t.PrepareInput(run.ref.run_id, resumed), run.ref.run_uri, resumed)
    tracking_calls.step_recorded(run.record(4, step_metrics(4)))
    tracking_calls.step_recorded(run.record(5, step_metrics(5)))
    tracking_calls.run_finished(t.FinishInput(run.ref, policy_version=6))

    client, found = _mlflow_run(state, run.ref.run_id)  # exactly one MLflow run
    assert [s for s, _ in _history(client, found.info.run_id, "reward_mean")] == [0, 1, 2, 3, 4, 5]
    assert found.data.params["trainer.lr"] == "1e-05"  # MLflow params never change...
    assert found.data.tags["param_changed.trainer.lr"] == "2e-05"  # ...the resume's value is a tag
    assert found.info.status == "FINISHED"


def test_a_run_that_ends_without_finishing_is_marked_failed(state, tmp_path, process):
    run = make_run(tmp_path, "copy-20261201-000000-fail")
    tracking_calls.run_prepared(t.PrepareInput(run.ref.run_id, run.config), run.ref.run_uri, run.config)
    tracking_calls.step_recorded(run.record(0, step_metrics(0)))
    tracking_calls.run_released(t.ReleaseInput(run.ref.run_id))  # release_run: failed or cancelled
    process.flush()
    client, found = _mlflow_run(state, run.ref.run_id)
    assert found.info.status == "FAILED"
    assert [s for s, _ in _history(client, found.info.run_id, "reward_mean")] == [0]
    assert process.dispatcher.peek(run.ref.run_id) is None  # closed in this process


def test_a_tracker_that_is_down_never_fails_a_step_and_leaks_no_secret(state, tmp_path, process, monkeypatch, caplog):
    (port,) = free_ports(1)  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://ratchet:s3cret-pw@127.0.0.1:{port}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    run = make_run(tmp_path)
    caplog.set_level(logging.WARNING)
    tracking_calls.run_prepared(t.PrepareInput(run.ref.run_id, run.config), run.ref.run_uri, run.config)
    for step in range(3):
        tracking_calls.step_recorded(run.record(step, step_metrics(step)))  # returns; never raises
    tracking_calls.run_finished(t.FinishInput(run.ref, policy_version=3))
    warnings = [r.getMessage() for r in caplog.records if "mlflow tracker failed" in r.getMessage()]
    assert warnings, "the failure is not reported"
    assert "metrics.jsonl has every step" in warnings[0]
    assert not any("s3cret-pw" in r.getMessage() for r in caplog.records)
    assert [json.loads(line)["step"] for line in run.store.get_bytes("metrics.jsonl").decode().splitlines()] == [0, 1, 2]


def test_tracking_off_opens_nothing(state, tmp_path, process, monkeypatch):
    state = tmp_path / "state-of-its-own"
    monkeypatch.setenv("RATCHET_STATE_DIR", str(state))
    monkeypatch.setenv("RATCHET_TRACKING", "0")
    run = make_run(tmp_path)
    tracking_calls.run_prepared(t.PrepareInput(run.ref.run_id, run.config), run.ref.run_uri, run.config)
    tracking_calls.step_recorded(run.record(0, step_metrics(0)))
    process.flush()
    assert not (state / "mlflow.db").exists()
    assert not run.store.exists(TRACKING_KEY)


def test_redact_hides_credentials():
    assert redact("http://u:pw@host:5000/x") == "http://***@host:5000/x"
    assert redact("postgresql+psycopg://me:secret@db/mlflow?password=x&sslmode=require") == (
        "postgresql+psycopg://***@db/mlflow?password=***&sslmode=require"
    )
    assert redact("sqlite:////tmp/a/mlflow.db") == "sqlite:////tmp/a/mlflow.db"


@pytest.mark.parametrize(
    "override, field, says",
    [
        ("tracking.wandb.mode=onlin", "tracking.wandb.mode", "offline, online"),
        ("tracking.mlflow_uri=ftp://host/x", "tracking.mlflow_uri", "not an MLflow store scheme"),
        ("tracking.mlflow_uri=http://me:pw@host:5000", "tracking.mlflow_uri", "credentials come from the environment"),
        ("tracking.wandb.enabled=maybe", "tracking.wandb.enabled", "true/false"),
        ("tracking.wandb.colour=red", "tracking.wandb.colour", "valid keys of tracking.wandb: dir, enabled, entity, mode, project"),
    ],
)
def test_bad_tracking_config_names_the_field(override, field, says):
    with pytest.raises(ConfigError) as caught:
        load_config("examples/copy_grpo.yaml", [override, "model.path=/m", "data.train_files=/d"])
    text = str(caught.value)
    assert field in text and says in text, text
    assert "pw@" not in text


@pytest.mark.slow
def test_a_new_store_is_copied_from_the_schema_template_and_equals_a_built_one(tmp_path, monkeypatch):
    """The schema is built once per MLflow version into the user's cache; every later store
    is a copy that differs from a store MLflow builds in place only by the Default
    experiment's artifact folder (its own) and times; MLflow opens and writes it."""
    import sqlite3

    from ratchet.tracking import mlflow_tracker

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first, second, built = tmp_path / "a" / "mlflow.db", tmp_path / "b" / "mlflow.db", tmp_path / "c" / "mlflow.db"
    mlflow_tracker.create_sqlite_store(first)
    templates = list((tmp_path / "cache" / "ratchet").glob("mlflow-*-schema.db"))
    assert len(templates) == 1, templates
    mlflow_tracker.create_sqlite_store(second)
    mlflow_tracker._build_store(built, built.parent / "mlflow-artifacts")

    def rows(path):
        with sqlite3.connect(path) as db:
            tables = [n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name != 'experiments'")]
            return {n: sorted(db.execute(f"SELECT * FROM {n}").fetchall()) for n in tables}

    assert rows(second) == rows(built) and len(rows(built)) > 20
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{second}")
    assert client.get_experiment("0").artifact_location == f"{(second.parent / 'mlflow-artifacts').as_uri()}/0"
    exp = client.create_experiment("copied")
    client.log_metric(client.create_run(exp).info.run_id, "x", 1.0)
    assert not list(tmp_path.glob("*/.mlflow.db.tmp-*")), "no temporary file is left"
