"""Live hyper-parameters: which keys may change on a running run, how a change is checked
(src/ratchet/config/live_keys.py), and how the workflow holds it (src/ratchet/workflows/live.py)."""

from __future__ import annotations

import math

import pytest

from ratchet.config import ConfigError, RunConfig
from ratchet.config.live_keys import (
    LIVE,
    check_live_changes,
    effective_values,
    live_config,
    parse_assignments,
    refused_keys,
    without,
)
from ratchet.config.resume_keys import may_change
from ratchet.types import RunRef, RunState

BASE = RunConfig.model_validate(
    {"model": {"path": "m"}, "data": {"train_files": "t.jsonl"}, "algorithm": {"kl": {"coef": 0.01}}}
).model_dump(mode="json")


def issues(exc: pytest.ExceptionInfo) -> dict[str, str]:
    return dict(exc.value.issues)


def test_every_live_key_is_a_config_key_a_resume_may_change_too():
    """A live change must survive a resume from its checkpoint: the same key is resumable."""
    cfg = RunConfig.model_validate(BASE)
    for key in LIVE:
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)  # raises for a key the schema does not have
        assert may_change(key), key


def test_every_rule_of_the_key_table_names_config_keys_and_says_why():
    """config/key_rules.py: each row names schema keys (a glob matches at least one), gives
    at least one reason, and a glob is for resumes only (a live change names its key)."""
    from fnmatch import fnmatchcase

    from ratchet.config.key_rules import RULES
    from ratchet.config.resume_keys import flatten

    keys = set(flatten(RunConfig.model_validate(BASE).model_dump(mode="json")))
    assert len({r.key for r in RULES}) == len(RULES), "one row per key"
    for rule in RULES:
        assert rule.live or rule.resume or rule.instead, rule.key
        assert any(fnmatchcase(k, rule.key) for k in keys), f"{rule.key} names no config key"
        if any(c in rule.key for c in "*?["):
            assert rule.live is None and rule.instead is None, rule.key
        assert not (rule.live and rule.instead), f"{rule.key}: live, or refused live with what to do instead"


def test_a_key_that_cannot_change_live_is_refused_naming_it_and_the_allowed_set():
    with pytest.raises(ConfigError) as exc:
        check_live_changes(BASE, {}, {"rollout.temperature": 0.7, "trainer.lr": 1e-5})
    found = issues(exc)
    assert list(found) == ["rollout.temperature"]  # the allowed key is not blamed
    why = found["rollout.temperature"]
    assert "cannot change while the run trains" in why and "temperature it was sampled with" in why and "Fork the run" in why
    assert "Keys that can: trainer.lr, trainer.weight_decay" in why and "algorithm.clip_ratio_high" in why


def test_an_unknown_key_is_refused():
    found = dict(refused_keys(["trainer.lrr", "trainer.world_size"]))
    assert set(found) == {"trainer.lrr", "trainer.world_size"}
    assert "read when the run's workers start" in found["trainer.world_size"]
    assert "Keys that can: trainer.lr" in found["trainer.lrr"]


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("trainer.lr", -1e-5, "must be > 0.0, got -1e-05"),
        ("trainer.lr", 0, "must be > 0.0, got 0"),
        ("trainer.lr", "fast", "expected a number, got 'fast'"),
        ("trainer.lr", True, "expected a number, got true"),
        ("trainer.lr", math.nan, "must be a finite number"),
        ("algorithm.entropy_coeff", -0.1, "must be >= 0"),
        ("algorithm.clip_ratio_c", 1.0, "must be > 1.0, got 1.0"),
        ("trainer.ppo_epochs", 0, "must be >= 1, got 0"),
        ("trainer.ppo_epochs", 1.5, "expected an integer, got 1.5"),
        ("trainer.betas", [0.9, 1.0], "must be < 1.0, got 1.0"),
    ],
)
def test_a_bad_value_is_refused_by_the_config_field(key, value, message):
    with pytest.raises(ConfigError) as exc:
        check_live_changes(BASE, {}, {key: value})
    (path, why), *_ = exc.value.issues
    assert path.startswith(key) and message in why, (path, why)


def test_the_kl_coefficient_is_live_only_with_a_reference_model():
    no_ref = {**BASE, "algorithm": {**BASE["algorithm"], "kl": {**BASE["algorithm"]["kl"], "coef": 0.0}}}
    with pytest.raises(ConfigError) as exc:
        check_live_changes(no_ref, {}, {"algorithm.kl.coef": 0.1})
    assert "no reference model" in issues(exc)["algorithm.kl.coef"]
    assert check_live_changes(BASE, {}, {"algorithm.kl.coef": 0.0}) == {"algorithm.kl.coef": 0.0}


def test_cross_field_rules_see_the_values_set_earlier():
    """kl.target needs kl.coef > 0: with a target, coef 0 is refused (the run's config plus
    the live values already set are validated as a whole)."""
    adaptive = {**BASE, "algorithm": {**BASE["algorithm"], "kl": {**BASE["algorithm"]["kl"], "target": 0.1}}}
    with pytest.raises(ConfigError, match="kl.coef must be > 0 when algorithm.kl.target is set"):
        check_live_changes(adaptive, {}, {"algorithm.kl.coef": 0.0})


