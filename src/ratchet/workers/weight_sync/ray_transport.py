"""Weight sync through Ray's object store (`OBJECT_STORE`, a transport of
weight_sync/transport.py): trainer rank 0 puts each gathered bucket into the store once,
and every rollout replica pulls it, loads it and lets it go before it asks for the next
one (relay.py keeps the window). Between nodes and on CPU this is the transport; the bytes
never pass through the driver (the activity process).

One sync, as calls (the driver: transport.relayed_sync):
  trainer ranks  send_weights(sync_id, "object_store", n on rank 0, 0 on the others):
                 every rank gathers, rank 0 puts each bucket into the store
  replica k      receive_weights("object_store", rank0, sync_id, k) -> a StreamSource:
                 rank0.sync_manifest(sync_id) -> Manifest (names checked before loading)
                 rank0.sync_take(sync_id, k, i) -> ObjectRef of bucket i, ray.get, load, drop
Rank 0 answers `sync_*` from a concurrency group of its own while its main thread
gathers. fully_async with partial rollouts syncs from `PublishedSource` instead: the
buckets rank 0 put after its last update, read without queueing behind the next one.
"""

from __future__ import annotations

from typing import Callable, Iterator

import ray

from .buckets import Manifest, WeightBucket
from .protocol import STREAM_TIMEOUT_S, WINDOW, RelayedSource, SyncResult
from .relay import BucketRelay
from .sources import WeightSource
from .trainer_side import gather_and_offer
from .transport import from_rank_zero


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


class ObjectStoreTransport:
    """Buckets through Ray's object store, all from trainer rank 0 (which holds each
    gathered bucket whole), at most a window ahead of the slowest replica."""

    name = "object_store"

    def serving(self, plan, cfg, replicas: int) -> list[int]:
        return from_rank_zero(replicas)

    def prepare(self, ranks: list, targets: list, wait: Callable) -> None:
        pass  # the object store is there already

    def open_relay(self, sender, consumers: int) -> BucketRelay:
        return BucketRelay(consumers, window=WINDOW, put=ray.put, timeout_s=STREAM_TIMEOUT_S)

    def send(self, sender, entries: list, manifest: Manifest, relay: BucketRelay | None) -> tuple[int, Exception | None]:
        return gather_and_offer(entries, manifest, relay.offer if relay is not None else None)

    def source(self, receiver, rank, sync_id: str, consumer: int) -> StreamSource:
        return StreamSource(rank, sync_id, consumer)


OBJECT_STORE = ObjectStoreTransport()


def published_sync(published: tuple[int, PublishedSource], targets: list, wait: Callable) -> SyncResult:
    """Load the weights rank 0 published after its last update into every target."""
    version, source = published
    received = wait([t.load_weights.remote(source, version) for t in targets])
    return SyncResult(version=version, bytes=int(sum(received)), buckets=len(source.refs), replicas=len(targets), transport="published")
