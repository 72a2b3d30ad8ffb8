"""The protocol of a relayed weight sync, whatever carries the bytes (Ray's object store,
CUDA IPC handles, an NCCL broadcast): a trainer rank keeps each open sync's relay in a
registry and answers `sync_manifest` / `sync_take` / `sync_leave` / `sync_abort`; a
receiver asks for the manifest once and tells the rank once that it is done or failed.
No Ray here: `call` goes through a Ray actor handle or any stand-in whose `.remote`
returns a Future, so the device transports run without Ray too (the colocated engine
process of the GPU check, weight_sync/colocated_process.py).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from .buckets import Manifest
from .relay import BucketRelay, SyncAborted
from .sources import WeightSource

log = logging.getLogger(__name__)

# How long a receiver waits for the trainer's next bucket, and the trainer for room in the
# window: a peer that died makes the other side fail instead of hanging.
STREAM_TIMEOUT_S = 600.0
# Buckets gathered ahead of the slowest receiver (relay.py): two keep the trainer's
# gather and the receiver's load overlapping.
WINDOW = 2
# Concurrency group of the trainer's `sync_*` methods: enough threads for every
# receiver to wait on its next bucket at once.
SYNC_GROUP = "sync"
SYNC_GROUP_THREADS = 32


@dataclass(frozen=True)
class StreamReport:
    """A trainer rank's side of one sync."""

    version: int
    bytes: int  # wire bytes put into the store (0 on ranks > 0)
    buckets: int
    seconds: float
    window_peak: int = 0  # the most buckets rank 0 held in the store at once


@dataclass(frozen=True)
class SyncResult:
    """One sync into every rollout replica, for the activity and the step metrics."""

    version: int
    bytes: int  # wire bytes loaded, summed over replicas
    buckets: int
    replicas: int
    transport: str  # the transport's catalog name (catalog/weight_transports.py), or "published" (put after the last update)
    window_peak: int = 0  # stream: the most buckets rank 0 held for the replicas at once


class RelayRegistry:
    """Rank 0's relays by sync id; a receiver may ask before the trainer opened its."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._relays: dict[str, BucketRelay] = {}

    def open(self, sync_id: str, relay: BucketRelay) -> None:
        with self._cv:
            # Syncs run one at a time: an older one still open is a retried attempt's
            # leftover, or its receivers died; its waiters fail now instead of timing out.
            for old_id, old in self._relays.items():
                old.fail(f"a newer sync ({sync_id}) started before {old_id} ended")
            self._relays.clear()
            self._relays[sync_id] = relay
            self._cv.notify_all()

    def get(self, sync_id: str, timeout_s: float = STREAM_TIMEOUT_S) -> BucketRelay:
        with self._cv:
            if not self._cv.wait_for(lambda: sync_id in self._relays, timeout_s):
                raise SyncAborted(f"weight sync {sync_id}: the trainer did not start it within {timeout_s:g} s")
            return self._relays[sync_id]

    def close(self, sync_id: str) -> None:
        with self._cv:
            self._relays.pop(sync_id, None)


def call(actor, method: str, *args, timeout_s: float = STREAM_TIMEOUT_S):
    """`actor.method(*args)` through `.remote`: a Ray actor's ObjectRef, or a Future (a
    stand-in for a handle: the tests' in-process one, the colocated engine process's pipe)."""
    pending = getattr(actor, method).remote(*args)
    if isinstance(pending, Future):
        return pending.result(timeout=timeout_s)
    import ray  # here, not above: the device transports run without Ray too (the GPU check)

    return ray.get(pending, timeout=timeout_s)


class RelayedSource(WeightSource):
    """A replica's receipt of one sync that a trainer rank relays (`relay.py`): the manifest
    asked once, and the rank told once that this receiver is done (or failed), so that it
    stops waiting for it. Subclasses give `_buckets`: how the bytes travel."""

    def __init__(self, rank, sync_id: str, consumer: int, timeout_s: float = STREAM_TIMEOUT_S):
        self.rank, self.sync_id, self.consumer, self.timeout_s = rank, sync_id, consumer, timeout_s
        self._manifest: Manifest | None = None
        self._closed = False

    def manifest(self) -> Manifest:
        if self._manifest is None:
            self._manifest = call(self.rank, "sync_manifest", self.sync_id, timeout_s=self.timeout_s)
        return self._manifest

    def close(self, error: str | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._leave(error)
        except Exception as e:  # noqa: BLE001 - the trainer may be gone; its relay times out then
            log.warning("weight sync %s: could not tell the trainer receiver %d stopped: %s", self.sync_id, self.consumer, e)

    def _leave(self, error: str | None) -> None:
        call(self.rank, "sync_leave", self.sync_id, self.consumer, error, timeout_s=30)
