"""Run configs for tests that drive workers in-process (no files checked: `check_files`
is not run, so the dataset path is never opened)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ratchet.config.schema import RunConfig


# The platform tests' runs log to no tracker: MLflow costs the worker about 2 CPU-s a run
# (its import, its store, a call per step). A run's copy in a tracker is checked in
# tests/tracking/ and, for a real run on the platform with MLflow turned on, in
# tests/integration/test_dashboards.py. A later `tracking.mlflow=true` in a test's own
# overrides wins.
NO_TRACKER = "tracking.mlflow=false"


def cfg_dict(model_path, **sections) -> dict:
    """The raw config: a small GRPO run on `model_path`, with `sections` merged in. No
    pydantic here: tests/gpu builds its configs from it on the GPU machine."""
    raw = {
        "seed": 0,
        "model": {"path": str(model_path)},
        "data": {"train_files": "unused.parquet"},
        "rollout": {"n": 4, "max_response_length": 6},
        "trainer": {"lr": 1e-3, "micro_batch_size": 4},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def make_cfg(model_path, **sections) -> RunConfig:
    """The config through every check of the config alone (the schema and the cross-section
    checks; no file read): a ConfigError, a ValueError, names what is wrong."""
    from ratchet.config.loader import parse_config

    return parse_config(cfg_dict(model_path, **sections))