def test_good_values_come_back_as_the_fields_hold_them():
    out = check_live_changes(BASE, {"trainer.lr": 3e-4}, {"trainer.lr": "1e-5", "trainer.betas": [0.8, 0.95], "trainer.ppo_epochs": 2})
    assert out == {"trainer.lr": 1e-5, "trainer.betas": [0.8, 0.95], "trainer.ppo_epochs": 2}
    assert isinstance(out["trainer.lr"], float)


def test_nothing_to_change_is_refused():
    with pytest.raises(ConfigError, match="nothing to change"):
        check_live_changes(BASE, {}, {})


def test_assignments_parse_as_yaml_and_malformed_ones_are_named():
    assert parse_assignments(["trainer.lr=1e-5", "trainer.betas=[0.9, 0.95]", "algorithm.entropy_coeff=0.01"]) == {
        "trainer.lr": "1e-5",  # YAML 1.1 reads 1e-5 as text; the float field converts it
        "trainer.betas": [0.9, 0.95],
        "algorithm.entropy_coeff": 0.01,
    }
    with pytest.raises(ConfigError, match="malformed 'trainer.lr': expected key=value"):
        parse_assignments(["trainer.lr"])


def test_effective_values_live_config_and_overrides():
    eff = effective_values(BASE, {"trainer.lr": 1e-5})
    assert eff["trainer.lr"] == 1e-5 and eff["algorithm.entropy_coeff"] == 0.0 and set(eff) == set(LIVE)
    cfg = RunConfig.model_validate(BASE)
    assert live_config(cfg, {}) is cfg
    changed = live_config(cfg, {"trainer.lr": 1e-5, "algorithm.clip_ratio_high": 0.28})
    assert (changed.trainer.lr, changed.algorithm.clip_ratio_high, changed.trainer.grad_clip) == (1e-5, 0.28, cfg.trainer.grad_clip)
    assert cfg.trainer.lr == 1e-4  # the run's own config is left as it is
    assert without({"trainer.lr": 1e-5, "algorithm.entropy_coeff": 0.1}, ["trainer.lr"]) == {"algorithm.entropy_coeff": 0.1}


def test_the_workflow_applies_a_change_at_the_next_boundary_and_marks_that_step():
    from temporalio.exceptions import ApplicationError

    from ratchet.workflows.live import LiveSettings, step_metrics

    live = LiveSettings()
    live.config = BASE
    state = RunState(run=RunRef("r", "/tmp/r"), next_step=3, kl_coef=0.01)
    live.step_running = True  # step 3 is training: a change now applies from step 4
    change = live.accept("r", state, live.check(state, {"trainer.lr": "2e-5", "algorithm.kl.coef": 0.05}, closing=None))
    assert (change.from_step, change.values, change.previous) == (
        4,
        {"trainer.lr": 2e-5, "algorithm.kl.coef": 0.05},
        {"trainer.lr": 1e-4, "algorithm.kl.coef": 0.01},
    )
    assert state.live.values == {} and step_metrics(state, 3) == {}  # step 3 keeps its values
    state.next_step = 4
    live.apply(state)
    assert state.live.values == {"trainer.lr": 2e-5, "algorithm.kl.coef": 0.05} and state.kl_coef == 0.05
    assert (state.live.changes, state.live.last_step) == (1, 4) and live.pending == {}
    assert step_metrics(state, 4) == {"trainer.lr": 2e-5, "algorithm.kl.coef": 0.05, "live_changed": 1.0}
    assert "live_changed" not in step_metrics(state, 5)
    with pytest.raises(ApplicationError, match=r"refused: trainer.lr: must be > 0.0, got -1") as refused:
        live.check(state, {"trainer.lr": -1}, closing=None)
    assert refused.value.type == "LiveParamsRefused" and refused.value.non_retryable
    with pytest.raises(ApplicationError, match="cannot change now: it is finishing"):
        live.check(state, {"trainer.lr": 1e-5}, closing="it is finishing")


def test_the_run_state_carries_live_values_through_its_json_form():
    """Checkpoints hold the run state as Temporal's JSON; an older one has no `live`."""
    import json

    from ratchet.platform.client import read_run_state
    from temporalio.converter import default

    state = RunState(run=RunRef("r", "/tmp/r"))
    state.live.values["trainer.lr"] = 1e-5
    state.live.last_step = 7
    raw = default().payload_converter.to_payloads([state])[0].data
    back = read_run_state(raw)
    assert back.live.values == {"trainer.lr": 1e-5} and back.live.last_step == 7
    old = json.loads(raw)
    del old["live"]
    assert read_run_state(json.dumps(old).encode()).live.values == {}


def test_cli_set_refuses_a_key_before_connecting_and_fork_needs_a_checkpoint():
    from typer.testing import CliRunner

    from ratchet.platform.cli import app

    result = CliRunner().invoke(app, ["set", "run-1", "rollout.temperature=0.5"])
    assert result.exit_code == 2
    assert "rollout.temperature: cannot change while the run trains" in result.output and "Keys that can: trainer.lr" in result.output
    result = CliRunner().invoke(app, ["set", "run-1", "trainer.lr"])
    assert result.exit_code == 2 and "malformed 'trainer.lr': expected key=value" in result.output
    result = CliRunner().invoke(app, ["fork", "run-1", "trainer.lr=1e-5"])
    assert result.exit_code == 2 and "--checkpoint" in result.output
