"""The `ratchet` command line, run as a real subprocess."""

from __future__ import annotations

import pytest
import os
import subprocess
import sys

from ratchet.platform.client import RECIPE_PATH

RATCHET = [sys.executable, "-m", "ratchet.platform.cli"]


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*RATCHET, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_help_lists_commands():
    out = run_cli("--help")
    assert out.returncode == 0
    for cmd in ("up", "down", "status", "worker", "prepare", "train", "demo"):
        assert cmd in out.stdout


def test_train_rejects_bad_config_before_connecting(assets):
    """Exit code 2 and the dotted field paths; no Temporal server is needed to find out."""
    train, _ = assets.data["copy"]
    out = run_cli(
        "train", str(RECIPE_PATH), f"model.path={assets.model}", f"data.train_files={train}", "data.eval_files=null",
        "trainer.lrr=1", "loop.mode=bogus",
        env={"RATCHET_TEMPORAL_ADDRESS": "127.0.0.1:1"},
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "trainer.lrr" in out.stderr and "did you mean 'lr'" in out.stderr
    assert "loop.mode" in out.stderr and "sync" in out.stderr


@pytest.mark.slow
def test_prepare_builds_assets(tmp_path):
    out = run_cli("prepare", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "tiny-digits" / "config.json").is_file()
    for task in ("copy", "reverse", "sort", "add"):
        assert (tmp_path / task / "train.parquet").is_file() and (tmp_path / task / "eval.parquet").is_file()
