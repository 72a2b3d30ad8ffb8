"""The lease that lets one activity at a time rebuild a run's trainer or critic
(actors/restore_lease.py takes and renews it), as a plain class that runs as a tiny
detached Ray actor.

A Ray actor's process imports the module of its class, with every package above it. This
one is outside `workers.actors`, whose `__init__` brings in the run's actor groups and
torch with them: about 2 CPU-s to start the lease's process there, 0.7 here.
"""

from __future__ import annotations

import time


class RestoreLease:
    """A lease with a holder and an expiry; Ray runs its methods one at a time."""

    def __init__(self) -> None:
        self._holder: str | None = None
        self._until = 0.0

    def acquire(self, holder: str, lease_s: float) -> bool:
        """Take (or renew) the lease for `holder` if it is free, expired or already theirs."""
        now = time.monotonic()
        if self._holder in (None, holder) or now >= self._until:
            self._holder, self._until = holder, now + lease_s
            return True
        return False

    def release(self, holder: str) -> None:
        if self._holder == holder:
            self._holder = None

    def holder(self) -> str | None:
        return self._holder if time.monotonic() < self._until else None
