"""The admission ledger's bookkeeping: grants and a FIFO queue of whole runs, as a plain
class (its rules and their reasons: src/ratchet/workers/actors/admission.py).

It runs as a tiny detached Ray actor on the head node, so this module imports nothing
heavy (no torch: the actor's process stays small); the unit tests use it directly with
made-up cluster resources.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

# A queue entry not renewed for this long is dropped; a waiting activity renews it every
# second. Longer than the default heartbeat timeout (30 s): a run whose worker died keeps
# its place until its retried attempt (on another worker) asks again.
LEASE_S = 60.0
# After the ledger is found rebuilt (lost with the Ray head), running runs reclaim their
# grants for this long before a queued run is admitted.
REBUILT_HOLD_S = 60.0
_EPS = 1e-9

Resources = dict[str, float]


@dataclass(frozen=True)
class Need:
    """What a run reserves in all (placement.run_need)."""

    cpus: float
    gpus: float = 0.0

    def text(self) -> str:
        """ "2 CPUs", "2 CPUs and 1 GPU", "1 GPU"."""
        cpus = f"{self.cpus:g} CPU{'' if self.cpus == 1 else 's'}"
        gpus = f"{self.gpus:g} GPU{'' if self.gpus == 1 else 's'}"
        return gpus if self.gpus and not self.cpus else f"{cpus} and {gpus}" if self.gpus else cpus

    def get(self, kind: str) -> float:
        return self.cpus if kind == "CPU" else self.gpus


@dataclass
class Admission:
    """One answer of the ledger to a run asking to be admitted."""

    admitted: bool
    queued_at: float  # when the run first queued (wall clock): its place in the queue
    ahead: int = 0  # runs queued before it
    status: str = ""  # "waiting for 2 CPUs; 1 run ahead; running: a" (admitted: "")


@dataclass
class _Entry:
    run_id: str
    need: Need
    queued_at: float
    held: Need = field(default_factory=lambda: Need(0.0))  # what its own live actors hold now
    renewed: float = 0.0  # monotonic


def _ray_resources() -> tuple[Resources, Resources]:
    import ray

    return ray.cluster_resources(), ray.available_resources()


class AdmissionLedger:
    """The grants and the queue; Ray runs its methods one at a time. `resources` gives
    (cluster totals, free now); injected by the unit tests, Ray's own by default."""

    def __init__(self, resources: Callable[[], tuple[Resources, Resources]] | None = None, *, clock=time.monotonic, wall=time.time):
        self._resources = resources or _ray_resources
        self._clock, self._wall = clock, wall
        self._granted: dict[str, Need] = {}
        self._queue: list[_Entry] = []
        self._created = clock()
        self._hold_until = 0.0

    # -- asked by runs ----------------------------------------------------------------------

    def request(self, run_id: str, need: Need, queued_at: float = 0.0, held: Need | None = None, lease_s: float = LEASE_S) -> Admission:
        """Admit run `run_id` or keep (or put) it in the queue, renewing its place for
        `lease_s`. `queued_at`: when it first queued, if it did (a retry, a rebuilt ledger)."""
        if run_id in self._granted:
            return Admission(True, queued_at)
        now = self._clock()
        entry = next((e for e in self._queue if e.run_id == run_id), None)
        if entry is None:
            if queued_at and now - self._created < REBUILT_HOLD_S:
                self._rebuilt()  # it queued before this ledger existed: the old one was lost
            entry = _Entry(run_id, need, queued_at or self._wall())
            self._queue.append(entry)
            self._queue.sort(key=lambda e: (e.queued_at, e.run_id))
        entry.need, entry.held, entry.renewed = need, held or Need(0.0), now + lease_s
        self._admit_waiting()
        if run_id in self._granted:
            return Admission(True, entry.queued_at)
        ahead = next(i for i, e in enumerate(self._queue) if e.run_id == run_id)
        return Admission(False, entry.queued_at, ahead, self._status(entry, ahead))

    def reclaim(self, run_id: str, need: Need) -> bool:
        """A run that creates actors holds its grant: granted at once if the ledger does not
        know it (it was admitted by a ledger since lost, or started before the queue
        existed), never refused (its actors are being rebuilt). True if it was unknown."""
        if run_id in self._granted:
            return False
        self._queue = [e for e in self._queue if e.run_id != run_id]
        self._granted[run_id] = need
        return True

    def leave(self, run_id: str) -> bool:
        """Drop the run's grant and queue entry (its actors were released, or it left the
        queue); True if it had either."""
        had = self._granted.pop(run_id, None) is not None or any(e.run_id == run_id for e in self._queue)
        self._queue = [e for e in self._queue if e.run_id != run_id]
        if had:
            self._admit_waiting()
        return had

    # -- looked at ------------------------------------------------------------------------

    def granted(self) -> dict[str, Need]:
        return dict(self._granted)

    def queue(self) -> list[tuple[str, Need, float]]:
        """(run id, need, queued_at), first in line first; expired entries dropped."""
        self._expire()
        return [(e.run_id, e.need, e.queued_at) for e in self._queue]

    # -- inside ---------------------------------------------------------------------------

    def _rebuilt(self) -> None:
        if not self._hold_until:
            self._hold_until = self._created + REBUILT_HOLD_S

    def _expire(self) -> None:
        now = self._clock()
        gone = [e.run_id for e in self._queue if e.renewed < now]
        if gone:
            self._queue = [e for e in self._queue if e.renewed >= now]

    def _admit_waiting(self) -> None:
        """Grant the head of the queue while it fits; nobody overtakes it."""
        self._expire()
        if self._clock() < self._hold_until:
            return
        total, free = self._resources()
        free = dict(free)
        while self._queue:
            head = self._queue[0]
            if self._blocked(head, total, free):
                return
            self._queue.pop(0)
            self._granted[head.run_id] = head.need
            for kind in ("CPU", "GPU"):  # Ray's view does not show it used yet
                free[kind] = free.get(kind, 0.0) - max(0.0, head.need.get(kind) - head.held.get(kind))

    def _blocked(self, entry: _Entry, total: Resources, free: Resources) -> str:
        """Why `entry` cannot be granted now ("" if it can)."""
        for kind in ("CPU", "GPU"):
            need = entry.need.get(kind)
            if need <= _EPS:
                continue
            granted = sum(n.get(kind) for n in self._granted.values())
            if granted + need > total.get(kind, 0.0) + _EPS:
                return "granted"
            if need - entry.held.get(kind) > free.get(kind, 0.0) + _EPS:
                return f"Ray has {max(0.0, free.get(kind, 0.0)):g} {kind}s free"
        return ""

    def _status(self, entry: _Entry, ahead: int) -> str:
        text = f"waiting for {entry.need.text()}; {ahead} run{'' if ahead == 1 else 's'} ahead"
        running = sorted(self._granted)
        if running:
            shown = ", ".join(running[:3]) + (f" and {len(running) - 3} more" if len(running) > 3 else "")
            text += f"; running: {shown}"
        if self._clock() < self._hold_until:
            text += "; the queue was rebuilt (Ray head restarted): running runs take their CPUs back first"
        elif ahead == 0:
            why = self._blocked(entry, *self._resources())
            if why and why != "granted":
                text += f"; {why} (CPUs held outside the queue)"
        return text
