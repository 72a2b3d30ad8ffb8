"""Which transport a weight sync takes, decided from the placement plan and the config
alone (no torch, no Ray), so that a forced transport the placement cannot carry is
refused at submit, with the field and the fix.

- object store (weight_sync/ray_transport.py): always works; the only choice on CPU, without
  resource pools (Ray may put the actors anywhere), and when a pool spans several nodes.
- CUDA IPC (weight_sync/device_sync.py, cuda_ipc.py): trainer and rollout colocated on one
  GPU pool, every rollout replica on the GPU of a trainer rank, which hands it each bucket
  by handle (all ranks hold each gathered bucket whole: the gather is an all-gather).
- NCCL (weight_sync/device_sync.py, nccl.py): trainer and rollout on two GPU pools (split),
  one broadcast per bucket from trainer rank 0 into a group with every replica.

`trainer.sync_transport` forces one (`auto`: the table above). Forcing `nccl` across
nodes is allowed (the user vouches that NCCL reaches between them); `auto` does not risk it.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from .placement_plan import ROLLOUT, TRAINER, PlacementPlan, Problem

if TYPE_CHECKING:
    from .schema import RunConfig

FIELD = "trainer.sync_transport"


class Transport(str, enum.Enum):
    OBJECT_STORE = "object_store"
    CUDA_IPC = "cuda_ipc"
    NCCL = "nccl"


def _on_gpu(plan: PlacementPlan, cfg: "RunConfig", role: str) -> bool:
    """Whether `role`'s actors hold GPUs: only a GPU pool gives them any (without pools
    the actors reserve CPUs only), and a trainer told `trainer.device: cpu` stays on CPU."""
    pool = plan.pool_of(role)
    if pool is None or pool.gpus <= 0:
        return False
    return not (role == TRAINER and cfg.trainer.device == "cpu")


def _nodes(cfg: "RunConfig", pool_name: str) -> int:
    return next(p.nodes for p in cfg.resources.pools if p.name == pool_name)


def ipc_partners(plan: PlacementPlan, cfg: "RunConfig") -> list[int] | None:
    """For each rollout replica, the trainer rank on its GPU (its colocated partner that
    hands it the buckets by CUDA IPC handle); None if some replica has no trainer rank on
    its GPU (or the two roles are not on one pool)."""
    trainer_pool, rollout_pool = plan.pool_of(TRAINER), plan.pool_of(ROLLOUT)
    if trainer_pool is None or trainer_pool is not rollout_pool:
        return None
    rank_on = {s.bundle: s.rank for s in trainer_pool.slots if s.role == TRAINER}
    partners = []
    for k in range(cfg.rollout.replicas):
        slot = plan.slot(ROLLOUT, k)
        if slot is None or slot.bundle not in rank_on:
            return None
        partners.append(rank_on[slot.bundle])
    return partners


def choose_transport(plan: PlacementPlan, cfg: "RunConfig") -> Transport:
    """The transport of this run's syncs: `trainer.sync_transport` if forced (check it with
    `transport_problems`), else the table in this module's docstring."""
    forced = cfg.trainer.sync_transport
    if forced != "auto":
        return Transport(forced)
    if not (_on_gpu(plan, cfg, TRAINER) and _on_gpu(plan, cfg, ROLLOUT)):
        return Transport.OBJECT_STORE
    trainer_pool, rollout_pool = plan.pool_of(TRAINER), plan.pool_of(ROLLOUT)
    assert trainer_pool is not None and rollout_pool is not None  # both on a GPU: both in a pool
    if trainer_pool is rollout_pool:
        return Transport.CUDA_IPC if ipc_partners(plan, cfg) is not None else Transport.OBJECT_STORE
    if _nodes(cfg, trainer_pool.name) == 1 and _nodes(cfg, rollout_pool.name) == 1:
        return Transport.NCCL
    return Transport.OBJECT_STORE  # several nodes: NCCL may not reach; force it if it does


def transport_problems(plan: PlacementPlan, cfg: "RunConfig") -> list[Problem]:
    """Why the forced `trainer.sync_transport` cannot work for this placement (empty: it can)."""
    forced = cfg.trainer.sync_transport
    if forced in ("auto", Transport.OBJECT_STORE.value):
        return []
    trainer_gpu, rollout_gpu = _on_gpu(plan, cfg, TRAINER), _on_gpu(plan, cfg, ROLLOUT)
    if not plan.pools:
        return [(FIELD, f"is {forced}, which needs trainer and rollout on GPU pools (resources.pools with gpus_per_node > 0); "
                        "without pools the actors hold no GPUs. Add GPU pools, or use auto or object_store")]  # fmt: skip
    if not (trainer_gpu and rollout_gpu):
        where = "the trainer runs" if not trainer_gpu else "the rollout replicas run"
        trainer_pool = plan.pool_of(TRAINER)
        told_cpu = not trainer_gpu and trainer_pool is not None and trainer_pool.gpus > 0
        why = "trainer.device is cpu" if told_cpu else "its pool has no GPUs"
        return [(FIELD, f"is {forced}, but {where} on CPU ({why}); {forced} moves GPU memory. Use auto or object_store, or "
                        "place both roles on GPU pools")]  # fmt: skip
    same_pool = plan.pool_of(TRAINER) is plan.pool_of(ROLLOUT)
    if forced == Transport.CUDA_IPC.value:
        if not same_pool:
            return [(FIELD, "is cuda_ipc, but trainer and rollout are on separate pools (split): CUDA IPC shares memory on one "
                            "GPU. Use nccl or auto, or put both roles on one pool (colocated)")]  # fmt: skip
        if ipc_partners(plan, cfg) is None:
            return [(FIELD, "is cuda_ipc, but some rollout replica has no trainer rank on its GPU (replica k sits on GPU "
                            "k x tensor_parallel_size, trainer rank k on GPU k); raise trainer.world_size, lower "
                            "rollout.replicas, or use auto or object_store")]  # fmt: skip
    if forced == Transport.NCCL.value and same_pool:
        return [(FIELD, "is nccl, but trainer and rollout share the GPUs of one pool (colocated), and NCCL cannot join two "
                        "processes on one GPU. Use cuda_ipc or auto, or put the roles on separate pools (split)")]  # fmt: skip
    return []
