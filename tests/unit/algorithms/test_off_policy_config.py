"""`algorithm.off_policy.{is_weights,rejection}` in the config: the example recipe, override
lines as users (and the e2e tests) write them, the old keys unchanged, errors naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from ratchet.config import ConfigError, config_to_yaml, load_config

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "examples" / "copy_grpo.yaml"  # the demo recipe (RECIPE_PATH) the benchmark and the e2e tests start from

ICEPOP = ["loop.mode=one_step_off", "algorithm.off_policy.is_weights={kind: icepop, low: 0.5, high: 5.0}"]
SEQ_TIS_K3 = [
    "algorithm.off_policy.is_weights={level: sequence, low: 0.5, high: 2.0, batch_normalize: true}",
    "algorithm.off_policy.rejection=[{statistic: k3, level: seq_sum, high: 1.0}]",
]
DECOUPLED_TWO = [
    "algorithm.off_policy.mode=decoupled",
    "algorithm.off_policy.rejection=[{statistic: ratio, level: token, low: 0.5, high: 4.0}, {statistic: k2, level: seq_max, high: 1.0}]",
]

REJECTION_MODE_PLUS = [
    "algorithm.off_policy.mode=rejection",
    "algorithm.off_policy.level=geometric",
    "algorithm.off_policy.cap=1.5",
    "algorithm.off_policy.is_weights={low: 0.8, high: 1.5}",
    "algorithm.off_policy.rejection=[{statistic: k2, level: token, high: 2.0}]",
]
BENCHMARK = [
    "algorithm.off_policy.is_weights={kind: icepop, low: 0.5, high: 5.0}",
    "algorithm.off_policy.rejection=[{statistic: k3, level: seq_mean, high: 0.1}]",
]


def off_policy(overrides, path=RECIPE):
    return load_config(path, overrides, check_files=False).algorithm.off_policy


def test_example_recipe_validates():
    cfg = load_config(ROOT / "examples" / "copy_grpo_rollout_correction.yaml", check_files=False)
    op = cfg.algorithm.off_policy
    assert cfg.loop.mode == "one_step_off" and op.mode == "none"
    assert (op.is_weights.kind, op.is_weights.low, op.is_weights.high) == ("icepop", 0.5, 5.0)
    assert [(c.statistic, c.level, c.low, c.high) for c in op.rejection] == [("k3", "seq_mean", None, 0.1), ("ratio", "token", 0.2, 10.0)]


def test_override_lines_parse():
    op = off_policy(ICEPOP)
    assert op.is_weights.model_dump() == {"level": "token", "kind": "icepop", "low": 0.5, "high": 5.0, "batch_normalize": False}
    assert op.rejection == []
    op = off_policy(SEQ_TIS_K3)
    assert op.is_weights.level == "sequence" and op.is_weights.batch_normalize is True
    assert [c.model_dump() for c in op.rejection] == [{"statistic": "k3", "level": "seq_sum", "low": None, "high": 1.0}]
    op = off_policy(DECOUPLED_TWO)
    assert op.mode == "decoupled" and op.cap == 2.0 and op.is_weights is None
    assert [(c.statistic, c.level, c.low, c.high) for c in op.rejection] == [("ratio", "token", 0.5, 4.0), ("k2", "seq_max", None, 1.0)]
    op = off_policy(REJECTION_MODE_PLUS)
    assert (op.mode, op.level, op.cap, op.is_weights.low, op.is_weights.high) == ("rejection", "geometric", 1.5, 0.8, 1.5)
    assert [(c.statistic, c.level, c.high) for c in op.rejection] == [("k2", "token", 2.0)]
    op = off_policy(BENCHMARK)
    assert op.is_weights.kind == "icepop" and op.rejection[0].high == 0.1
    # one key at a time works for is_weights (a mapping), and a later override wins
    op = off_policy(["algorithm.off_policy.is_weights.high=3.0", "algorithm.off_policy.is_weights.level=geometric"])
    assert (op.is_weights.kind, op.is_weights.level, op.is_weights.low, op.is_weights.high) == ("truncate", "geometric", None, 3.0)


def test_old_keys_keep_their_meaning_and_the_config_round_trips(tmp_path):
    op = off_policy([])
    assert (op.mode, op.cap, op.level, op.is_weights, op.rejection) == ("none", 2.0, "token", None, [])
    op = off_policy(["algorithm.off_policy.mode=tis", "algorithm.off_policy.cap=3.0", "algorithm.off_policy.level=sequence"])
    assert (op.mode, op.cap, op.level, op.is_weights, op.rejection) == ("tis", 3.0, "sequence", None, [])
    cfg = load_config(RECIPE, SEQ_TIS_K3, check_files=False)
    saved = tmp_path / "config.yaml"
    saved.write_text(config_to_yaml(cfg))
    assert load_config(saved, check_files=False).algorithm.off_policy == cfg.algorithm.off_policy


@pytest.mark.parametrize(
    ("overrides", "path", "message"),
    [
        (
            ["algorithm.off_policy.rejection=[{statistic: ratio, low: 3.0, high: 0.5}]"],
            "algorithm.off_policy.rejection.0",
            "low: 3.0 is above high",
        ),
        (["algorithm.off_policy.rejection=[{statistic: k2}]"], "algorithm.off_policy.rejection.0", "set low, high or both"),
        (
            ["algorithm.off_policy.rejection=[{statistic: ratio, level: seq_max, high: 2}]"],
            "algorithm.off_policy.rejection.0",
            "no seq_max",
        ),
        (["algorithm.off_policy.rejection=[{statistic: ratio, low: 0, high: 2}]"], "algorithm.off_policy.rejection.0", "low: must be > 0"),
        (["algorithm.off_policy.rejection=[{statistic: k3, high: -1}]"], "algorithm.off_policy.rejection.0.high", ">= 0"),
        (["algorithm.off_policy.rejection=[{statistic: k9, high: 1}]"], "algorithm.off_policy.rejection.0.statistic", "k3"),
        (["algorithm.off_policy.rejection=[{statistic: k3, level: seq, high: 1}]"], "algorithm.off_policy.rejection.0.level", "seq_mean"),
        (
            ["algorithm.off_policy.rejection=[{statistic: k3, high: 1}, {statistic: k3, high: 2}]"],
            "algorithm.off_policy",
            "rejection.1: repeats",
        ),
        (["algorithm.off_policy.is_weights.kind=icepop"], "algorithm.off_policy.is_weights", "low: icepop needs both bounds"),
        (["algorithm.off_policy.is_weights.low=3"], "algorithm.off_policy.is_weights", "low: 3.0 is above high (2.0)"),
        (["algorithm.off_policy.is_weights.high=null"], "algorithm.off_policy.is_weights", "high: must be set"),
        (["algorithm.off_policy.is_weights.high=0"], "algorithm.off_policy.is_weights.high", "> 0"),
        (["algorithm.off_policy.is_weights.kind=clip"], "algorithm.off_policy.is_weights.kind", "truncate"),
        (
            ["algorithm.off_policy.mode=tis", "algorithm.off_policy.is_weights.high=2"],
            "algorithm.off_policy",
            "is_weights: mode 'tis' already weights",
        ),
        (
            ["algorithm.off_policy.mode=bypass", "algorithm.off_policy.is_weights.high=2"],
            "algorithm.off_policy",
            "is_weights: mode 'bypass'",
        ),
        (
            ["algorithm.off_policy.mode=bypass", "algorithm.off_policy.rejection=[{statistic: k3, high: 1}]"],
            "algorithm.off_policy",
            "rejection: mode 'bypass'",
        ),
    ],
)
def test_bad_settings_name_the_field(overrides, path, message):
    with pytest.raises(ConfigError) as err:
        off_policy(overrides)
    assert any(p == path and message in m for p, m in err.value.issues), err.value.issues
