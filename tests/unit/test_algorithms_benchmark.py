"""benchmarks/algorithms.py runs every registered advantage estimator, policy loss and
off-policy mode: two steps each (tiny batches), one table with a row per recipe, none failed."""

from __future__ import annotations

import json

import pytest

from ratchet.algorithms import ADV_ESTIMATORS, OFF_POLICY, POLICY_LOSSES

from ..benchmark_scripts import load_benchmark

bench = load_benchmark("algorithms", "algorithms_benchmark")

TINY = [
    "--steps", "2",
    "--set", "warmup.steps=2", "--set", "loop.prompts_per_step=2", "--set", "rollout.n=2", "--set", "data.eval_size=4",
]  # fmt: skip


def test_catalog_recipes_cover_every_registered_name():
    recipes = bench.catalog_recipes()
    expected = [f"adv:{n}" for n in ADV_ESTIMATORS.names()] + [f"loss:{n}" for n in POLICY_LOSSES.names()]
    expected += [f"off_policy:{n}" for n in OFF_POLICY.names()]
    assert list(recipes) == expected
    assert recipes["adv:gae"] == bench.RECIPES["gae (PPO + critic)"]  # the recommended critic keys
    for name in ADV_ESTIMATORS.names():
        assert f"algorithm.adv_estimator={name}" in recipes[f"adv:{name}"]
        has_critic_keys = any(k.startswith("critic.") for k in recipes[f"adv:{name}"])
        assert has_critic_keys == ADV_ESTIMATORS.get(name).needs_critic, name


def test_unknown_recipe_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--recipes", "grpo,nope", *TINY])
    assert "unknown recipe(s) nope" in capsys.readouterr().err


@pytest.mark.slow
def test_all_recipes_run_two_steps_into_one_table(capsys, tmp_path):
    out_json = tmp_path / "rows.json"
    rows = bench.main(["--all", *TINY, "--recipe", "mine: algorithm.adv_estimator=rloo", "--json", str(out_json)])
    expected = [*bench.catalog_recipes(), "mine"]
    assert [r.recipe for r in rows] == expected
    assert {r.recipe: r.error for r in rows if r.error} == {}
    for r in rows:
        assert len(r.rewards) == len(bench.marks(2)) == 3 and len(r.evals) == 1
        assert all(0.0 <= x <= 1.0 for x in [*r.rewards, *r.evals]), r
    out = capsys.readouterr().out
    table = out[out.index("copy task, 2 steps") :]
    for name in expected:
        assert f"│ {name} " in table, name
    assert [r["recipe"] for r in json.loads(out_json.read_text())] == expected
