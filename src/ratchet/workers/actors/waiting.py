"""How the worker layer waits on Ray work, injected by its caller.

A wait inside a Temporal activity must heartbeat and honour cancellation; a test or a
local script just blocks. `RunActors` takes a `Waiter` so the worker layer knows nothing
of Temporal: activities pass `activities.ray_calls.ACTIVITY_WAITER`, everything else
gets `PlainWaiter`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, ContextManager, Protocol

import ray


class WaitTimeout(TimeoutError):
    """Ray work did not finish within the time given to `wait`."""


class Waiter(Protocol):
    def wait(self, refs: Any, *, timeout_s: float | None = None) -> Any:
        """`ray.get` of one ObjectRef or a list; WaitTimeout past `timeout_s` (the work
        itself is left to the caller)."""

    def progress(self, details: str) -> None:
        """A long job without Ray refs made progress (a file downloaded, an update replayed)."""

    def busy(self, details: str) -> ContextManager[None]:
        """Report liveness while the body runs one long blocking call with no progress of its own."""


class PlainWaiter:
    """Blocks in `ray.get`; reports nothing (tests, local scripts)."""

    def wait(self, refs: Any, *, timeout_s: float | None = None) -> Any:
        single = not isinstance(refs, list)
        pending = [refs] if single else list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                raise WaitTimeout(f"Ray work not done after {timeout_s:g} s")
            ray.get(ready)  # a failure ends the wait at once (the others may wait on it in a collective)
        values = ray.get([refs] if single else list(refs))
        return values[0] if single else values

    def progress(self, details: str) -> None:
        pass

    def busy(self, details: str) -> ContextManager[None]:
        return contextlib.nullcontext()
