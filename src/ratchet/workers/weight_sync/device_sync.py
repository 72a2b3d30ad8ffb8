"""The device transports of weight_sync/transport.py: CUDA IPC handles (`CUDA_IPC`,
trainer and engine colocated on a GPU) and an NCCL broadcast (`NCCL`, split on two GPU
pools), with the same manifest-first name check, finiteness check and abort on either
side as the object store's.

CUDA IPC, one sync:
  every trainer rank  send_weights(sync_id, "cuda_ipc", n): all gather each bucket (an
                      all-gather: every rank then holds it whole); a rank serving n > 0
                      replicas on its GPU packs it flat on the GPU and shares it (reduce_tensor)
  replica k           receive_weights("cuda_ipc", its rank, sync_id, j) -> IpcSource:
                      manifest, names checked; then for each bucket the handle (sync_take),
                      opened, loaded, and asking for the next one acknowledges it
  The rank keeps a bucket until every replica it serves has acknowledged it, and gathers
  at most IPC_WINDOW (2) ahead: the extra GPU memory is one or two flat buckets.

NCCL, one sync, in a group of trainer rank 0 and every replica made once per run
(`ensure_engine_group`, the transport's `prepare`: a TCPStore on rank 0's node; made again
when any member was recreated, which the group key, the members' actor ids, tells):
  every trainer rank  send_weights(sync_id, "nccl", n on rank 0): all gather; rank 0 waits
                      until every replica is ready for bucket i (it asked for it through
                      Ray), then broadcasts it flat from its GPU
  replica k           receive_weights("nccl", rank 0, sync_id, k) -> NcclSource: manifest
                      through Ray, names checked; for each bucket: ready (sync_take),
                      receive, load
  A receiver that refuses or fails aborts the sync through Ray before rank 0 broadcasts
  the next bucket, so no member is left waiting inside a collective.

The same code runs on CPU with torch's stand-ins (shared memory for the IPC handles, gloo
for NCCL): tests/unit/test_sync_transport.py drives it there through the actors' own
methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .buckets import Manifest, TensorSpec, WeightBucket, gather_tensors
from .cuda_ipc import FlatLayout, flat_layout, flatten_bucket, open_shared, share, unflatten_bucket
from .nccl import _from_rank0, bucket_layouts, init_engine_group, receive_bucket
from .protocol import STREAM_TIMEOUT_S, RelayedSource, call
from .relay import BucketRelay, SyncAborted
from .transport import from_rank_zero

# Buckets a rank shares ahead of the slowest replica it serves (IPC): gathering bucket i+1
# overlaps the replica's load of bucket i.
IPC_WINDOW = 2
# NCCL: rank 0 broadcasts bucket i only when every replica asked for it.
BROADCAST_WINDOW = 1


def local_device() -> torch.device:
    """The device this process syncs on: its current GPU, else the CPU (stand-in)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def group_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


# -- the trainer's side ----------------------------------------------------------------------


@dataclass
class GatheredBucket:
    """Bucket `index` as gathered, on the trainer's device in the wire dtype."""

    index: int
    specs: tuple[TensorSpec, ...]
    tensors: list[torch.Tensor]


@dataclass(frozen=True)
class IpcBucket:
    """What crosses to the replica: where each tensor lies in the flat bucket, and its handle."""

    index: int
    layout: FlatLayout
    handle: object


@dataclass
class SharedBucket:
    """A rank's flat bucket, kept alive (in the relay) until every replica it serves is past it."""

    index: int
    layout: FlatLayout
    flat: torch.Tensor
    handle: object

    def wire(self) -> IpcBucket:
        return IpcBucket(self.index, self.layout, self.handle)


def ipc_relay(consumers: int, device: torch.device, timeout_s: float = STREAM_TIMEOUT_S) -> BucketRelay:
    """A rank's relay of flat buckets shared in place on `device`, at most IPC_WINDOW ahead;
    a receiver is handed each one's layout and handle."""
    return BucketRelay(consumers, window=IPC_WINDOW, put=lambda g: share_gathered(g, device), wire=SharedBucket.wire, timeout_s=timeout_s)


def share_gathered(bucket: GatheredBucket, device: torch.device) -> SharedBucket:
    layout = flat_layout(bucket.specs)
    flat = flatten_bucket(bucket.tensors, layout, device)
    if flat.is_cuda:
        torch.cuda.current_stream(flat.device).synchronize()  # the bytes are there before the handle leaves
    return SharedBucket(bucket.index, layout, flat, share(flat))


