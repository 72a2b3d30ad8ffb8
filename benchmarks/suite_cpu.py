"""Where does a test's CPU time go? Runs pytest on the tests given while sampling every
process of the machine twice a second, and prints one table: CPU seconds by kind of
process (Ray actor processes by their class, the ratchet worker, the test process, the
Temporal server, Ray's own daemons, ...), with how many processes of each kind ran.

CI's machine has two cores and the suite keeps both busy (vmstat: ~0% idle), so the
suite's length is its CPU time over two: what to cut is what this table shows, not
waiting. Processes that were running before the tests started count from then on; one
that lives less than half a second may be missed (its parent's `time` still has it).

    .venv/bin/python benchmarks/suite_cpu.py tests/e2e/test_chaos_sync.py::test_sync_run_survives_every_fault_with_identical_weights
    .venv/bin/python benchmarks/suite_cpu.py tests/e2e/test_e2e_algorithms.py -k "rloo_dual_clip or dapo or adaptive_kl"
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import threading
import time

import psutil
from rich.console import Console
from rich.table import Table

# Matched in this order against a process's command line (first match wins).
KINDS = (
    ("ratchet.platform.worker", "ratchet worker"),
    ("pytest", "pytest (the tests themselves)"),
    ("temporal", "Temporal dev server"),
    ("gcs_server", "Ray GCS"),
    ("log_monitor", "Ray log monitor"),
    ("dashboard/agent", "Ray dashboard agent"),
    ("runtime_env/agent", "Ray runtime-env agent"),
    ("ray.util.client", "Ray client server"),
    ("mlflow", "MLflow"),
    ("uvicorn", "MLflow"),
    ("moto", "S3 server (moto)"),
    ("chrom", "Chromium"),
    ("postgres", "PostgreSQL"),
    (" start", "`ray start` / `ratchet up`"),
    ("ratchet.platform.node", "ratchet node (a node's supervisor)"),
    ("/bin/ratchet", "ratchet CLI"),
)


def kind(proc: psutil.Process) -> str | None:
    try:
        cmd, name = proc.cmdline(), proc.name()
    except (psutil.Error, OSError):
        return None
    if not cmd:
        return None  # a kernel thread
    if cmd[0].endswith("/raylet"):
        return "Ray raylet"
    if name.startswith("ray::"):
        # Ray titles a worker `ray::<actor name>` or `ray::<Class>.<method>` (`ray::IDLE`:
        # one with nothing to do); ratchet names its actors `<run>/<role>-<rank>`.
        title = (cmd[0] if cmd[0].startswith("ray::") else name).removeprefix("ray::").split()[0]
        if "/" in title:
            return f"Ray actor: {title.rsplit('/', 1)[1].rsplit('-', 1)[0]}"
        return f"Ray actor: {title.split('.')[0]}"
    line = " ".join(cmd)
    if "default_worker.py" in line:
        return "Ray worker (starting)"
    return next((label for key, label in KINDS if key in line), f"other: {name}")


class Sampler(threading.Thread):
    """CPU seconds (user + system) of every process seen, from successive samples; `by_kind`
    adds them up by the kind each process had last (a Ray worker is named by its actor
    class once it holds one)."""

    def __init__(self, period_s: float = 0.5):
        super().__init__(daemon=True)
        self.period_s = period_s
        self._base: dict[tuple[int, float], float] = {}  # CPU a process had when first seen
        self._last: dict[tuple[int, float], tuple[float, str | None]] = {}  # its CPU and kind, last sample
        self._stop_event = threading.Event()
        self.ready = threading.Event()  # set once the first look is done: what starts later counts whole

    def sample(self, first: bool) -> None:
        me = psutil.Process().pid
        for proc in psutil.process_iter():
            if proc.pid == me:
                continue
            try:
                key, total = (proc.pid, proc.create_time()), sum(proc.cpu_times()[:2])
            except (psutil.Error, OSError):
                continue
            self._base.setdefault(key, total if first else 0.0)
            label = self._last.get(key, (0.0, None))[1]
            if label in (None, "Ray worker (starting)", "Ray actor: IDLE"):
                label = kind(proc)  # a worker is named by its actor class once it holds one
            self._last[key] = (total, label)

    def by_kind(self) -> tuple[collections.Counter, collections.Counter]:
        cpu, count = collections.Counter(), collections.Counter()
        for key, (total, label) in self._last.items():
            if label is not None and total - self._base[key] > 0:
                cpu[label] += total - self._base[key]
                count[label] += 1
        return cpu, count

    def of(self, pid: int) -> tuple[float, str | None]:
        """Process `pid`'s CPU seconds since it was first seen, and its kind."""
        key = next(k for k in self._last if k[0] == pid)
        total, label = self._last[key]
        return total - self._base[key], label

    def run(self) -> None:
        self.sample(first=True)
        self.ready.set()
        while not self._stop_event.wait(self.period_s):
            self.sample(first=False)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.sample(first=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pytest_args", nargs="*", help="what pytest is given (node ids, -k ..., options first or last)")
    known, options = ap.parse_known_args()  # pytest's own options (-q, -n 2, ...) pass through
    pytest_args = [*options, *known.pytest_args]
    if not pytest_args:
        ap.error("name the tests to run, as pytest takes them")
    sampler = Sampler()
    sampler.start()
    sampler.ready.wait()
    t0 = time.monotonic()
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args])
    wall = time.monotonic() - t0
    sampler.stop()
    cpu_by_kind, processes = sampler.by_kind()
    total = sum(cpu_by_kind.values())
    table = Table(title=f"CPU by process kind: {total:.0f} CPU-s in {wall:.0f} s of wall time ({total / wall:.2f} cores), pytest exit {rc}")
    for col, justify in (("kind", "left"), ("processes", "right"), ("CPU s", "right"), ("share", "right")):
        table.add_column(col, justify=justify)
    # A kind of its own for anything else of 1% or more (a CLI, a `python -c` check), by
    # process name; the rest of the machine in one line.
    shown = {k for k, v in cpu_by_kind.items() if v >= 0.05 and (not k.startswith("other") or v >= 0.01 * total)}
    for label, cpu in cpu_by_kind.most_common():
        if label in shown:
            table.add_row(label, str(processes[label]), f"{cpu:.1f}", f"{cpu / total:.0%}")
    other = sum(v for k, v in cpu_by_kind.items() if k.startswith("other") and k not in shown)
    table.add_row("other processes of the machine", "", f"{other:.1f}", f"{other / max(total, 1e-9):.0%}")
    Console(width=140).print(table)
    return rc


if __name__ == "__main__":
    sys.exit(main())
