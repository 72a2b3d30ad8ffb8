"""Waiting in tests for something another process does."""

from __future__ import annotations

import time


def wait_until(cond, timeout: float = 120.0, every: float = 0.2):
    """`cond()`'s first truthy value, polling every `every` s; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("condition not reached in time")