def gather_and_share(entries: list, manifest: Manifest, relay: BucketRelay | None) -> tuple[int, Exception | None]:
    """Every trainer rank gathers every bucket (collectives); a rank with a relay (replicas on
    its GPU) offers each, shared in place (the relay's `put`). A failure stops the sharing,
    not the gathering (the other ranks' collectives must complete); it is returned."""
    sent, failure = 0, None
    for index, (specs, tensors) in enumerate(gather_tensors(entries, manifest)):
        if relay is not None and failure is None:
            try:
                relay.offer(GatheredBucket(index, specs, tensors))
                sent += manifest.bucket_bytes(index)
            except Exception as e:  # noqa: BLE001 - SyncAborted, or a CUDA error while packing
                failure = e
                relay.fail(f"{type(e).__name__}: {e}")
        del tensors
    return sent, failure


def gather_and_broadcast(
    entries: list, manifest: Manifest, relay: BucketRelay | None, group, device: torch.device
) -> tuple[int, Exception | None]:
    """Every trainer rank gathers every bucket; rank 0 (with `relay`) broadcasts each into
    the engine group once every replica is ready for it. A failure stops the broadcasts
    (the relay is failed, so the replicas stop asking) and is returned."""
    sent = 0
    failure: Exception | None = None
    if relay is not None and group is None:
        failure = SyncAborted("trainer rank 0 has no engine group: the driver must form it first (ensure_engine_group)")
        relay.fail(str(failure))
    for index, (specs, tensors) in enumerate(gather_tensors(entries, manifest)):
        if relay is not None and failure is None:
            try:
                relay.offer(GatheredBucket(index, specs, []))  # returns when every replica asked for bucket `index`
                layout = flat_layout(specs)
                flat = flatten_bucket(tensors, layout, device)
                group.broadcast([flat], _from_rank0()).wait()
                sent += layout.nbytes
                del flat
            except Exception as e:  # noqa: BLE001 - SyncAborted, or the group failed
                failure = e
                relay.fail(f"{type(e).__name__}: {e}")
        del tensors
    return sent, failure


@dataclass
class EngineGroup:
    """A member's handle on the run's engine group, and the key of the membership it was made for."""

    key: str
    rank: int
    world_size: int
    group: object
    device: torch.device


def join_engine_group(key: str, host: str, port: int, rank: int, world_size: int, *, timeout_s: float = STREAM_TIMEOUT_S) -> EngineGroup:
    device = local_device()
    group = init_engine_group(host, port, rank, world_size, backend=group_backend(device), timeout_s=timeout_s)
    return EngineGroup(key=key, rank=rank, world_size=world_size, group=group, device=device)


# -- a replica's side ------------------------------------------------------------------------


class IpcSource(RelayedSource):
    """A replica's pull of one sync from the trainer rank on its GPU, by IPC handle."""

    def __init__(self, rank, sync_id: str, consumer: int, *, device_index: int | None = None, timeout_s: float = STREAM_TIMEOUT_S):
        super().__init__(rank, sync_id, consumer, timeout_s)
        self.device_index = device_index

    def _buckets(self) -> Iterator[WeightBucket]:
        finished = False
        try:
            for index in range(len(self.manifest().buckets) + 1):
                # Asking for bucket i tells the rank this replica is done with i - 1.
                wire = call(self.rank, "sync_take", self.sync_id, self.consumer, index, timeout_s=self.timeout_s)
                if wire is None:
                    finished = True
                    return
                flat = open_shared(wire.handle, self.device_index)
                yield WeightBucket(index=index, specs=wire.layout.specs, arrays=[t for _, t in unflatten_bucket(flat, wire.layout)])
                if flat.is_cuda:
                    torch.cuda.current_stream(flat.device).synchronize()  # the engine's copies read it before the ack
                del flat
        finally:
            if not finished:
                self.close("the receiver stopped before the last bucket")


