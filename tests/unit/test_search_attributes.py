"""The Temporal UI's labels of a run: search attributes, summaries, details, and the
checks on a run query. Pure functions; no server."""

from __future__ import annotations

import math

import pytest

from ratchet.platform.search import InvalidQuery, check_query, full_query
from ratchet.types import RunLineage, StepRecord, RunRef, RolloutInput, SyncInput, CheckpointInput, EvalInput, RunState
from ratchet.workflows import search_attributes as sa

CONFIG = {
    "seed": 3,
    "model": {"path": "/data/models/SmolLM2-135M-Instruct/"},
    "algorithm": {"adv_estimator": "rloo", "policy_loss": "ppo_clip", "kl": {"coef": 0.001}},
    "loop": {"mode": "fully_async", "steps": 40, "prompts_per_step": 16},
    "rollout": {"n": 8},
    "trainer": {"lr": 0.0003},
    "tracking": {"experiment": "copy-lr", "name": "r", "tags": ["demo"]},
    "storage": {"root": "s3://bucket/runs"},
}


def _attrs(typed) -> dict:
    return {p.key.name: p.value for p in typed}


def test_initial_attributes_say_what_the_run_is():
    attrs = _attrs(
        sa.initial_attributes(CONFIG, RunLineage(parent_run_id="base-1", parent_checkpoint="step-20", sweep_id="sw", trial_index=2))
    )
    assert attrs == {
        "ratchet_experiment": "copy-lr", "ratchet_algorithm": "rloo", "ratchet_loop_mode": "fully_async",
        "ratchet_model": "SmolLM2-135M-Instruct", "ratchet_step": 0, "ratchet_status": "running",
        "ratchet_sweep": "sw", "ratchet_parent": "base-1",
    }  # fmt: skip
    plain = _attrs(sa.initial_attributes(CONFIG))
    assert "ratchet_sweep" not in plain and "ratchet_parent" not in plain
    assert _attrs(sa.resumed_attributes(CONFIG, None, 20))["ratchet_step"] == 20


def test_keyword_values_are_cut_not_refused():
    attrs = _attrs(sa.initial_attributes({**CONFIG, "tracking": {"experiment": "x" * 500}}))
    assert attrs["ratchet_experiment"] == "x" * 200


def test_summary_and_details():
    lineage = RunLineage(parent_run_id="base-1", parent_checkpoint="step-20")
    assert sa.static_summary("r1", CONFIG, lineage) == (
        "RLOO on SmolLM2-135M-Instruct · 40 steps, fully_async loop · experiment copy-lr · fork of base-1 at step-20"
    )
    details = sa.static_details("r1", CONFIG, lineage).splitlines()
    assert details[0] == "**ratchet run** `r1`"
    assert "- experiment: `copy-lr`, tags: demo" in details
    assert "- learning rate: `0.0003`" in details and "- samples per prompt: `8`" in details and "- KL: `0.001`" in details
    assert "- forked from: `base-1` at `step-20`" in details and "- seed: `3`" in details
    assert "- deterministic: `true`" in sa.static_details("r1", {**CONFIG, "deterministic": True}).splitlines()
    assert not any("s3://" in line for line in details)  # only the model's path is shown


def test_progress_updates_skip_unknown_and_nan():
    ups = sa.progress_updates(step=5, reward=0.25, eval_reward=math.nan, status=None)
    assert [(u.key.name, u.value) for u in ups] == [("ratchet_step", 5), ("ratchet_reward", 0.25)]
    assert [(u.key.name, u.value) for u in sa.progress_updates(status="paused")] == [("ratchet_status", "paused")]


def test_current_details():
    text = sa.current_details(phase="running", step=12, total_steps=40, policy_version=12, reward=0.4321, eval_reward=None)
    assert text == "**running** · step 12/40 · policy v12 · reward 0.432"


