"""A process that used the Temporal SDK waits, at exit, for the SDK's threads to leave Python.

The crash it prevents (temporalio/sdk-python#300) is a race with the SDK's Tokio threads,
too rare on an idle machine for a test to catch it: `benchmarks/temporal_exit.py` measures
it against a real Temporal server. Here a `_thread` thread stands in for a Tokio thread: it
runs Python code and `threading` does not know it, which is all `settle` looks at.
"""

from __future__ import annotations

import _thread
import subprocess
import sys
import threading
import time

import pytest

from ratchet.platform.temporal_exit import foreign_threads_in_python, settle

EXITING_UNDER_A_CALLBACK = """
import _thread, atexit, sys

marker, guarded = sys.argv[1], sys.argv[2] == "guarded"
if guarded:
    from ratchet.platform.temporal_exit import guard_interpreter_exit

    guard_interpreter_exit()
else:
    sys.setswitchinterval(1e6)  # the callback never asks the main thread for the GIL
gate, running = _thread.allocate_lock(), _thread.allocate_lock()
gate.acquire()
running.acquire()


def callback():  # a Tokio thread inside the SDK's callback: it waits without the GIL
    running.release()
    gate.acquire()
    with open(marker, "w") as f:
        f.write("finished")


_thread.start_new_thread(callback, ())
running.acquire()  # the callback is in Python code
# atexit runs last-registered first: the callback is let go as the interpreter exits, after
# the script's last line, as the SDK's last callback is.
atexit.register(gate.release)
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_exit_waits_for_a_native_thread_inside_python(tmp_path, guarded):
    """Guarded, the callback finishes before the interpreter finalizes; unguarded (what the
    SDK does alone), it never gets the GIL back, which is where the SDK's thread crashes.
    The unguarded process runs no Python code after the script (-I -S: no site, no
    atexit hooks of imported modules), so it cannot hand the GIL over by chance."""
    marker = tmp_path / "marker"
    flags = [] if guarded else ["-I", "-S"]
    out = subprocess.run(
        [sys.executable, *flags, "-c", EXITING_UNDER_A_CALLBACK, str(marker), "guarded" if guarded else "bare"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if guarded:
        assert out.returncode == 0, out.stderr
        assert marker.read_text() == "finished"
    else:
        assert not marker.exists(), "the interpreter finalized after the callback: this test shows nothing"


def test_settle_waits_for_foreign_threads_only_and_gives_up_after_its_limit():
    stop, running = threading.Event(), _thread.allocate_lock()

    def in_python_until_stopped():
        if running.locked():
            running.release()
        while not stop.is_set():
            time.sleep(0.005)

    known = threading.Thread(target=in_python_until_stopped, daemon=True)
    known.start()
    try:
        assert foreign_threads_in_python() == []  # a thread `threading` started is not waited for
        assert settle(limit_s=60.0)
    finally:
        stop.set()
        known.join()

    stop.clear()
    running.acquire()
    _thread.start_new_thread(in_python_until_stopped, ())
    running.acquire()  # the thread is in Python code
    try:
        assert len(foreign_threads_in_python()) == 1
        assert not settle(limit_s=0.1)  # it never leaves Python: settle gives up
    finally:
        stop.set()
    assert settle(limit_s=60.0)  # it leaves once stopped: settle returns as it does
    assert foreign_threads_in_python() == []