class NcclSource(RelayedSource):
    """A replica's receipt of one sync broadcast by trainer rank 0 into the engine group."""

    def __init__(self, rank0, sync_id: str, consumer: int, group: EngineGroup, *, timeout_s: float = STREAM_TIMEOUT_S):
        super().__init__(rank0, sync_id, consumer, timeout_s)
        self.group = group

    def _buckets(self) -> Iterator[WeightBucket]:
        layouts = bucket_layouts(self.manifest())
        finished = False
        try:
            for index, layout in enumerate(layouts):
                # Ready for bucket i (and done with i - 1): rank 0 broadcasts once every replica is.
                call(self.rank, "sync_take", self.sync_id, self.consumer, index, timeout_s=self.timeout_s)
                views = receive_bucket(self.group.group, layout, self.group.device)
                yield WeightBucket(index=index, specs=layout.specs, arrays=[t for _, t in views])
                del views
            call(self.rank, "sync_take", self.sync_id, self.consumer, len(layouts), timeout_s=self.timeout_s)
            finished = True
        finally:
            if not finished:
                self.close("the receiver stopped before the last bucket")

    def _leave(self, error: str | None) -> None:
        if error is None:
            super()._leave(None)
            return
        # One member missing from a broadcast would hang the others: the whole sync stops.
        call(self.rank, "sync_abort", self.sync_id, f"rollout replica {self.consumer}: {error}", timeout_s=30)


# -- the driver's side -----------------------------------------------------------------------


def actor_key(actor) -> str:
    """An actor's identity: a recreated actor (same name) has a new one."""
    actor_id = getattr(actor, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else f"local-{id(actor)}"


def ensure_engine_group(rank0, targets: list, wait: Callable) -> bool:
    """The engine group of trainer rank 0 and `targets`, made (again) unless every member
    already belongs to this very membership. Returns whether it was made now."""
    key = "/".join(actor_key(a) for a in [rank0, *targets])
    held = wait([rank0.engine_group_key.remote()] + [t.engine_group_key.remote() for t in targets])
    if all(k == key for k in held):
        return False
    host, port = wait([rank0.engine_group_address.remote()])[0]
    world = len(targets) + 1
    # Every member at once: each blocks in the TCPStore until all have joined.
    joins = [rank0.join_engine_group.remote(key, host, port, 0, world)]
    joins += [t.join_engine_group.remote(key, host, port, k + 1, world) for k, t in enumerate(targets)]
    wait(joins)
    return True


# -- the transports -------------------------------------------------------------------------


class CudaIpcTransport:
    """Each replica served by the trainer rank on its GPU, by IPC handles of flat buckets."""

    name = "cuda_ipc"

    def serving(self, plan, cfg, replicas: int) -> list[int]:
        from ratchet.config.sync_transport import ipc_partners

        partners = ipc_partners(plan, cfg)
        if partners is None or len(partners) != replicas:
            raise ValueError(f"a CUDA IPC sync needs a trainer rank on the GPU of each of the {replicas} rollout replicas")
        return partners

    def prepare(self, ranks: list, targets: list, wait: Callable) -> None:
        pass  # a handle needs nothing made between the actors

    def open_relay(self, sender, consumers: int) -> BucketRelay:
        return ipc_relay(consumers, sender.sync_device())

    def send(self, sender, entries: list, manifest: Manifest, relay: BucketRelay | None) -> tuple[int, Exception | None]:
        return gather_and_share(entries, manifest, relay)

    def source(self, receiver, rank, sync_id: str, consumer: int) -> IpcSource:
        device_index = torch.cuda.current_device() if torch.cuda.is_available() else None
        return IpcSource(rank, sync_id, consumer, device_index=device_index)


class NcclTransport:
    """One broadcast per bucket from trainer rank 0 into the engine group (made first)."""

    name = "nccl"

    def serving(self, plan, cfg, replicas: int) -> list[int]:
        return from_rank_zero(replicas)

    def prepare(self, ranks: list, targets: list, wait: Callable) -> None:
        ensure_engine_group(ranks[0], targets, wait)

    def open_relay(self, sender, consumers: int) -> BucketRelay:
        return BucketRelay(consumers, window=BROADCAST_WINDOW, put=lambda g: g.index, timeout_s=STREAM_TIMEOUT_S, collective=True)

    def send(self, sender, entries: list, manifest: Manifest, relay: BucketRelay | None) -> tuple[int, Exception | None]:
        group = sender.engine_group
        if relay is None or group is None:  # a rank that only gathers, or rank 0 outside the group (it fails the relay)
            return gather_and_broadcast(entries, manifest, relay, None, local_device())
        return gather_and_broadcast(entries, manifest, relay, group.group, group.device)

    def source(self, receiver, rank, sync_id: str, consumer: int) -> NcclSource:
        if receiver.engine_group is None:
            raise RuntimeError("this rollout replica is in no engine group: the driver forms it first (ensure_engine_group)")
        return NcclSource(rank, sync_id, consumer, receiver.engine_group)


CUDA_IPC = CudaIpcTransport()
NCCL = NcclTransport()
