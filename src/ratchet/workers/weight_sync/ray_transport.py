"""Weight sync through Ray's object store: trainer rank 0 puts each gathered bucket into
the store once, and every rollout replica pulls it, loads it and lets it go before it
asks for the next one (relay.py keeps the window). Between nodes and on CPU this is the
transport; the bytes never pass through the driver (the activity process).

One sync, as calls:
  driver:   every trainer rank `stream_weights(sync_id, n)` (a collective: all gather)
            every replica k `load_weights(StreamSource(rank0, sync_id, k))`
  replica:  rank0.sync_manifest(sync_id) -> Manifest (names checked before loading)
            rank0.sync_take(sync_id, k, i) -> ObjectRef of bucket i, ray.get, load, drop
Rank 0 answers `sync_*` from a concurrency group of its own while its main thread
gathers. fully_async with partial rollouts syncs from `PublishedSource` instead: the
buckets rank 0 put after its last update, read without queueing behind the next one.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator

import ray

from .buckets import Manifest, WeightBucket
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
    transport: str  # "stream" (gathered now), "published" (put after the last update); device_sync.py: "cuda_ipc", "nccl"
    window_peak: int = 0  # stream: the most buckets rank 0 held for the replicas at once


class RelayRegistry:
    """Rank 0's relays by sync id; a receiver may ask before the trainer opened its."""

    def __init__(self):
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
    """`actor.method(*args)` through `.remote`: a Ray actor's ObjectRef, or a Future (the
    in-process stand-in for a handle the tests use)."""
    pending = getattr(actor, method).remote(*args)
    if isinstance(pending, ray.ObjectRef):
        return ray.get(pending, timeout=timeout_s)
    return pending.result(timeout=timeout_s)


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


class StreamSource(RelayedSource):
    """A replica's pull of one sync from trainer rank 0 through the object store
    (picklable: an actor handle and ids)."""

    def _buckets(self) -> Iterator[WeightBucket]:
        count = len(self.manifest().buckets)
        finished = False
        take = lambda i: self.rank.sync_take.remote(self.sync_id, self.consumer, i)  # noqa: E731
        try:
            asked = take(0)
            for index in range(count + 1):
                ref = ray.get(asked, timeout=self.timeout_s)
                if ref is None:
                    finished = True
                    return
                # Ask for the next bucket before loading this one: the round trip overlaps
                # the load. This receiver still holds bucket `index` (its own reference)
                # until it has loaded it, so it holds at most two at a time.
                asked = take(index + 1)
                bucket = ray.get(ref, timeout=self.timeout_s)
                del ref
                yield bucket
                del bucket
        finally:
            if not finished:
                self.close("the receiver stopped before the last bucket")


class PublishedSource(WeightSource):
    """The buckets trainer rank 0 put after an update (partial rollouts): a snapshot any
    number of replicas read, one bucket at a time."""

    def __init__(self, manifest: Manifest, refs: list):
        self._manifest, self.refs = manifest, refs

    def manifest(self) -> Manifest:
        return self._manifest

    def _buckets(self) -> Iterator[WeightBucket]:
        for ref in self.refs:
            yield ray.get(ref, timeout=STREAM_TIMEOUT_S)


def stream_sync(ranks: list, targets: list, wait: Callable, *, sync_id: str | None = None) -> SyncResult:
    """Gather the trainer's weights once and load them into every target replica, pipelined
    bucket by bucket. `wait`: how to wait on ObjectRefs (the activity's heartbeating one)."""
    if not targets:
        raise ValueError("a weight sync needs at least one rollout replica")
    sync_id = sync_id or uuid.uuid4().hex
    rank0 = ranks[0]
    gathers = [r.stream_weights.remote(sync_id, len(targets)) for r in ranks]
    loads = [t.load_weights.remote(StreamSource(rank0, sync_id, k), None) for k, t in enumerate(targets)]
    try:
        received = wait(loads)
    except BaseException as load_error:
        # The trainer's own failure (non-finite weights, a lost rank) is the cause to
        # report; otherwise the replica's. Either way the other side stops waiting.
        rank0.sync_abort.remote(sync_id, f"a rollout replica failed to load: {type(load_error).__name__}: {load_error}")
        try:
            wait(gathers)
        except BaseException as trainer_error:
            raise trainer_error from load_error
        raise
    reports = wait(gathers)
    return SyncResult(
        version=reports[0].version, bytes=int(sum(received)), buckets=reports[0].buckets, replicas=len(targets), transport="stream",
        window_peak=reports[0].window_peak,
    )


def published_sync(published: tuple[int, PublishedSource], targets: list, wait: Callable) -> SyncResult:
    """Load the weights rank 0 published after its last update into every target."""
    version, source = published
    received = wait([t.load_weights.remote(source, version) for t in targets])
    return SyncResult(
        version=version, bytes=int(sum(received)), buckets=len(source.refs), replicas=len(targets), transport="published"
    )

