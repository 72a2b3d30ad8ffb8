"""Messages of the `admit_run` activity: a run asking the cluster's admission queue for
everything it needs at once (src/ratchet/workers/actors/admission.py).

Standard library only (plus `ratchet.types`), like `src/ratchet/types.py`, so the training
workflow imports it inside Temporal's sandbox.
"""

from __future__ import annotations

from dataclasses import dataclass

from ratchet.types import RunRef


@dataclass
class AdmitInput:
    run: RunRef
    # The queue status the workflow shows now: an attempt returns as soon as it changes
    # (the progress query shows the new one) or once admitted.
    status: str = ""
    # When the run first queued (the ledger's wall clock; 0: not yet): its place survives a
    # retried activity and a ledger rebuilt after a Ray head restart.
    queued_at: float = 0.0


@dataclass
class AdmitOutput:
    admitted: bool
    status: str = ""  # "waiting for 2 CPUs; 1 run ahead; running: RUN" while queued
    queued_at: float = 0.0
