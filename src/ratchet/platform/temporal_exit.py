"""Keep a process that used the Temporal SDK from finalizing under one of the SDK's threads.

The SDK answers each call from a Tokio thread of its Rust core, which takes the GIL to
hand the result to the event loop (`loop.call_soon_threadsafe`). Writing the loop's wake-up
byte drops the GIL for a moment, and the woken main thread can finish the script and start
finalizing the interpreter before the Tokio thread gets the GIL back; that thread then dies
in `PyGILState_Release` ("thread state must be current when releasing") and takes the
process down with exit 134 or a segfault (temporalio/sdk-python#300). Measured here: a
script that connects, makes one call and ends crashed 43 times in 150 with the CPUs busy
(`benchmarks/temporal_exit.py`; none in 150 with this guard).

The fix waits, in an `atexit` hook (which runs before finalization starts), until no
thread unknown to `threading` is inside Python code: the SDK's callbacks are the only ones
that run there, and each takes microseconds once it has the GIL. Each short sleep hands the
GIL over. A thread that stays in Python longer than `limit_s` is named in the log and the
exit goes on.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time

log = logging.getLogger(__name__)

# Long enough for a callback on a machine starved of CPU; only spent while one is running.
SETTLE_LIMIT_S = 5.0
_registered = False


def foreign_threads_in_python() -> list[int]:
    """Ids of the threads running Python code that `threading` did not start: native
    threads (the SDK's Tokio workers) inside a callback into Python."""
    ours = {thread.ident for thread in threading.enumerate()}
    return [ident for ident in sys._current_frames() if ident not in ours]


def settle(limit_s: float = SETTLE_LIMIT_S) -> bool:
    """Wait until no foreign thread runs Python code (True), or `limit_s` (False)."""
    deadline = time.monotonic() + limit_s
    while foreign_threads_in_python():
        if time.monotonic() >= deadline:
            log.warning("native threads %s still run Python code at exit", foreign_threads_in_python())
            return False
        time.sleep(0.001)  # releases the GIL to the thread that waits for it
    return True


def guard_interpreter_exit() -> None:
    """Register `settle` to run at interpreter exit, once per process. Called wherever ratchet
    makes a Temporal client."""
    global _registered
    if not _registered:
        atexit.register(settle)
        _registered = True
