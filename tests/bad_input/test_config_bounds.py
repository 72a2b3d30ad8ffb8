"""Every number in a run config (and a sweep spec) has an upper bound, at submit and live.

Before: counts, epochs, batch sizes, rates and coefficients had only lower bounds, so
`trainer.ppo_epochs=10**9` (a run that hangs in its first update) or `trainer.lr=1e300`
(weights at inf after one step) passed the checks at submit, and as live changes
(`ratchet set`), which validate through the same fields (config/live_keys.py).
"""

from __future__ import annotations

import typing

import annotated_types
import pytest
from pydantic import BaseModel

from ratchet.config import ConfigError, load_config
from ratchet.config import schema, sweep_spec
from ratchet.config.live_keys import LIVE, check_live_changes

BASE = {"model": {"path": "/nowhere"}, "data": {"train_files": "/nowhere.parquet"}}


def _models(module) -> list[type[BaseModel]]:
    return [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, BaseModel) and c.__module__ == module.__name__]


def _upper_bound(annotation, metadata) -> float | None:
    """The field's upper bound (le / lt), also on each element of a tuple; None if any part has none."""
    bounds = [
        m.le if isinstance(m, annotated_types.Le) else m.lt for m in metadata if isinstance(m, (annotated_types.Le, annotated_types.Lt))
    ]
    if bounds:
        return min(bounds)
    if typing.get_origin(annotation) is tuple:
        parts = [_upper_bound(*_split(arg)) for arg in typing.get_args(annotation)]
        return None if any(p is None for p in parts) else min(parts)
    return None


def _split(annotation):
    if typing.get_origin(annotation) is typing.Annotated:
        base, *extra = typing.get_args(annotation)
        return base, [m for info in extra for m in getattr(info, "metadata", [info])]
    return annotation, []


def _numeric_fields():
    for module in (schema, sweep_spec):
        for model in _models(module):
            for name, info in model.model_fields.items():
                if schema._numeric(info.annotation) is None:
                    continue
                if model is sweep_spec.ParamSpace and name in ("low", "high"):
                    continue  # a range of another key's values: each trial config is validated as a whole
                yield f"{module.__name__}.{model.__name__}.{name}", info


def test_every_number_has_an_upper_bound():
    unbounded = [name for name, info in _numeric_fields() if _upper_bound(info.annotation, info.metadata) is None]
    assert unbounded == [], unbounded


@pytest.mark.parametrize(
    ("override", "field", "fragment"),
    [
        ("trainer.ppo_epochs=1000000000", "trainer.ppo_epochs", "must be <= 100"),
        ("trainer.lr=1e300", "trainer.lr", "must be <= 1"),
        ("critic.ppo_epochs=1000", "critic.ppo_epochs", "must be <= 100"),
        ("rollout.n=100000", "rollout.n", "must be <= 1024"),
        ("trainer.micro_batch_size=10000000", "trainer.micro_batch_size", "must be <= 1048576"),
        ("loop.prompts_per_step=10000000", "loop.prompts_per_step", "must be <= 1048576"),
        ("algorithm.entropy_coeff=1e9", "algorithm.entropy_coeff", "must be <= 100"),
        ("algorithm.kl.coef=1e9", "algorithm.kl.coef", "must be <= 100"),
        ("reward.function_weight=-1e300", "reward.function_weight", "must be >= -1000000"),
        ("rollout.max_response_length=100000000", "rollout.max_response_length", "must be <= 2097152"),
        ("resources.trainer_cpus=1e12", "resources.trainer_cpus", "must be <= 65536"),
    ],
)
def test_a_number_too_large_is_refused_at_submit(override, field, fragment):
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, [override], base=BASE, check_files=False)
    issues = dict(excinfo.value.issues)
    assert fragment in issues[field], issues


@pytest.mark.parametrize("key", sorted(LIVE))
def test_a_live_change_beyond_the_bound_is_refused(key):
    """The live check is the submit check: each live key refused just past its field's bound."""
    model, info = schema.RunConfig, None
    for part in key.split("."):
        info = model.model_fields[part]
        model = info.annotation if isinstance(info.annotation, type) else None
    bound = _upper_bound(info.annotation, info.metadata)
    assert bound is not None, key
    config = {**BASE, "algorithm": {"kl": {"coef": 0.01}}}  # a run with a reference model, so the KL coef is live
    too_big = [bound * 10 + 1] * 2 if typing.get_origin(info.annotation) is tuple else bound * 10 + 1
    if schema._numeric(info.annotation) is int:
        too_big = int(too_big)
    with pytest.raises(ConfigError) as excinfo:
        check_live_changes(config, {}, {key: too_big})
    issues = dict(excinfo.value.issues)
    assert any(k.startswith(key) and ("must be <" in why) for k, why in issues.items()), issues


@pytest.mark.parametrize(
    ("key", "value", "fragment"), [("trainer.ppo_epochs", 10**9, "must be <= 100"), ("trainer.lr", 1e300, "must be <= 1")]
)
def test_the_issue_examples_are_refused_live(key, value, fragment):
    with pytest.raises(ConfigError) as excinfo:
        check_live_changes(BASE, {}, {key: value})
    assert fragment in dict(excinfo.value.issues)[key]


def test_values_at_the_bounds_still_pass():
    cfg = load_config(
        None, ["trainer.ppo_epochs=100", "trainer.lr=1.0", "rollout.n=1024", "algorithm.kl.coef=100"], base=BASE, check_files=False
    )
    assert (cfg.trainer.ppo_epochs, cfg.trainer.lr, cfg.rollout.n, cfg.algorithm.kl.coef) == (100, 1.0, 1024, 100)
