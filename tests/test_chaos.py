"""Kill anything, lose nothing: faults injected at seeded random moments while runs train.

The faults are real: SIGKILL of the `ratchet worker` process (restarted, as a supervisor
would), SIGKILL of the trainer and of the rollout actor processes (Ray does not restart
them; the activities rebuild them: the trainer from its last checkpoint plus a replay of
the logged updates), SIGKILL of the Temporal dev server (restarted on its database), and
a restart of the Ray head (every actor lost at once).
Each run must finish by itself with every step recorded once and every prompt trained on
once; in deterministic sync mode its final weights equal an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ratchet.platform.client import RECIPE_PATH, Client
from ratchet.platform.demo import start_worker_process, stop_worker_process
from ratchet.platform.services import ServiceSettings, down, free_ports, temporal_address, up
from ratchet.storage import BatchStore, ObjectStore
from ratchet.workers.batch import RolloutBatch
from ratchet.workers.trainer import train_log_key

pytestmark = pytest.mark.integration

STEPS, PROMPTS, N = 12, 4, 4


class ChaosPlatform:
    """Services and a worker of its own: this module kills them."""

    def __init__(self, assets):
        self.assets = assets
        self.state = Path(tempfile.mkdtemp(dir="/tmp", prefix="rt-chaos-"))
        t, ui, r = free_ports(3)
        self.settings = ServiceSettings(state_dir=self.state, temporal_port=t, temporal_ui_port=ui, ray_port=r, start_timeout_s=60.0)
        up(self.settings)
        os.environ["RATCHET_STICKY_TIMEOUT_S"] = "1"
        self.worker = start_worker_process(self.settings)
        self.client = Client.connect(temporal_address(self.settings))

    def overrides(self, *extra: str) -> list[str]:
        train, _ = self.assets.data["copy"]
        return [
            f"model.path={self.assets.model}", f"data.train_files={train}", "data.eval_files=null",
            f"storage.root={self.state / 'runs'}", "warmup.steps=2", f"loop.prompts_per_step={PROMPTS}", f"rollout.n={N}",
            f"loop.steps={STEPS}", "checkpoint.every=4", "checkpoint.keep_last=2", "deterministic=true",
            "loop.heartbeat_timeout_s=5", *extra,
        ]  # fmt: skip

    # -- faults --------------------------------------------------------------------------

    def kill_worker(self) -> None:
        self.worker.kill()
        self.worker.wait()
        self.worker = start_worker_process(self.settings)

    def kill_actor(self, cls: str) -> bool:
        for pid in _pids():
            if _cmdline(pid).startswith(f"ray::{cls}"):
                os.kill(pid, signal.SIGKILL)
                return True
        return False

    def kill_temporal(self) -> None:
        rec = json.loads(self.settings.state_file.read_text())["services"]["temporal"]
        os.kill(rec["pid"], signal.SIGKILL)
        time.sleep(1.0)
        up(self.settings)  # the same ports and database file: the history survives

    def restart_ray(self) -> None:
        """The Ray head and every actor on it go; the worker process (a Ray driver) is
        restarted with it, as its supervisor would once its Ray connection is lost."""
        from ratchet.platform.services import _stop_ray

        rec = json.loads(self.settings.state_file.read_text())["services"]["ray"]
        self.worker.kill()
        self.worker.wait()
        _stop_ray(rec, 10.0)
        up(self.settings)
        self.worker = start_worker_process(self.settings)

    def close(self) -> None:
        stop_worker_process(self.worker)
        down(self.settings)
        if not os.environ.get("RATCHET_KEEP_TEST_STATE"):
            shutil.rmtree(self.state, ignore_errors=True)


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.fixture(scope="module")
def chaos(assets):
    p = ChaosPlatform(assets)
    try:
        yield p
    finally:
        p.close()


def steps_recorded(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def inject(chaos: ChaosPlatform, run_dir: Path, seed: int, done: threading.Event) -> list[str]:
    """At seeded random steps (and a random moment inside the step): the trainer actor, the
    rollout actor, the worker process, the Temporal server, the Ray head."""
    rng = random.Random(seed)
    faults = [("trainer", lambda: chaos.kill_actor("TrainerWorker")), ("rollout", lambda: chaos.kill_actor("RolloutWorker")),
              ("worker", chaos.kill_worker), ("temporal", chaos.kill_temporal), ("ray", chaos.restart_ray)]  # fmt: skip
    at = sorted(rng.sample(range(1, STEPS - 1), len(faults)))
    rng.shuffle(faults)
    fired = []
    for step, (name, fault) in zip(at, faults):
        while steps_recorded(run_dir) < step and not done.is_set():
            time.sleep(0.05)
        if done.is_set():
            break
        time.sleep(rng.uniform(0.0, 0.4))
        fault()
        fired.append(f"{name}@{step}")
    return fired


def trained_prompts(run_dir: Path) -> list[int]:
    store = ObjectStore(str(run_dir))
    batches = BatchStore(store)
    out = []
    for v in range(STEPS):
        entry = store.get_json(train_log_key(v))
        for part in range(entry["parts"]):
            name = "rollout" if part == 0 else f"rollout-{part}"
            out += torch.unique(RolloutBatch.load(batches, entry["batch"], name).prompt_index).tolist()
    return sorted(out)


def final_weights(summary) -> dict[str, torch.Tensor]:
    return load_file(str(Path(summary.final_policy_uri) / "model.safetensors"))


def run_with_faults(chaos: ChaosPlatform, name: str, extra: list[str], seed: int):
    handle = chaos.client.submit(RECIPE_PATH, chaos.overrides(*extra, f"tracking.name={name}"))
    run_dir = chaos.state / "runs" / handle.run_id
    done = threading.Event()
    fired: list[str] = []
    injector = threading.Thread(target=lambda: fired.extend(inject(chaos, run_dir, seed, done)), daemon=True)
    injector.start()
    try:
        summary = _result(chaos, handle)
    finally:
        done.set()
        injector.join(60)
    return summary, run_dir, fired


def _result(chaos: ChaosPlatform, handle, timeout: float = 600.0):
    """The run's result; the client reconnects while the Temporal server restarts."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return chaos.client.get(handle.run_id).result(timeout=max(1.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - the server was killed under the long poll
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def check_exactly_once(summary, run_dir: Path) -> None:
    assert summary.steps == STEPS and summary.policy_version == STEPS
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(STEPS)), "every step's metrics exist exactly once"
    assert trained_prompts(run_dir) == list(range(STEPS * PROMPTS)), "every prompt trained on exactly once"


def test_sync_run_survives_every_fault_with_identical_weights(chaos):
    clean = _result(chaos, chaos.client.submit(RECIPE_PATH, chaos.overrides("tracking.name=clean")))
    summary, run_dir, fired = run_with_faults(chaos, "chaos-sync", [], seed=1)
    assert len(fired) == 5, fired
    check_exactly_once(summary, run_dir)
    a, b = final_weights(clean), final_weights(summary)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), f"weights differ after faults {fired}"
    # Retention kept the last two checkpoints (steps 8 and 12), each committed.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000008", "step-00000012"]


def test_fully_async_run_survives_every_fault(chaos):
    extra = ["loop.mode=fully_async", "loop.max_staleness=1", "loop.queue_limit=2", "algorithm.off_policy.mode=tis"]
    summary, run_dir, fired = run_with_faults(chaos, "chaos-async", extra, seed=2)
    assert len(fired) == 5, fired
    check_exactly_once(summary, run_dir)
    assert summary.dropped_samples == 0
