"""A whole node dies and the run goes on: several Ray nodes on this machine (`up --nodes`),
each killed whole (its raylet, its actor processes and its ratchet worker, one SIGKILL of
its session) at seeded moments, with S3-protocol storage (a moto server) and no node-local
hand-over.

Three compute nodes of 2 CPUs: the run's trainer pool spreads 2 ranks (1 CPU each) over 2
nodes and its rollout pool takes 1 CPU anywhere, so the two left after any loss still hold
the run. Two worker nodes run a ratchet worker each and no actors (as deploy/ runs
workers). The faults, in a seeded order: the node holding the rollout engine, the node
holding one trainer rank, and the node whose worker runs the current activity (the
trainer's nodes live on: its ranks must be found again, not rebuilt); the sync run first
has a planned loss, `ratchet drain` of a trainer rank's node, which must replay nothing. A killed
node comes back a few seconds later (as a cluster manager would bring it back), rejoins
under its name and takes work again.

The run must finish by itself with every step recorded once and every prompt trained
once, and (deterministic mode) with final weights equal bit for bit to an undisturbed
run's. One run, in sync mode: what a lost node takes (the rollout engine, a trainer rank,
a worker) is what tests/e2e/test_chaos_async.py kills in fully_async mode, where the loop
mode's own recovery (the policy log, the queue) is shown; a second loop mode here would
repeat the node's part at twice the cost. The recovery time of each fault (from the kill to
the next recorded step) is printed and written to `<state>/recovery.json`.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from ratchet.platform.client import RECIPE_PATH, Client
from ratchet.platform.services import ServiceSettings, down, free_ports, node_record, ray_nodes, start_node, temporal_address, up
from ratchet.platform.services import processes

from ..configs import NO_TRACKER
from ..s3_server import ACCESS_KEY, REGION, SECRET_KEY, MotoServer
from . import run_checks
from .run_checks import assert_same_weights, steps_recorded

# A hang guard above the suite-wide 600 s: the test runs a clean and a faulted run on a
# cluster of five nodes, about 4-6 minutes on a loaded CI machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# Compute nodes (2 CPUs, no worker) and worker nodes (no CPUs, a ratchet worker each: the
# layout of deploy/, where workers run beside Ray nodes of their own).
COMPUTE_NODES, WORKER_NODES, STEPS, PROMPTS, N = 3, 2, 12, 4, 4
NODES = COMPUTE_NODES + WORKER_NODES
# The steps the faults wait for (each fires a seeded moment after its step is recorded);
# the sync run is drained first, at DRAIN_STEP, and loses its nodes after.
FAULT_STEPS, DRAIN_STEP = (2, 4, 6), 2
POOLS = (
    "resources.pools=[{name: train, nodes: 2, cpus_per_node: 1, roles: [trainer, reference]},"
    " {name: gen, nodes: 1, cpus_per_node: 1, roles: [rollout, reward]}]"
)
# The GCS notices a dead node after period x threshold (Ray's default is about 13 s).
# Eight missed checks (4 s), not Ray's 13 s, yet not so few that a live node on a loaded
# 2-core machine (CI runs two test processes at once) misses them and is taken for dead.
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "8"}
# How often the fault injector reads the run's step count: each read is an S3 GET served
# by the moto server inside this test process (about 17 ms of its CPU; at ten a second it
# was a sixth of the whole test's CPU). A fault then lands up to this much later in its
# step, which was never a fixed moment.
STEP_POLL_S = 0.5
AWS_ENV = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION}


class NodeRestart:
    """`start_node` in a thread of its own (the run goes on meanwhile), its error kept."""

    # A hang guard only: a node start is seconds on an idle machine and has taken minutes
    # on a loaded 2-core CI machine (three other nodes' actors importing torch beside it).
    WAIT_S = 600.0

    def __init__(self, settings: ServiceSettings, index: int):
        self.index, self.error = index, None
        self.thread = threading.Thread(target=self._start, args=(settings,), daemon=True)
        self.thread.start()

    def _start(self, settings: ServiceSettings) -> None:
        try:
            start_node(settings, self.index)
        except BaseException as exc:  # noqa: BLE001 - surfaced by wait()
            self.error = exc

    def wait(self) -> None:
        self.thread.join(self.WAIT_S)
        assert not self.thread.is_alive(), f"node {self.index} did not come back within {self.WAIT_S:.0f} s"
        assert self.error is None, f"node {self.index} failed to start again: {self.error!r}"


class Cluster:
    """Temporal, a Ray head without CPUs, `NODES` nodes with a worker each, and an S3 server."""

    def __init__(self, assets):
        self.assets = assets
        self.s3 = MotoServer()
        self.s3.start()
        env = {**FAST_NODE_DEATH, **AWS_ENV, "AWS_ENDPOINT_URL": self.s3.endpoint, "RATCHET_STICKY_TIMEOUT_S": "1"}
        self.saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the head, the nodes and their workers inherit it
        from minio import Minio

        Minio(f"127.0.0.1:{self.s3.port}", access_key=ACCESS_KEY, secret_key=SECRET_KEY, secure=False, region=REGION).make_bucket("runs")
        self.state = Path(tempfile.mkdtemp(dir="/tmp", prefix="rt-nodes-"))
        t, ui, r = free_ports(3)
        self.settings = ServiceSettings(
            state_dir=self.state,
            temporal_port=t,
            temporal_ui_port=ui,
            ray_port=r,
            start_timeout_s=300.0,
            nodes=COMPUTE_NODES,
            node_cpus=2.0,
            node_workers=False,
            worker_nodes=WORKER_NODES,
        )
        up(self.settings)
        self.client = Client.connect(temporal_address(self.settings))
        self.restarting: dict[int, NodeRestart] = {}  # node index -> its restart
        self.drained: list[int] = []  # drained nodes, replaced once the run ends

    def overrides(self, *extra: str) -> list[str]:
        train, _ = self.assets.data["copy"]
        return [
            f"model.path={self.assets.model}", f"data.train_files={train}", "data.eval_files=null", "storage.root=s3://runs/nodes",
            "warmup.steps=2", f"loop.prompts_per_step={PROMPTS}", f"rollout.n={N}", f"loop.steps={STEPS}", "checkpoint.every=3",
            "deterministic=true", "loop.heartbeat_timeout_s=5", "trainer.world_size=2", POOLS, NO_TRACKER, *extra,
        ]  # fmt: skip

    def run_uri(self, run_id: str) -> str:
        return f"s3://runs/nodes/{run_id}"

    # -- which node holds what -----------------------------------------------------------

    def record(self, index: int) -> dict:
        rec = node_record(self.settings, index)
        assert rec is not None
        return rec

    def nodes_running(self, actor_class: str) -> list[int]:
        """The nodes with an `actor_class` actor process (one entry per actor)."""
        found = []
        for index in range(1, NODES + 1):
            for pid in ray_nodes.pids(self.record(index)):
                if run_checks.is_actor_process(" ".join(processes.cmdline(pid)), actor_class):
                    found.append(index)
        return found

    def nodes_running_activities(self, probe: Client, run_id: str) -> list[int]:
        """The nodes whose workers run one of the run's activities now. `probe`: a client of
        the calling thread's own (a client's event loop is not shared)."""
        desc = probe._run(probe.get(run_id)._handle().describe())
        found = []
        for pending in desc.raw_description.pending_activities:
            match = re.match(r"node-(\d+)/", pending.last_worker_identity or "")
            if match and pending.state == 2:  # PENDING_ACTIVITY_STATE_STARTED
                found.append(int(match.group(1)))
        return found

    # -- the fault -----------------------------------------------------------------------

    def kill_node(self, index: int) -> None:
        """Kill node `index` whole; it comes back (a new Ray node, same name) as soon as it
        can. Another node may still be coming back: the run then waits for it."""
        if index in self.restarting:
            self.restarting.pop(index).wait()
        ray_nodes.kill(self.record(index))
        self.restarting[index] = NodeRestart(self.settings, index)

    def nodes_back(self) -> None:
        """Wait for every restart begun, however slow the machine: a node that is not back
        when the test looks for it must be a failed start (raised here), never a slow one."""
        for restart in self.restarting.values():
            restart.wait()
        self.restarting.clear()

    def replace_node(self, index: int) -> None:
        """Node `index` goes and a new one takes its place (a drained node is never undrained)."""
        self.kill_node(index)
        self.nodes_back()

    def rebuilds(self, run_id: str) -> int:
        """How often the run's trainer was rebuilt (every node's worker logs it)."""
        text = "".join(p.read_text(errors="replace") for p in self.settings.logs_dir.glob("node-*.log"))
        return len(re.findall(rf"run {run_id}: trainer rebuilt at", text))

    def close(self) -> None:
        self.nodes_back()
        self.client.close()
        down(self.settings)
        self.s3.stop()
        for k, v in self.saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        if not os.environ.get("RATCHET_KEEP_TEST_STATE"):
            shutil.rmtree(self.state, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(assets):
    c = Cluster(assets)
    try:
        yield c
    finally:
        c.close()


def _result(cluster: Cluster, run_id: str, timeout: float = 600.0):
    return cluster.client.get(run_id).result(timeout=timeout)


def inject(cluster: Cluster, run_id: str, seed: int, done: threading.Event, fired: list[dict], drain: bool) -> None:
    """With `drain`, first `ratchet drain` of a trainer rank's node (a planned loss); then at
    seeded steps: the rollout node, a trainer rank's node, the current activity's worker node."""
    rng = random.Random(seed)
    run = cluster.run_uri(run_id)
    probe = Client.connect(temporal_address(cluster.settings))
    seen = 0

    def steps() -> int:  # never back: a read that fails while a node dies is no step lost
        nonlocal seen
        seen = max(seen, steps_recorded(run))
        return seen

    kinds = ["rollout", "trainer", "worker"]
    rng.shuffle(kinds)
    try:
        if drain:
            while steps() < DRAIN_STEP and not done.is_set():
                time.sleep(STEP_POLL_S)
            fired.append(drain_trainer_node(cluster, run_id, probe))
        for step, kind in zip((s + DRAIN_STEP if drain else s for s in FAULT_STEPS), kinds):
            while steps() < step and not done.is_set():
                time.sleep(STEP_POLL_S)
            if done.is_set():
                return
            time.sleep(rng.uniform(0.0, 0.4))
            if kind in ("rollout", "trainer"):
                # (An actor being recreated after the last fault has no process for a moment.)
                actor = "RolloutWorker" if kind == "rollout" else "TrainerWorker"
                while not (holding := cluster.nodes_running(actor)) and not done.is_set():
                    time.sleep(0.1)
                if not holding:
                    return
                index = rng.choice(holding)
            else:
                index = _node_of_an_activity(cluster, probe, run_id, done)
                if index is None:
                    return
            before = steps()
            t0 = time.monotonic()
            holds_trainer = index in cluster.nodes_running("TrainerWorker")
            cluster.kill_node(index)
            while steps() <= before and not done.is_set():
                time.sleep(STEP_POLL_S)
            fired.append({"fault": kind, "step": before, "node": index, "holds_trainer": holds_trainer,
                          "to_next_step_s": round(time.monotonic() - t0, 1)})  # fmt: skip
    finally:
        probe.close()


def drain_trainer_node(cluster: Cluster, run_id: str, probe: Client) -> dict:
    """`ratchet drain` (the CLI, in a process of its own: it leaves through os._exit) of a
    node holding a trainer rank. The run is paused until the drain is in its history: the
    CLI takes seconds to start and join the cluster, in which the run's steps (a fraction of
    a second each) would otherwise use up the steps the node losses after it need."""
    from ratchet.platform.services import ray_address, ray_auth_env

    handle = probe.get(run_id)
    handle.pause()
    while not (holding := cluster.nodes_running("TrainerWorker")):
        time.sleep(0.1)  # a rank still being rebuilt after the last fault
    index, before, t0 = holding[0], steps_recorded(cluster.run_uri(run_id)), time.monotonic()
    env = {**os.environ, "RATCHET_RAY_ADDRESS": ray_address(cluster.settings),
           "RATCHET_TEMPORAL_ADDRESS": temporal_address(cluster.settings), **ray_auth_env(cluster.settings)}  # fmt: skip
    cli = subprocess.Popen(
        [str(Path(sys.executable).parent / "ratchet"), "drain", f"node-{index}", "--wait-s", "120"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        while cli.poll() is None and not _signalled(probe, run_id, "drain"):
            time.sleep(0.2)
    finally:
        handle.resume()  # it moves off at the boundary it is paused at
    output, _ = cli.communicate(timeout=300)
    cluster.drained.append(index)  # Ray shuts a drained node down once idle; replaced after the run
    return {"fault": "drain", "step": before, "node": index, "holds_trainer": True, "exit_code": cli.returncode,
            "output": output, "moved_off_s": round(time.monotonic() - t0, 1)}  # fmt: skip


def _signalled(probe: Client, run_id: str, name: str) -> bool:
    """Whether signal `name` is in the run's history."""
    history = probe._run(probe.get(run_id)._handle().fetch_history())
    return any(
        e.HasField("workflow_execution_signaled_event_attributes") and e.workflow_execution_signaled_event_attributes.signal_name == name
        for e in history.events
    )


