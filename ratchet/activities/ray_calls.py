"""Waiting on Ray work from inside a Temporal activity.

Activities run in a thread pool; each wait polls Ray with a short timeout and heartbeats in
between, so Temporal notices a dead worker within the heartbeat timeout, and a cancelled
activity cancels its Ray task instead of leaving it running (DESIGN.md, rule 5).
"""

from __future__ import annotations

from typing import Any

import ray
from temporalio import activity
from temporalio.exceptions import CancelledError

POLL_SECONDS = 1.0


def wait(refs: Any, *, details: Any = None) -> Any:
    """`ray.get` that heartbeats; accepts one ObjectRef or a list."""
    single = not isinstance(refs, list)
    pending = [refs] if single else list(refs)
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_SECONDS)
        if activity.in_activity():
            if activity.is_cancelled():
                for ref in pending:
                    ray.cancel(ref, force=False)
                raise CancelledError("activity cancelled; its Ray work was cancelled too")
            activity.heartbeat(details)
    values = ray.get([refs] if single else list(refs))
    return values[0] if single else values