def test_activity_summaries():
    run = RunRef("r", "/runs/r")
    assert sa.activity_summary("generate", RolloutInput(run, 12, 0, 4, 11), 12) == "generate batch 12 with v11"
    assert sa.activity_summary("generate", RolloutInput(run, 12, 0, 4, 11, part=1), 12) == "generate batch 12 with v11 (round 2)"
    assert sa.activity_summary("sync_weights", SyncInput(run, 12), 12) == "sync weights v12"
    assert sa.activity_summary("checkpoint", CheckpointInput(run, 20, 20, RunState(run=run)), 20) == "checkpoint step 20"
    assert sa.activity_summary("evaluate", EvalInput(run, 20, 20), 20) == "evaluate step 20"
    assert sa.activity_summary("step", object(), 12) == "step 12 (generate, score, train, sync)"
    assert sa.activity_summary("record_step", StepRecord(run, 7, {}), 7) == "record metrics of step 7"
    assert sa.activity_summary("no_such_phase", None, 0) == "no_such_phase"
    # A missing field reads as "?", never an error: a label must not break a run.
    assert sa.activity_summary("score", object(), 3) == "score batch ?"


def test_registration_flags_and_missing():
    flags = sa.dev_server_flags()
    assert flags[:2] == ["--search-attribute", "ratchet_experiment=Keyword"]
    assert "ratchet_step=Int" in flags and "ratchet_reward=Double" in flags and len(flags) == 2 * len(sa.ALL_KEYS)
    full = {k.name: int(k.indexed_value_type) for k in sa.ALL_KEYS}
    assert sa.missing_from(full) == []
    wrong = {**full, "ratchet_step": full["ratchet_experiment"]}  # a Keyword where an Int belongs
    assert sa.missing_from(wrong) == ["ratchet_step"]
    assert sa.create_commands("prod")[5] == "temporal operator search-attribute create --namespace prod --name ratchet_step --type Int"


@pytest.mark.parametrize(
    "where, why",
    [
        ("", "it is empty"),
        ("ratchet_rewards > 0.3", "'ratchet_rewards' is not one of ratchet's search attributes"),
        ("reward > 0.3", "did you mean 'ratchet_reward'?"),
        ("ratchet_status = running", "'running' is not a search attribute"),
        ("(ratchet_step > 3", "parentheses"),
        ("ratchet_status = 'running", "quote is not closed"),
        ("ratchet_step > 1; drop", "';'"),
    ],
)
def test_bad_queries_are_refused_naming_the_attributes(where, why):
    with pytest.raises(InvalidQuery) as err:
        check_query(where)
    assert why in str(err.value) and "ratchet_eval_reward (Double)" in str(err.value)


def test_good_queries_pass_and_are_limited_to_training_runs():
    assert check_query(" ratchet_reward > 0.3 AND ratchet_status = 'running' ") == "ratchet_reward > 0.3 AND ratchet_status = 'running'"
    check_query("ratchet_experiment = \"a b\" AND StartTime > '2026-01-01T00:00:00Z' AND ratchet_step BETWEEN 1 AND 1e3")
    check_query("ratchet_model STARTS_WITH 'Smol' AND ratchet_sweep IN ('a', 'b') AND ratchet_parent IS NULL")
    assert full_query("ratchet_step >= 2") == "WorkflowType = 'TrainingWorkflow' AND (ratchet_step >= 2)"
    assert full_query("ratchet_step >= 2 ORDER BY StartTime DESC") == (
        "WorkflowType = 'TrainingWorkflow' AND (ratchet_step >= 2) ORDER BY StartTime DESC"
    )
    assert full_query("ratchet_status = 'order by'") == "WorkflowType = 'TrainingWorkflow' AND (ratchet_status = 'order by')"


@pytest.mark.slow
def test_ratchet_runs_refuses_a_bad_where_before_connecting(tmp_path):
    """Exit 2 and the attribute list; no registry is opened and no server is asked."""
    from typer.testing import CliRunner

    from ratchet.platform.cli import app

    out = CliRunner().invoke(
        app, ["runs", "--where", "reward > 0.3", "--state-dir", str(tmp_path)], env={"RATCHET_TEMPORAL_ADDRESS": "127.0.0.1:1"}
    )
    assert out.exit_code == 2, out.output
    text = out.output + (out.stderr if out.stderr_bytes is not None else "")
    assert "did you mean 'ratchet_reward'?" in text and "ratchet_eval_reward (Double)" in text
    assert list(tmp_path.iterdir()) == []  # the registry's database was not created
