"""Run configs for tests that drive workers in-process (no files checked: `check_files`
is not run, so the dataset path is never opened)."""

from __future__ import annotations

from ratchet.config.schema import RunConfig


def make_cfg(model_path, **sections) -> RunConfig:
    raw = {
        "seed": 0,
        "model": {"path": str(model_path)},
        "data": {"train_files": "unused.parquet"},
        "rollout": {"n": 4, "max_response_length": 6},
        "trainer": {"lr": 1e-3, "micro_batch_size": 4},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return RunConfig.model_validate(raw)
