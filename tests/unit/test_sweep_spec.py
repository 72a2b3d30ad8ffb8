"""Sweep specs: validation (each error names the field and the fix), grid and random
points, the early-stopping rules, and Optuna's idempotent ask by trial index."""

from __future__ import annotations

import math

import pytest

from ratchet.activities.sweep_trials import ask, optuna_url, rung_value
from ratchet.config.sweep_search import axis, grid_points, random_point
from ratchet.config.sweep_spec import ParamSpace, SweepSpecError, apply_params, compile_sweep, load_sweep_spec, trial_params
from ratchet.workflows.early_stopping import asha_stops, best_index, median, median_stops, should_stop


@pytest.fixture(scope="module")
def base(assets):
    train, evals = assets.data["copy"]
    return {"model": {"path": str(assets.model)}, "data": {"train_files": str(train), "eval_files": str(evals)}, "loop": {"steps": 8}}


def spec(base, **kw):
    raw = {"base": base, "space": {"trainer.lr": {"low": 1e-4, "high": 1e-2, "log": True}}, "search": "random", "trials": 4, **kw}
    return load_sweep_spec(raw)[0]


def issues(excinfo) -> dict[str, str]:
    return dict(excinfo.value.issues)


# -- the space ------------------------------------------------------------------------------


def test_grid_axes_and_order():
    assert axis(ParamSpace(low=1, high=4)) == [1, 2, 3, 4]  # an int range: every int
    assert axis(ParamSpace(low=0.0, high=1.0, num=3)) == [0.0, 0.5, 1.0]
    log = axis(ParamSpace(low=1e-4, high=1e-2, log=True, num=3))
    assert log[0] == 1e-4 and log[2] == 1e-2 and math.isclose(log[1], 1e-3)
    space = {"a": ParamSpace(values=[1, 2]), "b": ParamSpace(values=["x", "y", "z"])}
    points = grid_points(space)
    assert len(points) == 6 and points[0] == {"a": 1, "b": "x"} and points[1] == {"a": 1, "b": "y"} and points[5] == {"a": 2, "b": "z"}


def test_random_points_are_seeded_per_trial_and_in_range():
    space = {"lr": ParamSpace(low=1e-4, high=1e-2, log=True), "n": ParamSpace(low=2, high=8), "c": ParamSpace(values=[0.0, 0.1])}
    draws = [random_point(space, 7, k) for k in range(200)]
    assert draws[3] == random_point(space, 7, 3)  # trial 3 alone: the same values
    assert draws[3] != random_point(space, 8, 3)
    assert all(1e-4 <= d["lr"] <= 1e-2 and 2 <= d["n"] <= 8 and isinstance(d["n"], int) for d in draws)
    # Log-uniform: about half the draws below the geometric middle (1e-3).
    below = sum(d["lr"] < 1e-3 for d in draws) / len(draws)
    assert 0.35 < below < 0.65, below
    assert {d["n"] for d in draws} == set(range(2, 9)) and {d["c"] for d in draws} == {0.0, 0.1}


def test_grid_spec_runs_the_whole_grid(base):
    s = spec(base, search="grid", trials=None, space={"trainer.lr": {"low": 1e-3, "high": 1e-2, "num": 2}, "rollout.n": [2, 4, 8]})
    assert s.num_trials == 6
    assert trial_params(s, 5) == {"trainer.lr": 1e-2, "rollout.n": 8}
    compiled = compile_sweep(s)
    assert [p["rollout.n"] for p in compiled.params] == [2, 4, 8, 2, 4, 8]


def test_apply_params_sets_dotted_keys():
    out = apply_params({"trainer": {"lr": 1.0}, "seed": 0}, {"trainer.lr": 2.0, "algorithm.kl.coef": 0.1})
    assert out == {"trainer": {"lr": 2.0}, "seed": 0, "algorithm": {"kl": {"coef": 0.1}}}


# -- validation: every error names the field and the fix -------------------------------------


@pytest.mark.parametrize(
    "change, field, words",
    [
        ({"space": {"trainer.lrr": [1e-3]}}, "space", "did you mean trainer.lr"),
        ({"space": {"trainer": [1]}}, "space", "is a section"),
        ({"space": {"trainer.lr": {"low": 1e-2, "high": 1e-3}}}, "space.trainer.lr", "must be below high"),
        ({"space": {"trainer.lr": {"low": 0.0, "high": 1e-3, "log": True}}}, "space.trainer.lr", "needs low > 0"),
        ({"space": {"trainer.lr": []}}, "space.trainer.lr", "at least one choice"),
        ({"search": "grid", "trials": None}, "(spec)", "needs num"),
        ({"search": "grid", "trials": 9, "space": {"rollout.n": [2, 4]}}, "(spec)", "exceeds the grid size (2)"),
        ({"trials": None}, "(spec)", "needs trials"),
        ({"early_stopping": {"rule": "asha"}}, "early_stopping", "needs rungs"),
        ({"early_stopping": {"rule": "median", "rungs": [4, 2]}}, "early_stopping.rungs", "ascending"),
        ({"parallelism": 0}, "parallelism", "greater than or equal to 1"),
        ({"serach": "grid"}, "serach", "unknown key"),
    ],
)
def test_bad_spec_names_field_and_fix(base, change, field, words):
    with pytest.raises(SweepSpecError) as excinfo:
        spec(base, **change)
    found = issues(excinfo)
    assert field in found, found
    assert words in found[field], found


def test_a_space_value_that_makes_an_invalid_config_is_refused_with_its_trial(base):
    s = spec(base, search="grid", trials=None, space={"rollout.n": [4, 0]})
    with pytest.raises(SweepSpecError) as excinfo:
        compile_sweep(s)
    found = issues(excinfo)
    assert list(found) == ["trial 1: rollout.n"], found  # trial 0 (n=4) is fine
    assert "rollout.n=0" in found["trial 1: rollout.n"] and "narrow space" in found["trial 1: rollout.n"]
    # TPE: every choice and each range bound is checked on the base.
    s = spec(base, search="tpe", space={"trainer.micro_batch_size": {"low": 0, "high": 8}})
    with pytest.raises(SweepSpecError) as excinfo:
        compile_sweep(s)
    assert list(issues(excinfo)) == ["space value trainer.micro_batch_size=0: trainer.micro_batch_size"]


def test_rungs_and_objective_are_checked_against_the_base(base):
    s = spec(base, early_stopping={"rule": "asha", "rungs": [4, 8]})
    with pytest.raises(SweepSpecError) as excinfo:
        compile_sweep(s)
    assert "not below loop.steps (8)" in issues(excinfo)["early_stopping.rungs"]
    no_eval = {**base, "data": {"train_files": base["data"]["train_files"]}}
    with pytest.raises(SweepSpecError) as excinfo:
        compile_sweep(spec(no_eval))
    assert "data.eval_files" in issues(excinfo)["objective.metric"]
    assert compile_sweep(spec(no_eval, objective={"metric": "reward_mean", "last_k": 3})).base.data.eval_files is None


def test_bad_base_is_reported_under_base(base):
    with pytest.raises(SweepSpecError) as excinfo:
        compile_sweep(spec({**base, "trainer": {"lr": -1}}))
    assert "base: trainer.lr" in issues(excinfo)


# -- early stopping and the best trial ---------------------------------------------------------


def test_median_rule():
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([1.0, 2.0, 3.0, 4.0]) == 2.5
    assert median_stops(0.1, [0.2, 0.3]) is True  # below the others' median 0.25
    assert median_stops(0.3, [0.2, 0.3]) is False
    assert median_stops(0.1, []) is False  # the first at a rung always goes on
    assert median_stops(0.1, [0.5], min_trials=2) is False
    assert median_stops(0.4, [0.2, 0.3], direction="min") is True  # a loss: higher is worse


def test_asha_rule_keeps_the_top_1_over_eta():
    assert asha_stops(0.1, [], eta=2) is False  # alone: top 1 of 1
    assert asha_stops(0.1, [0.5], eta=2) is True  # keep 1 of 2: 0.5 is better
    assert asha_stops(0.6, [0.5], eta=2) is False
    assert asha_stops(0.5, [0.9, 0.1, 0.2], eta=2) is False  # keep 2 of 4: second best
    assert asha_stops(0.2, [0.9, 0.1, 0.5], eta=2) is True
    assert asha_stops(0.5, [0.9, 0.1, 0.2], eta=3) is True  # keep 1 of 4
    assert asha_stops(0.5, [0.5], eta=2) is False  # a tie favours the trial judged
    assert should_stop("none", 0.0, [1.0]) is False
    assert should_stop("asha", 0.0, [1.0], eta=2) is True


def test_best_index():
    assert best_index({0: 0.2, 1: 0.7, 2: 0.7}) == 1  # the lower index on a tie
    assert best_index({0: 0.2, 1: 0.7}, "min") == 0
    assert best_index({}) is None


def test_rung_value_is_the_mean_over_the_window():
    lines = [{"step": s, "reward_mean": r} for s, r in enumerate([0.1, 0.2, 0.3, 0.4])]
    assert rung_value(lines, 2, "reward_mean", 1) == pytest.approx(0.2)
    assert rung_value(lines, 4, "reward_mean", 3) == pytest.approx(0.3)
    assert rung_value(lines, 2, "missing", 1) is None


# -- Optuna: one ask per trial index ---------------------------------------------------------


def test_optuna_ask_is_idempotent_by_trial_index(base, tmp_path, monkeypatch):
    monkeypatch.setenv("RATCHET_REGISTRY_URL", f"sqlite:///{tmp_path}/registry.db")
    assert optuna_url(f"sqlite:///{tmp_path}/registry.db") == f"sqlite:///{tmp_path}/registry-optuna.db"
    s = spec(base, search="tpe", trials=6, space={"trainer.lr": {"low": 1e-4, "high": 1e-2, "log": True}, "rollout.n": [2, 4]})
    first = [ask(s, "sw-1", k) for k in range(3)]
    assert [ask(s, "sw-1", k) for k in (2, 0, 1)] == [first[2], first[0], first[1]]  # asked again: the same values
    assert len({round(p["trainer.lr"], 12) for p in first}) == 3
    import optuna

    study = optuna.load_study(study_name="sw-1", storage=optuna_url(f"sqlite:///{tmp_path}/registry.db"))
    assert sorted(t.user_attrs["trial_index"] for t in study.trials) == [0, 1, 2]  # no trial asked twice
    r = spec(base, trials=3)  # random: Optuna keeps the seed's values
    assert ask(r, "sw-2", 1) == trial_params(r, 1)


def test_cli_refuses_a_bad_spec_before_connecting(base, tmp_path):
    """`ratchet sweep` validates the spec and its trials first: no Temporal server is needed
    to be told what is wrong (none runs here)."""
    import yaml
    from typer.testing import CliRunner

    from ratchet.platform.cli import app

    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": base, "space": {"rollout.n": [2, -1]}, "search": "grid"}))
    out = CliRunner().invoke(app, ["sweep", str(path)])
    assert out.exit_code == 2, out.output
    assert "invalid sweep spec" in out.output and "trial 1: rollout.n" in out.output


def test_trial_rungs_waits_for_a_new_rung(tmp_path):
    """The watch activity reports at once when a trial is past a rung it has not reported,
    and otherwise returns empty-handed after its wait (heartbeating meanwhile)."""
    import json

    from temporalio.testing import ActivityEnvironment

    from ratchet.activities.sweep_trials import trial_rungs
    from ratchet.sweep_types import RungInput, TrialWatch

    run = tmp_path / "sw-t0"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "kl": 0.1 * s}) + "\n" for s in range(3)))
    env = ActivityEnvironment()
    beats = []
    env.on_heartbeat = lambda *details: beats.append(details)
    watch = lambda seen: RungInput([TrialWatch(0, "sw-t0", str(tmp_path), seen)], [2, 4], "kl", 1, poll_seconds=0.05, max_wait_seconds=0.2)  # noqa: E731
    [report] = env.run(trial_rungs, watch(0))
    assert report.steps == 3 and report.values == [pytest.approx(0.1)] and not beats  # rung 2: step 1's kl
    [report] = env.run(trial_rungs, watch(1))  # rung 4 not reached: waits, then nothing new
    assert report.steps == 3 and report.values == [] and len(beats) >= 3


def test_sweep_display_shows_progress_and_the_best_trial():
    """`ratchet sweep`'s display: the bar follows finished trials, the table marks the best."""
    import io

    from rich.console import Console

    from ratchet.platform.sweeps_view import summary_view, watch_sweep
    from ratchet.sweep_types import SweepProgress, SweepSummary, TrialResult

    t0 = TrialResult(0, "sw-t0", "completed", {"trainer.lr": 1e-3}, objective=0.5, steps=6)
    t1 = TrialResult(1, "sw-t1", "pruned", {"trainer.lr": 3e-4}, objective=0.1, steps=3, pruned_at=2)
    summary = SweepSummary("sw", "completed", [t0, t1], best=t0)

    class Handle:  # what watch_sweep reads of a SweepHandle
        sweep_id = "sw"

        def follow(self, every):
            yield SweepProgress("sw", "running", 2, 2, running=[0, 1])
            yield SweepProgress("sw", "running", 2, 2, running=[0], finished=[t1])

        def result(self):
            return summary

    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=False)
    assert watch_sweep(Handle(), console, every=0) is summary
    console.print(summary_view(summary))
    text = out.getvalue()
    assert "1/2" in text and "pruned 1" in text
    assert "best: trial 0 (sw-t0) objective 0.5000 with trainer.lr=0.001" in text
    assert "0 best" in text and "pruned" in text
