"""tests/gpu runs on the lent GPU machine (benchmarks/gpu_check.py runs it there), whose
packages are torch, transformers and a few dozen others but no pydantic, Ray or
Temporal (benchmarks/gpu_machine.py): these tests import nothing beyond them, and take
their run configs from the check's snapshot of the config's defaults where pydantic is
missing. Every test here is `gpu`-marked: skipped without a CUDA device."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark
from tests.configs import cfg_dict


@pytest.fixture(scope="session")
def gpu_config():
    """`gpu_config(model_path, **sections)`: tests/configs.py's config, as a RunConfig or,
    without pydantic, the snapshot's view."""
    run_config = load_benchmark("gpu_check").run_config
    return lambda model_path, **sections: run_config(cfg_dict(model_path, **sections))
