"""Faults on the worker side, with the real parts: leaked actors swept and free CPUs
checked (real Ray + Temporal), checkpoint uploads that fail (the run fails naming the
checkpoint), NaN rewards, a reward function that raises or hangs, errors Ray wraps
classified by their cause, a retried start_workers, and a resume with a new lr."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from ratchet.config.schema import RunConfig
from ratchet.models.tiny import VOCAB
from ratchet.platform.client import RECIPE_PATH
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.checkpoint_store import CheckpointStore
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout
from ratchet.workers.batch import RolloutBatch, save_scores
from ratchet.workers.results import CheckpointOutcome
from ..polling import wait_until

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled, )?unavailable or uninitialized")

PAD, BOS = VOCAB.index("<pad>"), VOCAB.index("<bos>")
DIGITS = [VOCAB.index(str(d)) for d in range(10)]
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.25, 0.0])
# A tiny run that leaves CPUs to spare on a 2-core Ray.
TINY = ["warmup.steps=0", "data.eval_files=null", "loop.prompts_per_step=4", "rollout.n=2", "resources.trainer_cpus=0.5",
        "resources.rollout_cpus=0.5"]  # fmt: skip


def make_cfg(model_path, **trainer) -> RunConfig:
    return RunConfig.model_validate(
        {
            "seed": 0,
            "model": {"path": str(model_path)},
            "data": {"train_files": "unused.parquet"},
            "rollout": {"n": 4, "max_response_length": 6},
            "trainer": {"lr": 1e-3, "micro_batch_size": 4, **trainer},
        }
    )


def stored_step(run: ObjectStore) -> None:
    g = torch.Generator().manual_seed(0)
    digits = torch.tensor(DIGITS)
    prompt = digits[torch.randint(0, 10, (8, 6), generator=g)]
    prompt[:, 0] = BOS
    batch = RolloutBatch(
        prompt_ids=prompt,
        prompt_mask=torch.ones(8, 6, dtype=torch.long),
        response_ids=digits[torch.randint(0, 10, (8, 6), generator=g)],
        response_mask=torch.ones(8, 6),
        rollout_logprobs=-2.0 - torch.rand(8, 6, generator=g),
        policy_version=torch.zeros(8, 6, dtype=torch.long),
        prompt_index=torch.tensor([0] * 4 + [1] * 4),
        samples=[{}] * 8,
    )
    store = BatchStore(run)
    batch.save(store, 0)
    save_scores(store, 0, REWARDS, [{}] * 8)


def trainer_worker(tiny_model, run: ObjectStore, **trainer):
    from ratchet.workers.trainer import TrainerWorker

    worker = TrainerWorker(make_cfg(tiny_model, **trainer), str(tiny_model), run.url, 0, 1)
    worker.setup(0)
    return worker


# --------------------------------------------------------------------------- in-process


def test_failed_checkpoint_upload_is_kept_until_reported_and_redone(tiny_model, tmp_path):
    """A file where the checkpoints folder should be makes every upload fail (root is not
    stopped by file modes, a file in the way is)."""
    run = ObjectStore(str(tmp_path / "run"))
    stored_step(run)
    blocker = tmp_path / "run" / "checkpoints"
    blocker.write_text("in the way")
    worker = trainer_worker(tiny_model, run)
    worker.train(0, 0, 0.0)
    worker.start_checkpoint(1, {"next_step": 1})
    first = worker.wait_checkpoint().error
    assert first and first.startswith("checkpoint step-00000001 failed on trainer rank 0:")
    assert worker.wait_checkpoint().error == first, "the failure stays until another checkpoint replaces it"
    again = worker.redo_checkpoint()
    assert again.error and not again.impossible
    blocker.unlink()  # storage is back: the redo commits the same checkpoint
    assert worker.redo_checkpoint() == CheckpointOutcome(error=None, impossible=False)
    assert [c.name for c in CheckpointStore(run).list()] == ["step-00000001"]
    # Once the trainer trained on, the failed state is gone: a redo says so.
    (tmp_path / "run" / "checkpoints").rename(tmp_path / "kept")
    blocker.write_text("in the way")
    worker.start_checkpoint(2, {"next_step": 2})
    worker.wait_checkpoint()
    worker.train(0, 1, 0.0)  # the stored step once more, as update v1 -> v2
    out = worker.redo_checkpoint()
    assert out.impossible and out.error.startswith("checkpoint step-00000002 failed (checkpoint step-00000002 failed on")
    assert out.error.endswith("cannot be taken again: the trainer has trained on from v1 to v2")


def test_resume_applies_the_configs_optimizer_settings(tiny_model, tmp_path):
    """A checkpoint's param_groups hold the lr it trained with; the loading run's config wins.
    The checkpoint takes the product's path: start_checkpoint commits it, and it is
    downloaded and restored as recovery does."""
    run = ObjectStore(str(tmp_path / "run"))
    stored_step(run)
    first = trainer_worker(tiny_model, run, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99))
    first.train(0, 0, 0.0)
    assert first.start_checkpoint(1, {"next_step": 1}, foreground=True).error is None
    assert run.get_json("train_log/v00000000.json")["optimizer"] == {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.0}
    CheckpointStore(run).download("step-00000001", tmp_path / "ckpt")
    resumed = trainer_worker(tiny_model, ObjectStore(str(tmp_path / "run2")), lr=1e-6, weight_decay=0.1, betas=(0.8, 0.9))
    assert resumed.restore(str(tmp_path / "ckpt")) == 1
    from ratchet.workers.checkpointing import read_meta

    saved = read_meta(tmp_path / "ckpt" / RunLayout.TRAINER_STATE)["param_groups"][0]
    assert (saved["lr"], saved["weight_decay"], saved["betas"]) == (1e-3, 0.0, [0.9, 0.99])  # what the checkpoint holds
    group = resumed.trainer.optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (1e-6, 0.1, (0.8, 0.9))
    # A replay (recovery) uses the settings the logged update used, then the config's again.
    logged = run.get_json("train_log/v00000000.json")["optimizer"]
    stored_step(ObjectStore(str(tmp_path / "run2")))
    resumed.trainer.version = 0
    resumed.train(0, 0, 0.0, 1, logged)
    assert resumed.trainer.optimizer.param_groups[0]["lr"] == 1e-3


def test_setup_twice_does_not_rebuild(tiny_model, tmp_path):
    worker = trainer_worker(tiny_model, ObjectStore(str(tmp_path / "run")))
    trainer = worker.trainer
    assert worker.setup(0) == trainer.num_parameters() and worker.trainer is trainer


# --------------------------------------------------------------------------- real Ray and Temporal


def failure_text(exc: BaseException) -> str:
    parts = []
    while exc is not None:
        kind = getattr(exc, "type", None)
        parts.append((f"[{kind}] " if isinstance(kind, str) else "") + str(getattr(exc, "message", "") or exc))
        exc = exc.__cause__ or getattr(exc, "cause", None)
    return " | ".join(parts)


def run_fails(handle, timeout: float = 600) -> str:
    from temporalio.client import WorkflowFailureError

    with pytest.raises(WorkflowFailureError) as info:
        handle.result(timeout=timeout)
    return failure_text(info.value)


def attempts(handle, activity_type: str) -> list[int]:
    """Per scheduled activity, the attempt that ran last (Temporal records only that one's start)."""
    from temporalio.api.enums.v1 import EventType

    events = handle.history().events
    scheduled = {
        e.event_id
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == activity_type
    }
    return [
        e.activity_task_started_event_attributes.attempt
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
        and e.activity_task_started_event_attributes.scheduled_event_id in scheduled
    ]


def reward_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "bad_reward.py"
    head = "import math, os, time\n\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    path.write_text(head + body)
    return f"reward.function={path}:compute_score"


def test_actor_errors_are_classified_by_their_cause(ray_driver):
    from temporalio.exceptions import ApplicationError

    from ratchet.activities.ray_calls import wait
    from ratchet.config import ConfigError
    from ratchet.tasks.loading import RewardLoadError

    ray = ray_driver

    @ray.remote(num_cpus=0)
    class Raises:
        def config(self):
            raise ConfigError([("reward.timeout_s", "must be finite")])

        def transient(self):
            raise ConnectionError("storage hiccup")

    @ray.remote(num_cpus=0)
    class BrokenInit:
        def __init__(self):
            raise RewardLoadError("file not found: /nowhere/reward.py")

        def ping(self):
            return 1

    actor = Raises.remote()
    with pytest.raises(ApplicationError) as info:
        wait(actor.config.remote())
    assert info.value.type == "ConfigError" and info.value.non_retryable
    assert "reward.timeout_s: must be finite" in info.value.message
    with pytest.raises(ray.exceptions.RayTaskError) as transient:  # not a domain error: retryable, as it was
        wait(actor.transient.remote())
    assert isinstance(transient.value, ConnectionError)
    with pytest.raises(ApplicationError) as info:
        wait(BrokenInit.remote().ping.remote())
    assert info.value.type == "RewardLoadError" and info.value.non_retryable and "/nowhere/reward.py" in info.value.message
    ray.kill(actor, no_restart=True)

    def dead() -> bool:  # the kill is asynchronous: a call sent just after may still run
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            pass
        return False

    wait_until(dead, timeout=30)
    with pytest.raises(ray.exceptions.RayActorError):  # an actor that died: retryable
        wait(actor.config.remote())


def test_check_resources_refuses_when_other_runs_hold_the_cpus(platform, ray_driver):
    from ratchet.activities.translate import domain_error
    from ratchet.config import load_config
    from ratchet.errors import ResourcesUnavailable
    from ratchet.workers.actors import NAMESPACE, RunActors

    ray = ray_driver

    @ray.remote
    class Hog:
        def ping(self):
            return 1

    free = ray.available_resources().get("CPU", 0.0)
    assert free >= 1.0, f"another test left actors holding CPUs: {ray.util.list_named_actors(all_namespaces=True)}"
    hog = Hog.options(name="other-run/trainer-0", namespace=NAMESPACE, lifetime="detached", num_cpus=free).remote()
    try:
        ray.get(hog.ping.remote())
        wait_until(lambda: ray.available_resources().get("CPU", 0.0) < 0.5, timeout=30)  # the view catches up
        cfg = load_config(RECIPE_PATH, platform.overrides(*TINY))
        with pytest.raises(ResourcesUnavailable) as info:
            RunActors("needs-cpus", str(platform.runs_root / "needs-cpus"), cfg).check_resources(settle_s=1.0)
        text = str(info.value)
        failure = domain_error(info.value)  # what the activity fails with
        assert failure.type == "ResourcesUnavailable" and failure.non_retryable and failure.message == text
        assert "needs 1 Ray CPUs" in text and "run other-run: other-run/trainer-0" in text
        assert "ratchet stop RUN" in text and "resources.trainer_cpus" in text
    finally:
        ray.kill(hog)


def test_retried_start_trainers_reuses_the_process_group(platform, ray_driver, tmp_path):
    """start_workers' actor logic twice with 2 ranks: no second init_process_group, and the
    group still works (an unsharding collective)."""
    from ratchet.config import load_config
    from ratchet.workers.actors import Role, RunActors, release_run_actors

    cfg = load_config(RECIPE_PATH, platform.overrides(*TINY, "trainer.world_size=2"))
    actors = RunActors("pg-retry", str(tmp_path / "pg-retry"), cfg)
    try:
        count = actors.trainer.start(str(platform.assets.model))
        assert actors.trainer.start(str(platform.assets.model)) == count > 0
        ranks = [actors.find(Role.TRAINER, r) for r in range(2)]
        infos = ray_driver.get([a.setup_info.remote() for a in ranks])
        assert [i.process_group_inits for i in infos] == [1, 1]
        state = ray_driver.get([a.__ray_call__.remote(_unsharded_sizes) for a in ranks])
        assert state[0] == state[1] == count
    finally:
        release_run_actors("pg-retry")


def test_two_activities_that_find_the_trainer_gone_rebuild_it_once(platform, ray_driver, tmp_path, monkeypatch):
    """fully_async overlaps a sync with the next update: both find a dead trainer at once.
    Each rebuild starts by killing the ranks it finds, so two rebuilders used to kill each
    other's half-built ranks until both ran out of retries. With the run's restore lease
    one rebuilds and the other waits, looks again and uses the rebuilt ranks."""
    import threading

    from ratchet.config import load_config
    from ratchet.workers.actors import Role, RunActors, recovery, release_run_actors
    from ratchet.workers.actors.names import kill_named

    cfg = load_config(RECIPE_PATH, platform.overrides(*TINY))
    actors = RunActors("lease-run", str(tmp_path / "lease-run"), cfg)
    rebuilds = []
    real_restore = recovery.restore_trainers

    def counted_restore(run_actors, trainer, version):
        rebuilds.append(version)
        return real_restore(run_actors, trainer, version)

    monkeypatch.setattr(recovery, "restore_trainers", counted_restore)
    try:
        actors.trainer.start(str(platform.assets.model))
        kill_named([actors.name(Role.TRAINER)])
        start = threading.Barrier(2)
        found: list = [None, None]

        def activity(i: int) -> None:
            start.wait()
            found[i] = actors.trainer.at_version(0, at_least=(i == 1))[0]

        threads = [threading.Thread(target=activity, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(600)  # a hang guard: a rebuild is seconds idle, minutes on a loaded CI machine
        assert not any(th.is_alive() for th in threads), "an activity still waits for the trainers"
        assert rebuilds == [0], rebuilds
        assert found[0] is not None and found[0]._actor_id == found[1]._actor_id
        assert ray_driver.get(found[0].policy_version.remote()) == 0
    finally:
        release_run_actors("lease-run")


def test_a_wait_fails_as_soon_as_one_of_its_refs_fails(ray_driver):
    """Trainer ranks wait on each other in collectives: when one dies, the others block until
    the process group's timeout (30 minutes). A wait on all of them must fail with the first
    failure, not wait for the blocked ones (found when a node died during a rebuild)."""
    from ratchet.activities.ray_calls import wait
    from ratchet.workers.actors import PlainWaiter

    @ray_driver.remote(num_cpus=0)
    def rank_that_died():
        raise ValueError("rank 1 died")

    @ray_driver.remote(num_cpus=0)
    def rank_blocked_in_a_collective():
        time.sleep(600)

    for waits in (PlainWaiter().wait, wait):
        blocked = rank_blocked_in_a_collective.remote()
        with pytest.raises(Exception, match="rank 1 died"):
            waits([blocked, rank_that_died.remote()])
        done, _ = ray_driver.wait([blocked], timeout=0)
        assert not done, "the wait ended before the blocked ref, as it must"
        ray_driver.cancel(blocked, force=True)


def test_a_restore_lease_is_exclusive_until_released_or_expired():
    from ratchet.workers.rebuild_lease import RestoreLease

    lease = RestoreLease()
    assert lease.acquire("a", 0.3) and lease.acquire("a", 0.3)  # the holder renews
    assert not lease.acquire("b", 0.3) and lease.holder() == "a"
    lease.release("b")  # not theirs to release
    assert not lease.acquire("b", 0.3)
    time.sleep(0.35)  # a holder that died stops renewing: the lease expires
    assert lease.holder() is None and lease.acquire("b", 0.3)
    lease.release("b")
    assert lease.acquire("c", 0.3)


def _unsharded_sizes(worker) -> int:
    """Values in the trainer's unsharded state dict (an all-gather: every rank calls)."""
    return sum(v.numel() for v in worker.trainer.full_state().values())


def test_worker_start_sweeps_the_actors_of_closed_runs(platform, ray_driver):
    from ratchet.activities.sweep import sweep_closed_runs
    from ratchet.workers.actors import NAMESPACE, run_actor_names

    client = platform.client
    # A short heartbeat timeout: the activity of the terminated run learns of it soon.
    handle = client.submit(RECIPE_PATH, platform.overrides(*TINY, "loop.steps=200", "loop.heartbeat_timeout_s=5", "tracking.name=sweep"))
    roles = lambda: {n.split("/")[1] for n in run_actor_names().get(handle.run_id, [])}  # noqa: E731
    wait_until(lambda: {"trainer-0", "rollout-0", "reward-0"} <= roles(), timeout=300)

    @ray_driver.remote(num_cpus=0)
    class Leftover:
        def ping(self):
            return 1

    gone = Leftover.options(name="never-started-run/rollout-0", namespace=NAMESPACE, lifetime="detached").remote()
    ray_driver.get(gone.ping.remote())
    try:
        released = client._run(sweep_closed_runs(client._temporal))
        assert released == {"never-started-run": ["never-started-run/rollout-0"]}
        assert handle.run_id in run_actor_names(), "a running run keeps its actors"
        client._run(client._temporal.get_workflow_handle(handle.run_id).terminate("test: leave the actors behind"))
        assert handle.run_id in run_actor_names()  # terminated: no workflow code ran to release them
        released = client._run(sweep_closed_runs(client._temporal))
        assert sorted(n.split("/")[1] for n in released[handle.run_id]) == ["reward-0", "rollout-0", "trainer-0"]
        assert handle.run_id not in run_actor_names()
    finally:
        _release_until_quiet(handle.run_id)


def _release_until_quiet(run_id: str, quiet_s: float = 8.0, timeout_s: float = 90.0) -> None:
    """Release the run's actors until none comes back for `quiet_s`: the activity that was
    running when its run was terminated goes on (rebuilding what was released) until its
    heartbeat tells it the run is gone. Later tests in this process need the CPUs."""
    from ratchet.workers.actors import release_run_actors, run_actor_names

    deadline = time.monotonic() + timeout_s
    quiet_since = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - quiet_since < quiet_s:
        if run_id in run_actor_names():
            release_run_actors(run_id)
            quiet_since = time.monotonic()
        time.sleep(0.5)


def test_nan_reward_fails_the_run_in_its_first_step(platform, ray_driver, tmp_path):
    from ratchet.workers.actors import run_actor_names

    reward = reward_file(tmp_path, "    return float('nan') if '1' in ground_truth else 0.5\n")
    handle = platform.client.submit(
        RECIPE_PATH, platform.overrides(*TINY, "loop.steps=3", "checkpoint.every=1", "tracking.name=nan", reward)
    )
    text = run_fails(handle)
    assert "[NonFiniteError]" in text and "the reward function gave nan at batch 0, row" in text
    assert "data_source 'digits/copy'" in text
    assert attempts(handle, "step") == [1], "never retried"  # sync mode: the step activity scores, then trains
    run_store = ObjectStore(str(platform.runs_root / handle.run_id))
    assert CheckpointStore(run_store).list() == [] and not run_store.exists("train_log/v00000000.json")
    wait_until(lambda: handle.run_id not in run_actor_names(), timeout=60)


def test_reward_function_that_raises_fails_after_one_attempt(platform, ray_driver, tmp_path):
    reward = reward_file(tmp_path, "    return {'score': 1.0}['missing']\n")
    handle = platform.client.submit(RECIPE_PATH, platform.overrides(*TINY, "loop.steps=2", "tracking.name=raises", reward))
    text = run_fails(handle)
    assert "[RewardFunctionError]" in text and "raised KeyError: 'missing' at batch 0, row 0" in text
    assert "bad_reward.py:5 (compute_score)" in text
    assert attempts(handle, "step") == [1]


def test_hung_reward_is_cut_at_reward_timeout_and_replaced(platform, ray_driver, tmp_path):
    """Each attempt is cut at reward.timeout_s and the next one scores on a new reward
    actor. Two attempts prove it; the run is then cancelled rather than waiting out the
    retry policy's five (Temporal's own business, ~40 s here)."""
    pids = tmp_path / "pids"
    body = f"    open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\n    time.sleep(3600)\n    return 0.0\n"
    reward = reward_file(tmp_path, body)
    handle = platform.client.submit(
        RECIPE_PATH, platform.overrides(*TINY, "loop.steps=2", "reward.timeout_s=2", "tracking.name=hangs", reward)
    )
    temporal = platform.client._temporal.get_workflow_handle(handle.run_id)
    deadline, failure = time.monotonic() + 300, ""
    while time.monotonic() < deadline:
        pending = platform.client._run(temporal.describe()).raw_description.pending_activities
        score = [p for p in pending if p.activity_type.name == "step"]  # sync mode scores inside its step
        if score and score[0].attempt >= 2 and pids.exists() and len(set(pids.read_text().split())) >= 2:
            failure = score[0].last_failure.message
            break
        time.sleep(0.5)
    handle.cancel()
    assert "took longer than reward.timeout_s=2 s" in failure, failure
    assert "the reward worker was killed" in failure
    assert len(set(pids.read_text().split())) >= 2, "the second attempt scored with a new reward actor"
    from temporalio.client import WorkflowFailureError

    with pytest.raises(WorkflowFailureError):
        handle.result(timeout=120)  # cancelled; its actors released (the hung one included)


def test_failed_checkpoint_fails_the_run_naming_it(platform, ray_driver):
    """The run's checkpoints folder is blocked by a file: the last checkpoint's background
    upload fails, finish_run takes it again, fails, is retried, and the run fails. (The file
    is put there while the run is held at its first step boundary: a folder that exists
    before submit makes the id taken.)"""
    run_id = "ckpt-blocked"
    handle = platform.client.submit(
        RECIPE_PATH, platform.overrides(*TINY, "loop.steps=2", "checkpoint.every=2", "tracking.name=ckpt"), run_id=run_id
    )
    handle.pause()  # held at the first step boundary, before the only checkpoint (step 2)
    wait_until(lambda: handle.progress().phase == "paused", timeout=180)
    (platform.runs_root / run_id / "checkpoints").write_text("in the way")
    handle.resume()
    text = run_fails(handle)
    assert "[CheckpointFailed]" in text
    assert "checkpoint step-00000002 failed on trainer rank 0: NotADirectoryError" in text
    assert "no committed checkpoint of its last state" in text
    assert attempts(handle, "finish_run") == [5]
