"""Weight sync through real Ray actors (the platform's Ray): two FSDP2 trainer ranks stream
their weights bucket by bucket through the object store into rollout workers; the
engines then hold the trainer's weights bit for bit and give its log-probs. One set of
actors serves the module's tests."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from ratchet.platform.client import RECIPE_PATH

TOKENS = torch.tensor([[1, 14, 15, 16, 4, 5, 6, 7, 8, 9, 10, 2]])
BUCKET_MB = 0.2
TINY = [
    "warmup.steps=0", "data.eval_files=null", "loop.prompts_per_step=4", "rollout.n=2", "resources.trainer_cpus=0.25",
    "resources.rollout_cpus=0.25", "trainer.world_size=2", f"trainer.sync_bucket_mb={BUCKET_MB}",
]  # fmt: skip


@pytest.fixture(scope="module")
def run(platform, tmp_path_factory):
    """A run's actors: 2 trainer ranks (perturbed away from the initial policy) and 2
    rollout workers, on the platform's Ray."""
    import ray

    from ratchet.config import load_config
    from ratchet.platform.services import ray_address, ray_auth_env
    from ratchet.platform.services.ray_auth import APPLIED_VAR, RAY_AUTH_VARS
    from ratchet.platform.worker import connect_ray
    from ratchet.workers.actors import Role, RunActors, release_run_actors
    from ratchet.workers.rollout import RolloutWorker

    before = {k: os.environ.get(k) for k in (*RAY_AUTH_VARS, APPLIED_VAR)}
    connect_ray(ray_address(platform.settings), ray_auth_env(platform.settings))
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the helpers below run in the actors
    cfg = load_config(RECIPE_PATH, platform.overrides(*TINY))
    actors = RunActors("ws-ray", str(tmp_path_factory.mktemp("ws") / "ws-ray"), cfg)
    try:
        model = str(platform.assets.model)
        actors.trainer.start(model)
        ranks = actors.trainer.ranks()
        ray.get([r.__ray_call__.remote(perturb, 7) for r in ranks])
        rollouts = [actors.rollout.start_one(model), actors.create(RolloutWorker, Role.ROLLOUT, 1, 0.25, cfg, model, actors.run_uri)]
        yield actors, ranks, rollouts
    finally:
        release_run_actors("ws-ray")
        ray.shutdown()
        for k, v in before.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def perturb(worker, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + worker.rank)
    with torch.no_grad():
        for p in worker.trainer.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(0.1 * torch.randn(local.shape, generator=g))


def poison(worker) -> None:
    if worker.rank == 1:
        with torch.no_grad():
            next(iter(worker.trainer.model.parameters())).to_local().view(-1)[0] = float("nan")


def logprobs(model) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=TOKENS).logits.float()
    return logits[:, :-1].log_softmax(-1).gather(-1, TOKENS[:, 1:, None]).squeeze(-1).numpy()


def trainer_logprobs(worker) -> np.ndarray:
    return logprobs(worker.trainer.model)  # every rank: an FSDP forward is a collective


def full_weights(worker) -> dict[str, np.ndarray]:
    """The trainer's unsharded weights (every rank calls: a collective)."""
    return {k: v.float().numpy().copy() for k, v in worker.trainer.full_state().items()}


def engine_view(worker) -> tuple[dict, np.ndarray, int]:
    return {k: v.numpy().copy() for k, v in worker.engine.model.state_dict().items()}, logprobs(worker.engine.model), worker.version


def test_sync_streams_two_fsdp2_ranks_into_the_rollout_engine(run):
    import ray

    actors, ranks, rollouts = run
    out = actors.sync_weights(0)
    full = ray.get([r.__ray_call__.remote(full_weights) for r in ranks])[0]
    assert out.version == 0 and out.replicas == 1 and out.transport == "object_store"
    assert out.bytes == sum(v.nbytes for k, v in full.items() if k != "lm_head.weight")
    assert out.buckets > 3  # bounded buckets, not one model-sized buffer
    state, engine_lp, version = ray.get(rollouts[0].__ray_call__.remote(engine_view))
    assert version == 0
    assert all(np.array_equal(state[k], full[k]) for k in full), "bit-exact in float32"
    trainer_lp = ray.get([r.__ray_call__.remote(trainer_logprobs) for r in ranks])[0]
    assert np.abs(engine_lp - trainer_lp).max() < 1e-5


def test_one_gather_fans_out_to_every_replica_and_nan_is_refused_first(run):
    import ray

    from ratchet.errors import NonFiniteError
    from ratchet.workers.weight_sync.ray_transport import OBJECT_STORE
    from ratchet.workers.weight_sync.transport import relayed_sync

    actors, ranks, rollouts = run
    ray.get([r.__ray_call__.remote(perturb, 8) for r in ranks])
    out = relayed_sync(OBJECT_STORE, ranks, rollouts, actors.wait)
    assert out.replicas == 2 and out.bytes == 2 * (out.bytes // 2)
    full = ray.get([r.__ray_call__.remote(full_weights) for r in ranks])[0]
    views = ray.get([r.__ray_call__.remote(engine_view) for r in rollouts])
    for state, _, _ in views:
        assert all(np.array_equal(state[k], full[k]) for k in full)
    # A NaN on rank 1's shard: refused before any bucket leaves; the engines keep serving.
    ray.get([r.__ray_call__.remote(poison) for r in ranks])
    with pytest.raises(NonFiniteError, match=r"\(to be synced\) hold NaN/inf values"):
        relayed_sync(OBJECT_STORE, ranks, rollouts, actors.wait)
    for before, rollout in zip(views, rollouts):
        state, _, version = ray.get(rollout.__ray_call__.remote(engine_view))
        assert version == 0 and all(np.array_equal(state[k], before[0][k]) for k in state)
