"""One background thread per process that does all tracker work, in order.

Tracker calls sit on every step's path (`record_step`), and a tracker may be slow (MLflow
opening its store, a remote server, wandb starting its service process): the activity
hands the call to this thread and returns. Calls run in the order they were handed over,
so a run's points reach the tracker in step order. The thread keeps the open
`RunTracking` of each run (at most `MAX_OPEN`, least recently used closed first), so no
step reopens a store. A point still queued when the process dies is not lost: the next
process that opens the run catches the tracker up from metrics.jsonl.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from typing import Callable

from .session import RunTracking

log = logging.getLogger(__name__)

MAX_OPEN = 16


class TrackingDispatcher:
    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Callable[[], None], threading.Event | None]] = queue.Queue()
        self._open: OrderedDict[str, RunTracking] = OrderedDict()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- for the callers --------------------------------------------------------------

    def submit(self, fn: Callable[["TrackingDispatcher"], None]) -> None:
        self._start()
        self._queue.put((lambda: fn(self), None))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is done; False on timeout."""
        done = threading.Event()
        self._start()
        self._queue.put((lambda: None, done))
        return done.wait(timeout)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="ratchet-tracking", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, done = self._queue.get()
            try:
                fn()
            except Exception:  # noqa: BLE001 - the thread must outlive any one call
                log.warning("tracking call failed", exc_info=True)
            finally:
                if done is not None:
                    done.set()

    # -- for the calls, on the thread ---------------------------------------------------

    def get(self, run_id: str, opener: Callable[[], RunTracking]) -> RunTracking:
        """The run's open trackers, opened by `opener` on first use in this process."""
        found = self._open.get(run_id)
        if found is None:
            found = opener()
            found.start()
            self._open[run_id] = found
            while len(self._open) > MAX_OPEN:
                _, oldest = self._open.popitem(last=False)
                oldest.close()
        self._open.move_to_end(run_id)
        return found

    def peek(self, run_id: str) -> RunTracking | None:
        return self._open.get(run_id)

    def drop(self, run_id: str, failed: bool = False) -> None:
        found = self._open.pop(run_id, None)
        if found is not None:
            found.close(failed)


DISPATCHER = TrackingDispatcher()
