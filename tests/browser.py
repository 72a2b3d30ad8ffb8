"""Headless Chromium (Debian's package, installed by `make test`) for the tests that look
at the Temporal and MLflow UIs, and the folder their screenshots are kept in."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"


def artifacts_dir() -> Path:
    """Where screenshots are kept for a person to look at ($RATCHET_TEST_ARTIFACTS, else
    .ratchet/test-artifacts in the checkout: git-ignored)."""
    folder = Path(os.environ.get("RATCHET_TEST_ARTIFACTS") or Path(__file__).resolve().parents[1] / ".ratchet" / "test-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def chromium(url: str, *, screenshot: Path | None = None, budget_ms: int = 15000) -> str:
    """Render `url` headless (a JS app: virtual time lets it fetch and draw); the DOM it
    ends with, or the screenshot when asked for. The flags keep Chromium off the network
    this machine does not have (no background fetches) and in a fresh profile."""
    with tempfile.TemporaryDirectory(prefix="rt-chromium-") as profile:
        what = [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
        out = subprocess.run(
            [
                CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", "--window-size=1600,1000", f"--virtual-time-budget={budget_ms}", *what, url,
            ],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout
