"""Rank 0's window of gathered buckets, handed to N receivers (rollout replicas) that
each load every bucket: the fan-out, and the bound on memory.

The trainer offers bucket i only when every receiver has asked for bucket i - window + 1
or later (asking for i means done with i - 1 and let go of it), so at most `window`
buckets wait here plus one in each receiver's hands: peak extra memory is a few buckets
whatever the model's size, and the trainer's gather runs ahead of the slowest receiver by
at most `window` buckets. Pure threading; what a stored bucket is (an ObjectRef on Ray)
is the caller's `put`, and what a receiver is handed for it, its `wire`.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .buckets import Manifest, WeightBucket

DONE = float("inf")


class SyncAborted(RuntimeError):
    """A weight sync stopped before its end (the trainer or a receiver failed)."""


class BucketRelay:
    """`collective`: bucket i is offered only once every receiver has asked for it, the
    first one included (a broadcast: a member that never joins would hang the others in
    the collective, so a receiver that fails before its first ask must be able to abort
    the sync first). Otherwise receivers count as asking for bucket 0 from the start, so
    the first `window` buckets are gathered and stored ahead of them."""

    def __init__(
        self,
        consumers: int,
        *,
        window: int = 2,
        put: Callable[[Any], object] = lambda b: b,
        wire: Callable[[Any], object] = lambda stored: stored,
        timeout_s: float = 600.0,
        collective: bool = False,
    ):
        if consumers < 1 or window < 1:
            raise ValueError(f"a relay needs at least one receiver and a window of one (got {consumers}, {window})")
        self.consumers, self.window, self.put, self.wire, self.timeout_s = consumers, window, put, wire, timeout_s
        self._cv = threading.Condition()
        self._manifest: Manifest | None = None
        self._stored: dict[int, object] = {}  # bucket index -> stored bucket, until every receiver is past it
        self._offered = 0  # buckets offered so far
        # Per receiver: the bucket it asks for next (DONE: finished or left; -1: not asked yet).
        self._asked: list[float] = [-1 if collective else 0] * consumers
        self._error: str | None = None
        self.peak_stored = 0  # the most buckets held at once, for tests and benchmarks

    # -- the trainer's side -------------------------------------------------------------

    def start(self, manifest: Manifest) -> None:
        with self._cv:
            self._manifest = manifest
            self._cv.notify_all()

    def offer(self, bucket: WeightBucket | Any) -> None:
        """Store the next bucket once the window has room; SyncAborted if the sync was
        aborted or no receiver made room within the time limit."""
        with self._cv:
            self._wait(lambda: bucket.index - min(self._asked) < self.window or self._error is not None, "room for bucket", bucket.index)
            self._raise_if_failed()
            if min(self._asked) == DONE:
                self._offered += 1  # every receiver left: nothing to keep
                return
        stored = self.put(bucket)  # outside the lock: a copy into the object store takes time
        with self._cv:
            self._stored[bucket.index] = stored
            self._offered += 1
            self.peak_stored = max(self.peak_stored, len(self._stored))
            self._cv.notify_all()

    def fail(self, error: str) -> None:
        """Abort: receivers waiting (or coming) get SyncAborted with `error`."""
        with self._cv:
            self._error = self._error or error
            self._stored.clear()
            self._cv.notify_all()

    # -- a receiver's side --------------------------------------------------------------

    def manifest(self) -> Manifest:
        with self._cv:
            self._wait(lambda: self._manifest is not None or self._error is not None, "the manifest", -1)
            self._raise_if_failed()
            assert self._manifest is not None  # set, or the wait failed the relay
            return self._manifest

    def take(self, consumer: int, index: int):
        """Bucket `index` as a receiver is handed it (`wire` of the stored one; None past
        the last one), for receiver `consumer`, who is done with the buckets before it."""
        with self._cv:
            self._check_consumer(consumer)
            self._asked[consumer] = max(self._asked[consumer], index)
            self._drop_passed()
            self._cv.notify_all()
            self._wait(
                lambda: self._error is not None or (self._manifest is not None and (index >= len(self._manifest.buckets) or index in self._stored)),
                "bucket", index,
            )  # fmt: skip
            self._raise_if_failed()
            assert self._manifest is not None  # set, or the wait failed the relay
            if index >= len(self._manifest.buckets):
                self._asked[consumer] = DONE
                self._drop_passed()
                self._cv.notify_all()
                return None
            return self.wire(self._stored[index])

    def leave(self, consumer: int) -> None:
        """Receiver `consumer` stops (done or failed): the trainer no longer waits for it."""
        with self._cv:
            self._check_consumer(consumer)
            self._asked[consumer] = DONE
            self._drop_passed()
            self._cv.notify_all()

    @property
    def finished(self) -> bool:
        """Every receiver has finished or left."""
        with self._cv:
            return min(self._asked) == DONE

    # -- inside the lock ----------------------------------------------------------------

    def _drop_passed(self) -> None:
        low = min(self._asked)
        for i in [i for i in self._stored if i < low]:
            del self._stored[i]

    def _check_consumer(self, consumer: int) -> None:
        if not 0 <= consumer < self.consumers:
            raise ValueError(f"receiver {consumer} is not one of this sync's {self.consumers}")

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise SyncAborted(f"weight sync aborted: {self._error}")

    def _wait(self, ready: Callable[[], bool], what: str, index: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                self._error = self._error or f"timed out after {self.timeout_s:g} s waiting for {what} {index}"
                self._stored.clear()
                self._cv.notify_all()
                return
            self._cv.wait(left)