def _node_of_an_activity(cluster: Cluster, probe: Client, run_id: str, done: threading.Event) -> int | None:
    """The node of the worker running the run's current activity (Temporal dispatches a
    run's activities to the worker that holds the workflow, eagerly)."""
    while not done.is_set():
        running = cluster.nodes_running_activities(probe, run_id)
        if running:
            return running[0]
        time.sleep(0.1)
    return None


def run_with_node_faults(cluster: Cluster, name: str, extra: list[str], seed: int, *, drain: bool = False):
    handle = cluster.client.submit(RECIPE_PATH, cluster.overrides(*extra, f"tracking.name={name}"))
    done = threading.Event()
    fired: list[dict] = []
    injector = threading.Thread(target=inject, args=(cluster, handle.run_id, seed, done, fired, drain), daemon=True)
    injector.start()
    try:
        summary = _result(cluster, handle.run_id)
    finally:
        done.set()
        injector.join(120)
    print(f"\n{name}: " + json.dumps([{k: v for k, v in f.items() if k != "output"} for f in fired]))
    with open(cluster.state / "recovery.json", "a") as f:
        f.write(json.dumps({"run": name, "faults": fired}) + "\n")
    return summary, handle.run_id, fired


def check_node_run(cluster: Cluster, clean, summary, run_id: str, fired: list[dict], *, drained: bool = False) -> None:
    assert sorted(f["fault"] for f in fired) == sorted(["rollout", "trainer", "worker", *(["drain"] if drained else [])]), fired
    run_checks.check_exactly_once(summary, cluster.run_uri(run_id), STEPS, PROMPTS)
    assert_same_weights(clean, summary, [f"{f['fault']}@{f['step']}" for f in fired])
    # Rebuilt for each lost node that held a trainer rank only: the worker's node (and a
    # rollout node without a rank) leaves the ranks alive, and the next attempt finds them.
    assert cluster.rebuilds(run_id) == sum(f["holds_trainer"] for f in fired), fired
    assert not next(f for f in fired if f["fault"] == "worker")["holds_trainer"], fired
    # Every node comes back and rejoins.
    cluster.nodes_back()
    assert all(ray_nodes.pids(cluster.record(i)) for i in range(1, NODES + 1))


def test_sync_run_survives_the_loss_of_each_kind_of_node_and_a_drain(cluster):
    """`ratchet drain` of a trainer rank's node, then the three losses. The drain: the run checkpoints
    at its next step boundary, its trainer pool is reserved again on the other nodes, and
    the ranks are rebuilt from that checkpoint with 0 updates replayed."""
    clean = _result(cluster, cluster.client.submit(RECIPE_PATH, cluster.overrides("tracking.name=clean-sync")).run_id)
    summary, run_id, fired = run_with_node_faults(cluster, "nodes-sync", [], seed=11, drain=True)
    drained = fired[0]
    assert drained["exit_code"] == 0, drained["output"]
    assert f"told: {run_id}" in drained["output"] and "every run moved off it" in drained["output"], drained["output"]
    while cluster.drained:  # a drained node is never undrained: it goes and a new one comes
        cluster.replace_node(cluster.drained.pop())
    check_node_run(cluster, clean, summary, run_id, fired, drained=True)
    logs = "".join(p.read_text(errors="replace") for p in cluster.settings.logs_dir.glob("node-*.log"))
    assert re.search(rf"run {run_id}: trainer rebuilt at v(\d+) from checkpoint step-0*\1 and 0 replayed updates", logs), logs[-3000:]
