"""A process that used the Temporal SDK waits, at exit, for the SDK's threads to finish
handing a result to an event loop.

The crash it prevents (temporalio/sdk-python#300) is a race with the SDK's Tokio threads,
too rare on an idle machine for a test to catch: `benchmarks/temporal_exit.py` measures it
against a real Temporal server. Here a `_thread` thread stands in for a Tokio thread: it
runs Python code and `threading` does not know it, and it blocks inside a real loop's
`call_soon_threadsafe` (the loop's wake-up write replaced by one that waits on a lock),
which is where the SDK's threads drop the GIL. Each case runs in a process of its own: the
test process has native threads of its own libraries.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HANDOFF = """
import _thread, asyncio


def blocked_handoff(finish):
    # A native thread inside loop.call_soon_threadsafe, waiting (without the GIL) in the
    # loop's wake-up write until `gate` is released, then running `finish`.
    gate, running = _thread.allocate_lock(), _thread.allocate_lock()
    gate.acquire()
    running.acquire()
    loop = asyncio.new_event_loop()

    def wake_up_write():
        running.release()
        gate.acquire()
        finish()

    loop._write_to_self = wake_up_write
    _thread.start_new_thread(loop.call_soon_threadsafe, (lambda: None,))
    running.acquire()  # it is in the hand-off now
    return gate
"""

EXITING_UNDER_A_HANDOFF = (
    HANDOFF
    + """
import atexit, sys

marker, guarded = sys.argv[1], sys.argv[2] == "guarded"
if guarded:
    from ratchet.platform.temporal_exit import guard_interpreter_exit

    guard_interpreter_exit()
else:
    sys.setswitchinterval(1e6)  # the thread never asks the main thread for the GIL


def finish():
    with open(marker, "w") as f:
        f.write("finished")


gate = blocked_handoff(finish)
# atexit runs last-registered first: the hand-off is let go as the interpreter exits, after
# the script's last line, as the SDK's last one is.
atexit.register(gate.release)
"""
)

SETTLING = (
    HANDOFF
    + """
import _thread, threading, time

from ratchet.platform.temporal_exit import sdk_handoffs, settle

stop, started = threading.Event(), _thread.allocate_lock()
started.acquire()


def elsewhere():  # a native thread in Python code that is no hand-off: never waited for
    started.release()
    while not stop.is_set():
        time.sleep(0.005)


_thread.start_new_thread(elsewhere, ())
started.acquire()
assert sdk_handoffs() == [], sdk_handoffs()
assert settle(limit_s=60.0)

gate = blocked_handoff(lambda: None)
assert len(sdk_handoffs()) == 1, sdk_handoffs()
assert not settle(limit_s=0.1)  # a hand-off that does not end: settle gives up
gate.release()
assert settle(limit_s=60.0)  # it ends once let go: settle returns as it does
assert sdk_handoffs() == []
stop.set()
print("settled")
"""
)


@pytest.mark.parametrize("guarded", [True, False])
def test_exit_waits_for_a_native_thread_handing_a_result_to_a_loop(tmp_path, guarded):
    """Guarded, the hand-off finishes before the interpreter finalizes; unguarded (what the
    SDK does alone), the thread never gets the GIL back, which is where the SDK's thread
    crashes. The unguarded process runs no Python code after the script (-I -S: no site,
    no atexit hooks of imported modules), so it cannot hand the GIL over by chance."""
    marker = tmp_path / "marker"
    flags = [] if guarded else ["-I", "-S"]
    out = subprocess.run(
        [sys.executable, *flags, "-c", EXITING_UNDER_A_HANDOFF, str(marker), "guarded" if guarded else "bare"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if guarded:
        assert out.returncode == 0, out.stderr
        assert marker.read_text() == "finished"
    else:
        assert not marker.exists(), "the interpreter finalized after the hand-off: this test shows nothing"


def test_settle_waits_for_hand_offs_only_and_gives_up_after_its_limit():
    out = subprocess.run([sys.executable, "-c", SETTLING], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "settled", out.stderr
