"""Every example config under examples/ is a valid run config (or sweep spec), so a recipe
the README points at cannot rot. File checks are off: the assets they name are built by
`ratchet prepare`, which this test does not run."""

from __future__ import annotations

from pathlib import Path

import pytest

from ratchet.config import RunConfig, load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SWEEP_SPECS = {"sweep_copy.yaml"}
RUN_CONFIGS = sorted(p.name for p in EXAMPLES.glob("*.yaml") if p.name not in SWEEP_SPECS)


def test_the_readme_lists_every_example():
    readme = (EXAMPLES.parent / "README.md").read_text()
    missing = [name for name in RUN_CONFIGS if f"examples/{name}" not in readme]
    assert not missing, f"README.md never mentions {missing}"


@pytest.mark.parametrize("name", RUN_CONFIGS)
def test_example_is_a_valid_run_config(name, monkeypatch):
    monkeypatch.chdir(EXAMPLES.parent)  # the examples' paths are relative to the clone's root
    cfg = load_config(EXAMPLES / name, check_files=False)
    assert isinstance(cfg, RunConfig)
    assert cfg.tracking.name, f"{name}: give the recipe a tracking.name"


def test_sweep_example_is_a_valid_sweep_spec(monkeypatch):
    from ratchet.config.sweep_spec import load_sweep_spec

    monkeypatch.chdir(EXAMPLES.parent)
    spec, _ = load_sweep_spec(EXAMPLES / "sweep_copy.yaml")
    assert spec.space
