"""Weight sync, trainer -> rollout engines: size-bounded buckets gathered from the
trainer's (FSDP2-sharded) parameters one bucket at a time, in the engine's dtype and
Hugging Face names, moved by what the placement allows (docs/weight_sync.md):

- buckets.py: the plan (`Manifest`) and the buckets themselves; names check.
- sources.py: what a receiver loads from (memory, files, a stream), one interface.
- relay.py: rank 0's window that fans buckets out to N replicas with bounded memory.
- trainer_side.py: plan, finiteness check and gather, the same on every rank.
- protocol.py: what every relayed sync shares: the trainer rank's registry of open syncs,
  a receiver's manifest and leave, the reports; no Ray.
- transport.py: the `WeightTransport` interface and the one driver of a sync through any
  transport (the table: catalog/weight_transports.py; which one a run takes:
  src/ratchet/config/sync_transport.py).
- ray_transport.py: the object store transport (CPU, and between nodes).
- cuda_ipc.py: CUDA IPC handles when trainer and engine share a GPU.
- nccl.py: broadcast from trainer rank 0 into a separate engine process group.
- device_sync.py: the CUDA IPC and NCCL transports.
- colocated_process.py: an HF engine in a process of its own beside a trainer, synced by
  the CUDA IPC code without Ray (the GPU check's sync and hand-over).
"""

from .buckets import MB, Manifest, TensorSpec, WeightBucket, WeightNamesMismatch, check_names, plan_buckets
from .relay import BucketRelay, SyncAborted
from .sources import MappingSource, SafetensorsSource, SafetensorsWriter, WeightSource, as_source, pairs
from .trainer_side import local_source

__all__ = [
    "MB", "BucketRelay", "Manifest", "MappingSource", "SafetensorsSource", "SafetensorsWriter", "SyncAborted", "TensorSpec",
    "WeightBucket", "WeightNamesMismatch", "WeightSource", "as_source", "check_names", "local_source", "pairs", "plan_buckets",
]  # fmt: skip
