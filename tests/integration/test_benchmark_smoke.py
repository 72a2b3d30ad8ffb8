"""Every benchmark still runs: each script under benchmarks/ in its smoke mode (`--smoke`:
tiny sizes, a few steps), or run by a test of its own (named below).

The smoke runs that start a Ray or a whole platform of their own (`benchmark_smoke`
marker: engines, learning_spread, startup, step_overhead, weight_sync) take 1-2 minutes
each on CI's two cores, model loads and actor start-ups that no size shrinks (and
temporal_exit starts a Temporal server of its own, for scripts that start ten more); `make
bench-smoke` runs them all, `make test` only the others and the guard below.

A benchmark is run by hand, rarely, and the code it calls changes under it: without this,
`benchmarks/async_speedup.py` crashed for weeks (its stand-in worker lacked an activity
the workflow had started calling). The smoke runs assert that the script exits 0 and prints
its table with the rows it promises; never a number (speed is what the full run measures).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# script -> what its smoke run must print (its table's title and rows).
SMOKE = {
    "actor_start": ["actor start, CPU-s", "reward worker"],
    "async_speedup": ["orchestration alone", "sync", "one_step_off", "fully_async"],
    "checkpoint": [
        "checkpoint throughput",
        "raw minio fput/fget_object",
        "ratchet local folder",
        "ratchet s3:// (s3fs)",
        "ratchet minio://",
    ],
    "engines": ["generation tokens/s", "tiny", "hf"],
    "learning_spread": ["lora-ranks: seeds 0", "adapter diff", "merged diff"],
    "startup": ["start-up: submit to the first step", "start_workers", "total: submit to the first metrics line"],
    "step_overhead": ["seconds per GRPO step", "plain loop (in-process), before", "ratchet (workflow + Ray)"],
    "temporal_exit": ["crashes at exit", "SDK client alone", "SDK client, ratchet's exit guard", "ratchet.Client"],
    # (Its numbers are timings and sizes; the window bound is tests/unit/test_weight_sync.py's.)
    "weight_sync": ["weight sync trainer -> engine", "most buckets held by rank 0"],
}

# script -> the test that runs it (at its own small sizes), so it needs no smoke mode here.
RUN_BY = {
    "algorithms": "tests/unit/test_algorithms_benchmark.py",
    "gpu_check": "tests/unit/test_gpu_check.py",
    "gpu_machine": "tests/unit/test_gpu_check.py",
    "lora_sync": "tests/unit/test_lora.py",
    "scale": "tests/faults/test_scale.py",
    "suite_cpu": "tests/unit/test_suite_cpu_benchmark.py",
}


def test_every_benchmark_is_run_by_the_suite():
    """A new script under benchmarks/ gets a smoke mode here or a test that runs it."""
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
    assert scripts == set(SMOKE) | set(RUN_BY), (
        f"not run by the suite: {sorted(scripts - set(SMOKE) - set(RUN_BY))}; gone: {sorted((set(SMOKE) | set(RUN_BY)) - scripts)}"
    )
    root = BENCHMARKS.parent
    for script, test in RUN_BY.items():
        assert script in (root / test).read_text(), f"{test} does not run benchmarks/{script}.py"
    for script in SMOKE:
        assert "--smoke" in (BENCHMARKS / f"{script}.py").read_text(), f"benchmarks/{script}.py has no --smoke"


# Start a Ray or a platform of their own: `make bench-smoke`, not `make test`.
OWN_SERVICES = {"engines", "learning_spread", "startup", "step_overhead", "temporal_exit", "weight_sync"}


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.benchmark_smoke) if s in OWN_SERVICES else s for s in sorted(SMOKE)])
def test_smoke(script, tmp_path):
    # As from a user's shell: none of the suite's own settings (its Ray, its state folder,
    # its payload key: with the key named, a benchmark's client and worker agreed by luck).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RATCHET_"))}
    env["HOME"] = str(tmp_path)  # caches (engines' model build) in a folder of the test's own
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{script}.py"), "--smoke"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,  # a hang guard
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    missing = [text for text in SMOKE[script] if text not in done.stdout]
    assert not missing, f"{script} --smoke did not print {missing}:\n{done.stdout[-4000:]}"
