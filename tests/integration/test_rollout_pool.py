"""Rollout replicas on real Ray (the platform's, one cluster for the suite), on CPU: a batch
spread over 2 replicas in whole groups stores the batch one replica stores; a weight sync
leaves both at one version; a replica killed during a batch is recreated and its share
redone; a resource pool is a placement group that holds the run's actors."""

from __future__ import annotations

import logging

import pytest
import torch

from ratchet.config import load_config
from ratchet.platform.client import RECIPE_PATH
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.object_store import ObjectStore
from ratchet.workers.batch import RolloutBatch

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled, )?unavailable or uninitialized")

PROMPTS, N = 6, 4
# A tiny run with room for 2 replicas and a trainer on a 2-core Ray.
TINY = [
    "warmup.steps=0", "data.eval_files=null", f"loop.prompts_per_step={PROMPTS}", f"rollout.n={N}",
    "rollout.max_response_length=8", "resources.trainer_cpus=0.25", "resources.rollout_cpus=0.25", "seed=3",
]  # fmt: skip
TENSORS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "policy_version", "prompt_index")


def run_actors(platform, tmp_path, run_id: str, *extra: str):
    from ratchet.workers.actors import RunActors

    cfg = load_config(RECIPE_PATH, platform.overrides(*TINY, *extra))
    return RunActors(run_id, str(tmp_path / run_id), cfg)


@pytest.fixture(scope="module")
def one_replica_batch(platform, ray_driver, tmp_path_factory):
    """Batch 0 (and batch 1, prompts from 5) as one replica stores them."""
    from ratchet.workers.actors import release_run_actors

    actors = run_actors(platform, tmp_path_factory.mktemp("one"), "pool-one")
    try:
        actors.rollout.start(str(platform.assets.model))
        assert actors.rollout.generate(0, 0, PROMPTS, 0).num_samples == PROMPTS * N
        assert actors.rollout.generate(1, 5, PROMPTS, 0).num_samples == PROMPTS * N
        store = BatchStore(ObjectStore(actors.run_uri))
        return RolloutBatch.load(store, 0), RolloutBatch.load(store, 1)
    finally:
        release_run_actors("pool-one")


def assert_same_batch(got: RolloutBatch, want: RolloutBatch) -> None:
    for name in TENSORS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    # The log-probs of one row come from forwards of other batch shapes: float rounding only.
    torch.testing.assert_close(got.rollout_logprobs, want.rollout_logprobs, rtol=0, atol=1e-5)
    assert got.samples == want.samples


def test_two_replicas_store_the_one_replica_batch_and_serve_one_version(platform, ray_driver, tmp_path, one_replica_batch):
    from ratchet.workers.actors import Role, release_run_actors

    actors = run_actors(platform, tmp_path, "pool-two", "rollout.replicas=2")
    try:
        replicas = actors.rollout.start(str(platform.assets.model))
        assert [a._actor_id for a in replicas] == [actors.find(Role.ROLLOUT, r)._actor_id for r in (0, 1)]
        # Spread: one contiguous share per replica, whole prompts, in batch order.
        shares = ray_driver.get(actors.rollout.generate_shares(0, 0, PROMPTS, 0))
        assert len(shares) == 2
        want = one_replica_batch[0].prompt_index.tolist()
        assert [s.batch.prompt_index.tolist() for s in shares] == [want[: 3 * N], want[3 * N :]]
        assert all(len(set(want[g * N : (g + 1) * N])) == 1 for g in range(PROMPTS)), "a group's n rows are one prompt"
        # Stored: the rows, tokens and seeds of the one-replica batch.
        out = actors.rollout.generate(0, 0, PROMPTS, 0)
        assert out.num_samples == PROMPTS * N and out.policy_version == 0
        store = BatchStore(ObjectStore(actors.run_uri))
        assert_same_batch(RolloutBatch.load(store, 0), one_replica_batch[0])

        # One update; a replica lost between batches is recreated, and both are brought to
        # v1 (the trainer's weights gathered once for both) before they serve.
        actors.trainer.start(str(platform.assets.model))
        actors.reward.score(0)
        ranks = actors.trainer.at_version(0)
        assert ray_driver.get([a.train.remote(0, 0, 0.0, 1) for a in ranks])[0].policy_version == 1
        ray_driver.kill(actors.find(Role.ROLLOUT, 1), no_restart=True)
        again = actors.rollout.replicas(1)
        assert again[0]._actor_id == replicas[0]._actor_id and again[1]._actor_id != replicas[1]._actor_id
        assert ray_driver.get([a.policy_version.remote() for a in again]) == [1, 1]
        # Another update (the same batch, v1 -> v2), then a weight sync: both serve v2.
        assert ray_driver.get([a.train.remote(0, 1, 0.0, 1) for a in ranks])[0].policy_version == 2
        actors.sync_weights(2)
        assert ray_driver.get([a.policy_version.remote() for a in actors.rollout.replicas()]) == [2, 2]
    finally:
        release_run_actors("pool-two")


