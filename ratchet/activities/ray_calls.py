"""Waiting on Ray work from inside a Temporal activity.

Activities run in a thread pool; each wait polls Ray with a short timeout and heartbeats in
between, so Temporal notices a dead worker within the heartbeat timeout, and a cancelled
activity cancels its Ray task instead of leaving it running (DESIGN.md, rule 5).

Ray wraps an error raised inside an actor (RayTaskError, or ActorDiedError when the
actor's constructor raised), so the workflow's list of non-retryable error types could
never match it. `wait` classifies by the cause: a domain error that no retry can fix
(ratchet.errors.NON_RETRYABLE) becomes a non-retryable ApplicationError of the cause's
type; infrastructure errors (an actor died, an object was lost) stay retryable.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import ray
from temporalio import activity
from temporalio.exceptions import ApplicationError, CancelledError

from ratchet.errors import NON_RETRYABLE

POLL_SECONDS = 1.0
# The last line of a Python traceback: `package.module.ClassName: message`.
_TRACEBACK_TAIL = re.compile(r"^(?:[\w]+\.)*(\w+): (.*)$")


class WaitTimeout(TimeoutError):
    """Ray work did not finish within the time given to `wait`."""


def _domain_type(exc: BaseException) -> str | None:
    """The first non-retryable domain error type among exc's classes and causes."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for cls in type(exc).__mro__:
            if cls.__name__ in NON_RETRYABLE:
                return cls.__name__
        exc = exc.__cause__ or exc.__context__
    return None


def classify(err: BaseException) -> BaseException:
    """The error an activity should raise for `err`, an error from `ray.get`."""
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = err.cause if err.cause is not None else err
        kind = _domain_type(cause)
        if kind is not None:
            return ApplicationError(f"{kind}: {cause}", type=kind, non_retryable=True)
        return err
    if isinstance(err, ray.exceptions.RayActorError) and getattr(err, "_actor_init_failed", False):
        # The constructor raised; only its traceback text crossed over.
        lines = [x for x in (getattr(err, "error_msg", "") or "").splitlines() if x.strip()]
        m = _TRACEBACK_TAIL.match(lines[-1].strip()) if lines else None
        if m is not None and m.group(1) in NON_RETRYABLE:
            return ApplicationError(f"{m.group(1)}: {m.group(2)}", type=m.group(1), non_retryable=True)
    return err


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
    WaitTimeout when the work is not done by then (the work itself is left to the caller)."""
    single = not isinstance(refs, list)
    pending = [refs] if single else list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        poll = POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=poll)
        if activity.in_activity():
            if activity.is_cancelled():
                for ref in pending:
                    ray.cancel(ref, force=False)
                raise CancelledError("activity cancelled; its Ray work was cancelled too")
            activity.heartbeat(details)
        if pending and deadline is not None and time.monotonic() >= deadline:
            raise WaitTimeout(f"Ray work not done after {timeout_s:g} s")
    try:
        values = ray.get([refs] if single else list(refs))
    except ray.exceptions.RayError as err:
        classified = classify(err)
        if classified is err:
            raise
        raise classified from err
    return values[0] if single else values
