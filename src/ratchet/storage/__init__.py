"""Object storage: a store over local folders, S3 and MinIO, and the batch, metrics and
checkpoint stores on top of it.

The supported URL schemes are listed in `ratchet/catalog/storage_schemes.py`: that is where a backend is added.
The names below are imported on first use, so importing `ratchet.storage.schemes` (as the
config schema does) loads neither torch (batch_store) nor fsspec and the S3 clients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ratchet.lazy import lazy_exports

if TYPE_CHECKING:
    from .batch_store import BatchStore
    from .checkpoint_store import CheckpointInfo, CheckpointStore, CorruptCheckpoint, SealMismatch
    from .keys import UnsafeKey
    from .layout import RunLayout
    from .manifest import BadManifest, Manifest
    from .metrics_log import MetricsLog
    from .object_store import ObjectStore, StoreUnavailable, Transfer

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "batch_store": ("BatchStore",),
        "checkpoint_store": ("CheckpointInfo", "CheckpointStore", "CorruptCheckpoint", "SealMismatch"),
        "keys": ("UnsafeKey",),
        "layout": ("RunLayout",),
        "manifest": ("BadManifest", "Manifest"),
        "metrics_log": ("MetricsLog",),
        "object_store": ("ObjectStore", "StoreUnavailable", "Transfer"),
    },
)
