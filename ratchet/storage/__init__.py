"""Object storage: an fsspec-backed store, and the batch store on top of it."""

from .batch_store import BatchStore
from .metrics_log import MetricsLog
from .object_store import ObjectStore

__all__ = ["BatchStore", "MetricsLog", "ObjectStore"]