def test_a_replica_answers_its_version_probe_while_it_generates(platform, ray_driver, tmp_path):
    """A step probes its replicas' versions while they still generate the batch prefetched
    for it. The probe runs on a thread of its own (`rollout.PROBE_GROUP`), so it answers at
    once rather than after the generation, and the step's request for the batch is queued
    right behind the generation."""
    import time

    from ratchet.workers.actors import release_run_actors

    actors = run_actors(platform, tmp_path, "pool-probe")
    try:
        (replica,) = actors.rollout.start(str(platform.assets.model))
        assert ray_driver.get(replica.policy_version.remote()) == 0  # constructed
        busy = replica.__ray_call__.remote(lambda worker: time.sleep(4.0))  # the thread a generation runs on
        assert ray_driver.get(replica.policy_version.remote(), timeout=2.0) == 0
        assert ray_driver.wait([busy], timeout=0)[0] == [], "answered only once the busy thread was done"
        ray_driver.get(busy)
    finally:
        release_run_actors("pool-probe")


def test_replica_killed_during_a_batch_is_recreated_and_its_share_redone(platform, ray_driver, tmp_path, one_replica_batch, caplog):
    """Replica 1 is killed right after the batch's shares were sent (the first wait on
    them); the batch is the one-replica batch all the same, and replica 1 is a new actor
    serving the pool's version."""
    from ratchet.workers.actors import PlainWaiter, Role, release_run_actors
    from ratchet.workers.actors.rollout_group import RolloutGroup

    class KillOnFirstWait(PlainWaiter):
        victim = None

        def wait(self, refs, *, timeout_s=None):
            if self.victim is not None:
                victim, self.victim = self.victim, None
                ray_driver.kill(victim, no_restart=True)
            return super().wait(refs, timeout_s=timeout_s)

    class KillDuringBatch(RolloutGroup):
        def _run(self, batch_index, part, version, exact, replicas, todo, done):
            if not getattr(self, "armed", False):
                self.armed = True
                self.run.waiter.victim = replicas[1]
            return super()._run(batch_index, part, version, exact, replicas, todo, done)

    actors = run_actors(platform, tmp_path, "pool-kill", "rollout.replicas=2")
    actors.waiter = KillOnFirstWait()
    try:
        first = actors.rollout.start(str(platform.assets.model))
        ray_driver.get([a.policy_version.remote() for a in first])
        with caplog.at_level(logging.WARNING, logger="ratchet.workers.actors.rollout_group"):
            refs = KillDuringBatch(actors, actors.trainer).generate_shares(1, 5, PROMPTS, 0)
        assert any("lost during batch 1; redoing 3 prompts on replica(s) [0]" in r.getMessage() for r in caplog.records)
        out = ray_driver.get(actors.rollout.replicas(0)[0].save_shares.remote(1, 0, *refs))
        assert out.num_samples == PROMPTS * N
        assert_same_batch(RolloutBatch.load(BatchStore(ObjectStore(actors.run_uri)), 1), one_replica_batch[1])
        # Recreated meanwhile: a new actor, at the version the others serve.
        again = actors.rollout.replicas(0)
        assert again[1]._actor_id != first[1]._actor_id and again[0]._actor_id == first[0]._actor_id
        assert ray_driver.get([a.policy_version.remote() for a in again]) == [0, 0]
        assert actors.find(Role.ROLLOUT, 1)._actor_id == again[1]._actor_id
    finally:
        release_run_actors("pool-kill")


