"""benchmarks/suite_cpu.py: the sampler charges a process's CPU, from when it was first
seen, to the kind its command line names."""

from __future__ import annotations

import subprocess
import sys

from tests.benchmark_scripts import load_benchmark

suite_cpu = load_benchmark("suite_cpu")

# Burns 0.4 s of its own CPU time (not of wall time: a busy machine only makes it slower),
# then waits on stdin so that it is alive when sampled.
BURN = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\nprint('done', flush=True)\nsys.stdin.read()"


def test_a_process_started_while_sampling_is_charged_its_cpu_under_its_kind():
    sampler = suite_cpu.Sampler(period_s=0.1)
    sampler.start()
    sampler.ready.wait()
    child = subprocess.Popen(
        [sys.executable, "-c", BURN, "ratchet.platform.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "done"
        sampler.stop()
    finally:
        child.communicate("")
    cpu, label = sampler.of(child.pid)
    assert label == "ratchet worker"  # by the module name on its command line
    # Its burn, all of it after the sampler's first look; /proc counts user and system time
    # in clock ticks (10 ms each), so the sum may read up to two ticks short.
    assert cpu >= 0.38
    by_kind, processes = sampler.by_kind()
    assert by_kind[label] >= cpu and processes[label] >= 1


def test_kinds_by_command_line():
    class Fake:
        def __init__(self, cmd, name="python"):
            self._cmd, self._name = cmd, name

        def cmdline(self):
            return self._cmd

        def name(self):
            return self._name

    assert suite_cpu.kind(Fake(["/v/lib/ray/core/src/ray/raylet/raylet", "--x"], "raylet")) == "Ray raylet"
    assert suite_cpu.kind(Fake(["ray::r-1/trainer-0"], "ray::r-1/traine")) == "Ray actor: trainer"
    assert suite_cpu.kind(Fake(["ray::AdmissionLedger.admit()"], "ray::AdmissionL")) == "Ray actor: AdmissionLedger"
    assert suite_cpu.kind(Fake(["ray::IDLE"], "ray::IDLE")) == "Ray actor: IDLE"
    assert suite_cpu.kind(Fake(["python", "/v/ray/_private/workers/default_worker.py"])) == "Ray worker (starting)"
    assert suite_cpu.kind(Fake(["python", "-m", "ratchet.platform.worker"])) == "ratchet worker"
    assert suite_cpu.kind(Fake([], "kworker/0:1")) is None  # kernel threads are not counted
    assert suite_cpu.kind(Fake(["bash", "-c", "x"], "bash")) == "other: bash"
    assert suite_cpu.kind(Fake(["/v/bin/python", "/v/bin/ratchet", "runs"], "ratchet")) == "ratchet CLI"
    assert suite_cpu.kind(Fake(["/v/bin/python", "-m", "ratchet.platform.node", "--index", "1"])) == "ratchet node (a node's supervisor)"
