"""Every weight transport, in one table: how the trainer's weights reach the rollout
engines (`trainer.sync_transport` forces one; `auto` picks by placement:
config/sync_transport.py). Where a transport is added.

An entry is a `WeightTransport` (workers/weight_sync/transport.py): which trainer rank
serves each replica, what the driver makes first, the relay and the sending on a trainer
rank, the source a replica loads from. `TrainerWorker.send_weights` and
`RolloutWorker.receive_weights` look the transport up here by name, so a new one (a delta
sync, say) is one module and one line below, and neither actor changes; tests/unit/
test_sync_transport.py drives each one through the actors' own methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .registry import Registry

if TYPE_CHECKING:
    from ratchet.workers.weight_sync.transport import WeightTransport

WEIGHT_TRANSPORTS: Registry["WeightTransport"] = Registry("weight transport")
# Ray's object store, from trainer rank 0: on CPU, between nodes, whenever the placement is unknown.
WEIGHT_TRANSPORTS.register("object_store", "ratchet.workers.weight_sync.ray_transport:OBJECT_STORE")
# CUDA IPC handles from the trainer rank on each replica's GPU (trainer and rollout colocated).
WEIGHT_TRANSPORTS.register("cuda_ipc", "ratchet.workers.weight_sync.device_sync:CUDA_IPC")
# An NCCL broadcast from trainer rank 0 into the engine group (trainer and rollout on two GPU pools).
WEIGHT_TRANSPORTS.register("nccl", "ratchet.workers.weight_sync.device_sync:NCCL")
