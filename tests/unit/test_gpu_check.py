"""benchmarks/gpu_check.py before it ever reaches a GPU: its --cpu-smoke mode runs every
check (trainer with FSDP2 + bf16 + activation checkpointing, HF engine, two-process weight
sync, GRPO through LocalLoop) small on CPU, with the packages the GPU machine lacks
(pydantic, omegaconf, pyarrow, ray, temporalio, vllm, rich, ...) made unimportable; its
config snapshot matches the schema; without a GPU and without --cpu-smoke it says so."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def load_script():
    return load_benchmark("gpu_check")


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def test_config_snapshot_matches_the_schema():
    """The GPU machine has no pydantic: the script reads this snapshot there. Regenerate
    with `python benchmarks/gpu_check.py --write-config-snapshot` when the schema changes."""
    gpu_check = load_script()
    assert json.loads(gpu_check.SNAPSHOT.read_text()) == gpu_check.snapshot_dict()


def test_config_view_reads_like_the_run_config():
    gpu_check = load_script()
    overrides = {"model": {"path": "m"}, "data": {"train_files": "d.jsonl"}, "trainer": {"device": "cpu", "lr": 0.5}}
    view = gpu_check.ConfigView(gpu_check._merge(json.loads(gpu_check.SNAPSHOT.read_text()), overrides))
    cfg = gpu_check.run_config(overrides)  # pydantic is installed here: a real RunConfig
    for path in ("trainer.lr", "trainer.device", "trainer.betas", "rollout.n", "algorithm.kl.coef", "data.prompt_key", "uses_critic"):
        a, b = view, cfg
        for part in path.split("."):
            a, b = getattr(a, part), getattr(b, part)
        assert (list(a) if isinstance(a, (list, tuple)) else a) == (list(b) if isinstance(b, (list, tuple)) else b), path
    with pytest.raises(AttributeError, match="--write-config-snapshot"):
        view.trainer.no_such_field


def test_cpu_smoke_runs_every_check_without_the_missing_packages():
    out = run("--cpu-smoke", "--simulate-gpu-machine")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "config from gpu_check_config.json (no pydantic)" in text
    trainer = re.search(r"trainer step \(FSDP2 world 1, bf16, act\. ckpt\): ([\d.]+) s/update .*backend gloo, units LlamaDecoderLayer", text)
    assert trainer and float(trainer.group(1)) > 0, text[-3000:]
    assert re.search(r"HF engine generate \(HFEngine\): [\d,]+ tok/s", text)
    sync = re.search(r"weight sync, 2 processes, 1 device: ([\d.]+) GB/s 8 MiB in 4 buckets", text)
    assert sync and float(sync.group(1)) > 0
    curve = re.search(r"reward curve \(mean per 1 steps\): ([\d. ]+)", text)
    assert curve and len(curve.group(1).split()) == 3
    assert all(0.0 <= float(r) <= 1.0 for r in curve.group(1).split())
    assert "FAILED" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_exits_with_a_message():
    out = run()
    assert out.returncode == 2
    assert "no CUDA device is visible" in out.stderr and "--cpu-smoke" in out.stderr
