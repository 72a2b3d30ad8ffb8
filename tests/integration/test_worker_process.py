"""`ratchet worker` as a process: it serves, and SIGTERM stops it cleanly."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from ratchet.platform.demo import start_worker_process

pytestmark = pytest.mark.integration


def test_sigterm_shuts_the_worker_down_gracefully(platform):
    log = Path(platform.settings.state_dir) / "logs" / "worker.log"
    before = log.read_text() if log.exists() else ""
    proc = start_worker_process(platform.settings)
    deadline = time.monotonic() + 300  # a hang guard: a worker start is seconds idle, a minute or more on a loaded 2-core machine
    while time.monotonic() < deadline and "worker on" not in log.read_text()[len(before) :]:
        assert proc.poll() is None, "worker exited before serving"
        time.sleep(0.2)
    assert "worker on" in log.read_text()[len(before) :]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert "shutting down" in log.read_text()[len(before) :]
