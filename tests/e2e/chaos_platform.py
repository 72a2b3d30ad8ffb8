"""The chaos tests' platform and fault injector: services and a worker of their own, and
faults at seeded random moments of a real run (tests/e2e/test_chaos_*.py, test_sweep.py).

The faults are real: SIGKILL of the `ratchet worker` process (restarted, as a supervisor
would), SIGKILL of the trainer and of the rollout actor processes (Ray does not restart
them; the activities rebuild them: the trainer from its last checkpoint plus a replay of
the logged updates), SIGKILL of PPO's critic actor (rebuilt the same way), SIGKILL of the
Temporal dev server (restarted on its database), and a restart of the Ray head (every
actor lost at once).
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

from ratchet.platform.client import RECIPE_PATH, Client
from ratchet.platform.demo import start_worker_process, stop_worker_process
from ratchet.platform.services import ServiceSettings, down, free_ports, temporal_address, up

from ..configs import NO_TRACKER
from . import run_checks
from .run_checks import steps_recorded

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
            "loop.heartbeat_timeout_s=5", NO_TRACKER, *extra,
        ]  # fmt: skip

    # -- faults --------------------------------------------------------------------------

    def kill_worker(self) -> None:
        self.worker.kill()
        self.worker.wait()
        self.worker = start_worker_process(self.settings)

    def kill_actor(self, cls: str, wait_s: float = 30.0) -> bool:
        """SIGKILL one `cls` actor process of this module's Ray head (only its own: another
        test process may run a platform of its own beside this one); one being recreated
        after an earlier fault is waited for. False: none appeared within `wait_s`."""
        from ratchet.platform.services import ray_head

        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            ours = ray_head.pids(json.loads(self.settings.state_file.read_text())["services"]["ray"])
            for pid in ours:
                if run_checks.is_actor_process(_cmdline(pid), cls):
                    os.kill(pid, signal.SIGKILL)
                    return True
            time.sleep(0.1)
        return False

    def kill_temporal(self) -> None:
        rec = json.loads(self.settings.state_file.read_text())["services"]["temporal"]
        os.kill(rec["pid"], signal.SIGKILL)
        time.sleep(1.0)
        up(self.settings)  # the same ports and database file: the history survives

    def restart_ray(self) -> None:
        """The Ray head and every actor on it go; the worker process (a Ray driver) is
        restarted with it, as its supervisor would once its Ray connection is lost."""
        from ratchet.platform.services import restart_ray

        self.worker.kill()
        self.worker.wait()
        restart_ray(self.settings)  # the same port and token: the new worker joins with it
        self.worker = start_worker_process(self.settings)

    def close(self) -> None:
        stop_worker_process(self.worker)
        down(self.settings)
        if not os.environ.get("RATCHET_KEEP_TEST_STATE"):
            shutil.rmtree(self.state, ignore_errors=True)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# Every fault the injector knows, by name (`run_with_faults(kinds=...)` picks some).
FAULTS = ("trainer", "rollout", "worker", "temporal", "ray")


def inject(chaos: ChaosPlatform, run_dir: Path, seed: int, done: threading.Event, kinds: tuple[str, ...] = FAULTS) -> list[str]:
    """At seeded random steps (and a random moment inside the step), one of each of `kinds`:
    the trainer, rollout or critic actor, the worker process, the Temporal server, the Ray
    head."""
    rng = random.Random(seed)
    known = {
        "trainer": lambda: chaos.kill_actor("TrainerWorker"), "rollout": lambda: chaos.kill_actor("RolloutWorker"),
        "critic": lambda: chaos.kill_actor("CriticWorker"), "worker": chaos.kill_worker, "temporal": chaos.kill_temporal,
        "ray": chaos.restart_ray,
    }  # fmt: skip
    faults = [(name, known[name]) for name in kinds]
    at = sorted(rng.sample(range(1, STEPS - 1), len(faults)))
    rng.shuffle(faults)
    fired = []
    for step, (name, fault) in zip(at, faults):
        while steps_recorded(run_dir) < step and not done.is_set():
            time.sleep(0.05)
        if done.is_set():
            break
        time.sleep(rng.uniform(0.0, 0.4))
        if fault() is False:
            continue  # no such actor process appeared: not counted as fired
        fired.append(f"{name}@{step}")
    return fired


def run_with_faults(chaos: ChaosPlatform, name: str, extra: list[str], seed: int, kinds: tuple[str, ...] = FAULTS):
    handle = chaos.client.submit(RECIPE_PATH, chaos.overrides(*extra, f"tracking.name={name}"))
    run_dir = chaos.state / "runs" / handle.run_id
    done = threading.Event()
    fired: list[str] = []
    injector = threading.Thread(target=lambda: fired.extend(inject(chaos, run_dir, seed, done, kinds)), daemon=True)
    injector.start()
    try:
        summary = await_result(chaos, handle)
    finally:
        done.set()
        injector.join(60)
    return summary, run_dir, fired


def await_result(chaos: ChaosPlatform, handle, timeout: float = 600.0):
    """The run's result; the client reconnects while the Temporal server restarts."""
    from temporalio.client import WorkflowFailureError

    deadline = time.monotonic() + timeout
    while True:
        try:
            return chaos.client.get(handle.run_id).result(timeout=max(1.0, deadline - time.monotonic()))
        except WorkflowFailureError:
            raise  # the run itself failed: waiting longer shows nothing more
        except Exception:  # noqa: BLE001 - the server was killed under the long poll
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def check_exactly_once(summary, run_dir: Path, steps: int = STEPS) -> None:
    run_checks.check_exactly_once(summary, run_dir, steps, PROMPTS)
