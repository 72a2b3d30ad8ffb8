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
The relay protocol itself (registry, reports, a receiver's manifest and leave) is
protocol.py's, shared with the device transports.
"""

from __future__ import annotations

import uuid
from typing import Callable, Iterator

import ray

from .buckets import Manifest, WeightBucket
from .protocol import STREAM_TIMEOUT_S, RelayedSource, SyncResult
from .sources import WeightSource


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
        version=reports[0].version,
        bytes=int(sum(received)),
        buckets=reports[0].buckets,
        replicas=len(targets),
        transport="stream",
        window_peak=reports[0].window_peak,
    )


def published_sync(published: tuple[int, PublishedSource], targets: list, wait: Callable) -> SyncResult:
    """Load the weights rank 0 published after its last update into every target."""
    version, source = published
    received = wait([t.load_weights.remote(source, version) for t in targets])
    return SyncResult(version=version, bytes=int(sum(received)), buckets=len(source.refs), replicas=len(targets), transport="published")
