"""A long-lived process's start-up without Python's cyclic garbage collector, and what it
built frozen out of the collector's sight afterwards.

An actor's start imports torch, Ray and transformers and loads a model: about 500,000
objects, which the collector scans again and again while they are being made (0.5-0.9
CPU-s of an actor's ~5 s start on this machine, measured with `gc.callbacks`), and again
at every full collection for the rest of the process's life (about 5% of a tiny model's
step: 23 ms of 460). Almost none of it is garbage: it lives as long as the process. So the
collector is off while a process starts, and `gc.freeze()` then moves everything start-up
built into the permanent generation, which the collector skips; what the process makes
afterwards is collected as usual. At exit the objects are handed back (`gc.unfreeze`),
so that finalisation sees them as it otherwise would.

Standard library only: imported by every actor class and the worker's entry point.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
from collections.abc import Iterator
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_UNFREEZE_AT_EXIT: list[bool] = []


@contextlib.contextmanager
def start_up() -> Iterator[None]:
    """Run the body with the collector off; then freeze what exists and turn it back on
    (if it was on: a caller that turned it off keeps it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if not _UNFREEZE_AT_EXIT:
            atexit.register(gc.unfreeze)
            _UNFREEZE_AT_EXIT.append(True)
        if was_enabled:
            gc.enable()


def during_start_up(fn: F) -> F:
    """Decorator for what starts a long-lived process's state: an actor's `__init__`, a
    trainer rank's `setup` (model load, sharding). The call runs inside `start_up()`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with start_up():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
