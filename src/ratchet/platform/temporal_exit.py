"""Keep a process that used the Temporal SDK from finalizing under one of the SDK's threads.

The SDK answers each call from a Tokio thread of its Rust core, which takes the GIL to
hand the result to the event loop (`loop.call_soon_threadsafe`). Writing the loop's wake-up
byte drops the GIL for a moment, and the woken main thread can finish the script and start
finalizing the interpreter before the Tokio thread gets the GIL back; that thread then dies
in `PyGILState_Release` ("thread state must be current when releasing") and takes the
process down with exit 134 or a segfault (temporalio/sdk-python#300). Measured here: a
script that connects, makes one call and ends crashed 20 and 43 times in 150 (two runs)
with the CPUs busy, and none in 150 with this guard (`benchmarks/temporal_exit.py`).

The fix waits, in an `atexit` hook (which runs before finalization starts), until no
thread unknown to `threading` is inside an event loop's `call_soon_threadsafe`: that is
where the SDK's threads drop the GIL with a Python frame open, and each leaves in
microseconds once it has the GIL back. Each short sleep hands the GIL over. Other native
threads that run Python code (a library's own, which can stay there for good) are not
waited for. A hand-off still open after `limit_s` is named in the log and the exit goes on.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from types import FrameType

log = logging.getLogger(__name__)

# Long enough for a hand-off on a machine starved of CPU; only spent while one is open.
SETTLE_LIMIT_S = 5.0
_registered = False


def sdk_handoffs() -> list[int]:
    """Ids of the threads that `threading` did not start (native ones: the SDK's Tokio
    workers) that are inside an event loop's `call_soon_threadsafe`."""
    ours = {thread.ident for thread in threading.enumerate()}
    return [ident for ident, frame in sys._current_frames().items() if ident not in ours and _in_handoff(frame)]


def _in_handoff(frame: FrameType | None) -> bool:
    while frame is not None:
        code = frame.f_code
        if code.co_name == "call_soon_threadsafe" and "asyncio" in code.co_filename:
            return True
        frame = frame.f_back
    return False


def settle(limit_s: float = SETTLE_LIMIT_S) -> bool:
    """Wait until no native thread is in a hand-off to an event loop (True), or `limit_s` (False)."""
    deadline = time.monotonic() + limit_s
    while sdk_handoffs():
        if time.monotonic() >= deadline:
            log.warning("native threads %s still hand a result to an event loop at exit", sdk_handoffs())
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
