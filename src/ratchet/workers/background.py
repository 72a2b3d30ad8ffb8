"""A call on a thread of its own, whose error the joiner re-raises: work that must be done
before a result is reported, overlapped with the work that produces it."""

from __future__ import annotations

import threading
from typing import Callable


class BackgroundCall(threading.Thread):
    """`fn()` on a thread started at once; after `join()`, `error` is what it raised (None:
    nothing). The caller re-raises it: the work must not fail silently."""

    def __init__(self, fn: Callable[[], object], name: str):
        super().__init__(name=name, daemon=True)
        self.fn = fn
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by whoever joins it
            self.error = e
