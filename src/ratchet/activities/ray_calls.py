"""Waiting on Ray work from inside a Temporal activity.

Activities run in a thread pool; each wait polls Ray with a short timeout and heartbeats in
between, so Temporal notices a dead worker within the heartbeat timeout, and a cancelled
activity cancels its Ray task instead of leaving it running (docs/design.md, rule 5).

Domain errors raised inside a Ray actor are classified by `translate.from_ray_error`.
`ACTIVITY_WAITER` hands these waits to the worker layer (`RunActors(..., waiter=...)`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Iterator
from typing import Any

import ray
from temporalio import activity
from temporalio.exceptions import CancelledError

from ratchet.workers.actors import WaitTimeout

from .translate import from_ray_error

POLL_SECONDS = 1.0
# A step makes a dozen short waits; a heartbeat after each (payload conversion on the
# worker's event loop, contending for the GIL with the activity) cost ~4 ms a step. At
# most this often instead: far below the shortest heartbeat timeout (loop.heartbeat_timeout_s > 1).
HEARTBEAT_EVERY_S = 0.25
_last_beat = threading.local()  # per activity thread: when it last heartbeat

__all__ = ["ACTIVITY_WAITER", "POLL_SECONDS", "WaitTimeout", "heartbeating", "wait"]


@contextlib.contextmanager
def heartbeating(details: Any = None, every_s: float = POLL_SECONDS) -> Iterator[None]:
    """Heartbeat from a helper thread while the body runs a long blocking call (a
    download) that has no progress of its own; nothing outside an activity."""
    if not activity.in_activity():
        yield
        return
    done = threading.Event()
    ctx = contextvars.copy_context()  # the activity's context: heartbeat() finds it there

    def beat() -> None:
        while not done.wait(every_s):
            ctx.run(activity.heartbeat, details)

    thread = threading.Thread(target=beat, name="activity-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def wait(refs: Any, *, details: Any = None, timeout_s: float | None = None) -> Any:
    """`ray.get` that heartbeats; accepts one ObjectRef or a list. With `timeout_s`, raises
    WaitTimeout when the work is not done by then (the work itself is left to the caller).
    A failed ref fails the wait at once, while the others still run: trainer ranks wait on
    each other in collectives, and the survivors of a rank that died would block until the
    process group's own timeout (30 minutes)."""
    single = not isinstance(refs, list)
    pending = [refs] if single else list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while pending:
            poll = POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=poll)
            if ready and pending:
                ray.get(ready)  # raises if one of them failed
            if activity.in_activity():
                if activity.is_cancelled():
                    for ref in pending:
                        ray.cancel(ref, force=False)
                    raise CancelledError("activity cancelled; its Ray work was cancelled too")
                _heartbeat_now_and_then(details)
            if pending and deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"Ray work not done after {timeout_s:g} s")
        values = ray.get([refs] if single else list(refs))
    except ray.exceptions.RayError as err:
        classified = from_ray_error(err)
        if classified is err:
            raise
        raise classified from err
    return values[0] if single else values


def _heartbeat_now_and_then(details: Any) -> None:
    now = time.monotonic()
    if now - getattr(_last_beat, "at", float("-inf")) >= HEARTBEAT_EVERY_S:
        _last_beat.at = now
        activity.heartbeat(details)


def beat(details: str) -> None:
    """Progress of a long job (a file of a checkpoint downloaded); nothing outside an activity."""
    if activity.in_activity():
        activity.heartbeat(details)


class ActivityWaiter:
    """The worker layer's `Waiter` inside an activity: waits heartbeat and honour cancellation."""

    def wait(self, refs: Any, *, timeout_s: float | None = None) -> Any:
        return wait(refs, timeout_s=timeout_s)

    def progress(self, details: str) -> None:
        beat(details)

    def busy(self, details: str):
        return heartbeating(details)


ACTIVITY_WAITER = ActivityWaiter()