def test_pool_is_a_placement_group_holding_the_actors_and_released_with_them(platform, ray_driver, tmp_path):
    """A CPU pool for every role: its placement group reserves the pool's CPUs, the actors
    run inside it, and releasing the run removes it. A pool bigger than the cluster is
    refused before anything is reserved, naming the field."""
    from ray.util import placement_group_table

    from ratchet.errors import ResourcesUnavailable
    from ratchet.workers.actors import release_run_actors
    from ratchet.workers.actors.names import run_pool_groups

    pool = ["resources.pools=[{name: all, cpus_per_node: 1, roles: [trainer, rollout, reward, reference]}]", "rollout.replicas=2"]
    actors = run_actors(platform, tmp_path, "pool-pg", *pool)
    try:
        actors.check_resources(settle_s=1.0)
        groups = run_pool_groups("pool-pg")
        assert list(groups) == ["pool-pg/pool-all"]
        table = placement_group_table(groups["pool-pg/pool-all"])
        assert table["state"] == "CREATED" and table["bundles"] == {0: {"CPU": 1.0}}
        replicas = actors.rollout.start(str(platform.assets.model))
        assert ray_driver.get([a.policy_version.remote() for a in replicas]) == [0, 0]
        assert actors.plan.colocated and [actors.plan.slot("rollout", r).cpus for r in (0, 1)] == [0.25, 0.25]
        # Colocated: a batch, then the engines asked to sleep (the HF engine's sleep frees
        # nothing on CPU) and woken up again: they still serve their version.
        assert actors.rollout.generate(0, 0, PROMPTS, 0).num_samples == PROMPTS * N
        assert ray_driver.get([a.sleep.remote() for a in replicas]) == [True, True]
        assert ray_driver.get([a.wake_up.remote() for a in replicas]) == [True, True]
        assert ray_driver.get([a.policy_version.remote() for a in replicas]) == [0, 0]
    finally:
        release_run_actors("pool-pg")
    assert run_pool_groups("pool-pg") == {}

    total = ray_driver.cluster_resources()["CPU"]
    big = run_actors(
        platform,
        tmp_path,
        "pool-big",
        f"resources.pools=[{{name: big, nodes: 1, cpus_per_node: {total + 1:g}, roles: [trainer, rollout, reward, reference]}}]",
    )
    with pytest.raises(ResourcesUnavailable) as info:
        big.check_resources(settle_s=0.0)
    assert f"pool 'big' (resources.pools.0) needs {total + 1:g} CPUs but the cluster has {total:g}" in str(info.value)
    assert run_pool_groups("pool-big") == {}


def test_run_goes_on_when_a_replica_is_killed(platform, ray_driver):
    """A real run (Temporal, the worker process, 2 replicas on split resource pools;
    one_step_off, whose batches go through the `generate` activity): replica 1 is killed
    after the first step and the run ends all its steps, the replica recreated in its
    pool (the worker's log says where: inside the batch that lost it, or at the next
    batch's or weight sync's check of the replicas), and the pools are released with the run."""
    import json

    from ratchet.workers.actors.names import find_named, run_pool_groups
    from tests.polling import wait_until

    steps = 3
    handle = platform.client.submit(
        RECIPE_PATH,
        platform.overrides(
            *TINY, "rollout.replicas=2", f"loop.steps={steps}", "loop.mode=one_step_off", "tracking.name=replicas",
            "resources.pools=[{name: train, cpus_per_node: 0.5, roles: [trainer, reference]}, "
            "{name: generate, cpus_per_node: 1, roles: [rollout, reward]}]",
        ),
    )  # fmt: skip
    run_dir = platform.runs_root / handle.run_id
    metrics = run_dir / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, timeout=300)
    victim = find_named(f"{handle.run_id}/rollout-1")
    assert victim is not None
    assert sorted(run_pool_groups(handle.run_id)) == [f"{handle.run_id}/pool-generate", f"{handle.run_id}/pool-train"]
    ray_driver.kill(victim, no_restart=True)
    handle.result(timeout=600)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(steps))
    log = (platform.settings.state_dir / "logs" / "worker.log").read_text(errors="replace")
    said = [line for line in log.splitlines() if f"run {handle.run_id}: rollout replica" in line]
    assert any("recreating it" in line or "lost during batch" in line for line in said), said
    wait_until(lambda: run_pool_groups(handle.run_id) == {}, timeout=60)
