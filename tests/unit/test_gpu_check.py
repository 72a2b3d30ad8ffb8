"""benchmarks/gpu_check.py before it ever reaches a GPU: run as that machine runs it, with
only the machine's packages importable (benchmarks/gpu_machine.py: a `python -S` that
sees the machine's distributions, as installed here, and ratchet's source tree, not the
installed ratchet), its --cpu-smoke mode runs every check small on CPU; a module the
check imports that needs a package the machine lacks fails here; the config snapshot it
reads without pydantic matches the schema; without a GPU and without --cpu-smoke it
says so."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("OUT", None)
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def machine_site(tmp_path_factory) -> Path:
    gpu_machine = load_benchmark("gpu_machine")
    site = tmp_path_factory.mktemp("gpu-machine") / "site"
    gpu_machine.build_site(site)
    return site


@pytest.mark.slow
def test_the_emulated_machine_has_its_packages_and_none_of_the_others(machine_site):
    gpu_machine = load_benchmark("gpu_machine")
    closure = gpu_machine.machine_closure()
    assert {"torch", "transformers", "safetensors", "pytest", "rich", "pyarrow"} <= closure.keys()
    assert not {gpu_machine.canonical(n) for n in gpu_machine.ABSENT_ON_GPU_MACHINE} & closure.keys()
    probe = "import importlib.util as u; print([n for n in ('torch', 'transformers', 'pydantic', 'tenacity', 'ray', 'temporalio', 'omegaconf') if u.find_spec(n)])"
    out = gpu_machine.run_as_gpu_machine(["-c", probe], machine_site, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['torch', 'transformers']"
    # ratchet is the source tree's, not the installed package
    out = gpu_machine.run_as_gpu_machine(
        ["-c", "import ratchet; print(ratchet.__file__)"], machine_site, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == str(ROOT / "src" / "ratchet" / "__init__.py")


@pytest.mark.slow
def test_the_check_runs_every_check_as_the_gpu_machine_would(tmp_path):
    out = run("--cpu-smoke", "--as-gpu-machine", "--out", str(tmp_path))
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "config from gpu_check_config.json (no pydantic)" in text
    rows = {r["check"]: r for r in json.loads((tmp_path / "gpu_check.json").read_text())["rows"]}
    assert rows["imports"]["status"] == "PASS"
    assert float(rows["generate, HFEngine, smoke"]["result"].split()[0].replace(",", "")) > 0
    trainer = rows["trainer update, smoke"]
    assert float(trainer["result"].split()[0].replace(",", "")) > 0 and "FSDP2 world 1 (gloo), bf16, act. ckpt" in trainer["detail"]
    sync = rows["weight sync to an engine process, smoke"]
    assert sync["status"] == "PASS" and "the engine's weights equal the trainer's" in sync["detail"]
    assert int(re.search(r"in (\d+) buckets", sync["detail"]).group(1)) > 3
    assert rows["engine hand-over (sleep, wake up)"]["status"] == "PASS"
    curve = re.search(r"per step: ([\d. ]+)$", rows["GRPO via LocalLoop (tiny model, copy task)"]["detail"])
    assert curve and len(curve.group(1).split()) == 3 and all(0.0 <= float(r) <= 1.0 for r in curve.group(1).split())
    # tests/gpu collected with the machine's packages only; every test skipped without a GPU
    tests = rows["tests/gpu"]
    assert tests["status"] == "PASS" and re.fullmatch(r"\d+ skipped(, \d+ warnings?)?", tests["result"]), tests
    assert int(tests["result"].split()[0]) >= 8
    assert sum(r["status"] == "not testable" for r in rows.values()) == 5
    assert not [r for r in rows.values() if r["status"] == "FAIL"]
    assert re.search(r"gpu_check: \d+ passed, 0 failed", text)
    assert "| weight sync to an engine process, smoke |" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow
def test_a_module_that_needs_a_package_the_machine_lacks_fails_the_check(tmp_path):
    """What would have stopped the check on the machine stops it here: a module it imports
    (the colocated engine process) made to import tenacity, which the machine lacks."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "ratchet", src / "ratchet", ignore=shutil.ignore_patterns("__pycache__"))
    module = src / "ratchet" / "workers" / "weight_sync" / "colocated_process.py"
    module.write_text(
        module.read_text().replace(
            "from __future__ import annotations\n", "from __future__ import annotations\n\nimport tenacity  # noqa: F401\n", 1
        )
    )
    out = run("--cpu-smoke", "--as-gpu-machine", "--only", "imports", "--src", str(src), timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    assert "ratchet.workers.weight_sync.colocated_process: ModuleNotFoundError: No module named 'tenacity'" in text
    # the same tree passes when run with the venv's packages (tenacity installed): the failure is the machine's
    assert run("--cpu-smoke", "--only", "imports", "--src", str(src), timeout=300).returncode == 0


def test_config_snapshot_matches_the_schema():
    """The GPU machine has no pydantic: the script reads this snapshot there. Regenerate
    with `python benchmarks/gpu_check.py --write-config-snapshot` when the schema changes."""
    gpu_check = load_benchmark("gpu_check")
    assert json.loads(gpu_check.SNAPSHOT.read_text()) == gpu_check.snapshot_dict()


def test_config_view_reads_like_the_run_config():
    gpu_check = load_benchmark("gpu_check")
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


def test_mfu_counts_the_matmul_parameters_and_causal_attention():
    gpu_check = load_benchmark("gpu_check")
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(gpu_check.llama_config("0.5B"))
    params = gpu_check.matmul_params(model)
    assert 490e6 < params < 500e6  # Qwen2.5-0.5B: 494M, its tied head counted once
    c = model.config
    assert gpu_check.train_flops_per_token(model, 2048) == 6 * params + 6 * c.num_hidden_layers * c.hidden_size * 2048
    assert gpu_check.peak_flops("NVIDIA H200") == 989e12 and gpu_check.peak_flops("some CPU") is None


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_exits_with_a_message():
    out = run()
    assert out.returncode == 2
    assert "no CUDA device is visible" in out.stderr and "--cpu-smoke" in out.stderr
