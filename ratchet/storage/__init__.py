"""Object storage: a store over local folders, S3 and MinIO, and the batch, metrics and
checkpoint stores on top of it."""

from .batch_store import BatchStore
from .checkpoint_store import CheckpointInfo, CheckpointStore, CorruptCheckpoint
from .keys import UnsafeKey
from .metrics_log import MetricsLog
from .object_store import ObjectStore, StoreUnavailable, Transfer

__all__ = [
    "BatchStore",
    "CheckpointInfo",
    "CheckpointStore",
    "CorruptCheckpoint",
    "MetricsLog",
    "ObjectStore",
    "StoreUnavailable",
    "Transfer",
    "UnsafeKey",
]
