"""One interface for how a weight sync's bytes travel, and the one driver that runs a sync
through any transport (the table: catalog/weight_transports.py; which one a run takes:
config/sync_transport.py).

A sync has three sides, and each reaches the transport through one method:
  the driver      `relayed_sync`: which trainer rank serves each replica (`serving`, from
                  the transport), what must exist first (`prepare`: NCCL's engine group),
                  then every rank's `send_weights` and every replica's `receive_weights`
                  at once; a replica that fails aborts the ranks that serve it
  a trainer rank  `TrainerWorker.send_weights(sync_id, transport, consumers)`: a rank with
                  receivers opens a relay (`open_relay`); every rank gathers each bucket
                  (the gathers are collectives) and a rank with a relay sends it through
                  (`send`); receivers then ask `sync_manifest` / `sync_take` / `sync_leave`
  a replica       `RolloutWorker.receive_weights(transport, rank, sync_id, consumer)`: the
                  source that pulls the buckets from its rank (`source`), loaded as every
                  weight source is (names checked against the manifest first)

A fourth transport (a delta sync, say) is one class with these methods in a module of
its own and one line in the catalog; neither actor grows a method.
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import TYPE_CHECKING, Callable, Protocol

from .protocol import SyncResult

if TYPE_CHECKING:
    from ratchet.config.placement_plan import PlacementPlan
    from ratchet.config.schema import RunConfig

    from .buckets import Manifest
    from .relay import BucketRelay
    from .sources import WeightSource


class WeightTransport(Protocol):
    name: str  # its catalog name; also SyncResult.transport

    def serving(self, plan: "PlacementPlan", cfg: "RunConfig", replicas: int) -> list[int]:
        """The trainer rank that serves each of `replicas` rollout replicas."""
        ...

    def prepare(self, ranks: list, targets: list, wait: Callable) -> None:
        """Make what the sync needs between the actors before it starts (the driver's side)."""
        ...

    def open_relay(self, sender, consumers: int) -> "BucketRelay":
        """The relay through which trainer rank `sender` hands its buckets to `consumers` receivers."""
        ...

    def send(self, sender, entries: list, manifest: "Manifest", relay: "BucketRelay | None") -> tuple[int, Exception | None]:
        """Gather every bucket (every rank) and send each through `relay` (a rank with
        receivers): (bytes sent, the failure that stopped the sending, if any). A failure
        stops the sending, never the gathering: the other ranks' collectives must end."""
        ...

    def source(self, receiver, rank, sync_id: str, consumer: int) -> "WeightSource":
        """Rollout replica `receiver`'s pull of sync `sync_id` from trainer `rank`, as its receiver `consumer`."""
        ...


def from_rank_zero(replicas: int) -> list[int]:
    """Every replica served by trainer rank 0 (which holds each gathered bucket whole)."""
    return [0] * replicas


def relayed_sync(
    transport: WeightTransport, ranks: list, targets: list, wait: Callable, *, serving: list[int] | None = None, sync_id: str | None = None
) -> SyncResult:
    """Load the trainer's weights (ranks: every trainer rank's handle) into every target
    replica by `transport`; replica k is served by rank `serving[k]` (default: rank 0).
    `wait`: how to wait on the actors' answers (the activity's heartbeating one)."""
    if not targets:
        raise ValueError("a weight sync needs at least one rollout replica")
    serving = from_rank_zero(len(targets)) if serving is None else list(serving)
    if len(serving) != len(targets) or not all(0 <= r < len(ranks) for r in serving):
        raise ValueError(f"{transport.name} sync: serving ranks {serving} for {len(targets)} replicas and {len(ranks)} trainer ranks")
    sync_id = sync_id or uuid.uuid4().hex
    transport.prepare(ranks, targets, wait)
    served = Counter(serving)
    slot: list[int] = []  # replica k is receiver slot[k] of its rank
    seen: Counter[int] = Counter()
    for rank in serving:
        slot.append(seen[rank])
        seen[rank] += 1
    gathers = [r.send_weights.remote(sync_id, transport.name, served.get(i, 0)) for i, r in enumerate(ranks)]
    loads = [t.receive_weights.remote(transport.name, ranks[serving[k]], sync_id, slot[k]) for k, t in enumerate(targets)]
    try:
        received = wait(loads)
    except BaseException as load_error:
        # The trainer's own failure (non-finite weights, a lost rank) is the cause to report;
        # otherwise the replica's. Either way the serving ranks stop waiting for receivers.
        for i in served:
            ranks[i].sync_abort.remote(sync_id, f"a rollout replica failed to load: {type(load_error).__name__}: {load_error}")
        try:
            wait(gathers)
        except BaseException as trainer_error:
            raise trainer_error from load_error
        raise
    reports = wait(gathers)
    return SyncResult(
        version=reports[0].version, bytes=int(sum(received)), buckets=reports[0].buckets, replicas=len(targets), transport=transport.name,
        window_peak=max(r.window_peak for r in reports),
    )  # fmt: skip
