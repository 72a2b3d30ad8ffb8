"""One trainer rank's side of every weight sync: the plan of the policy's buckets, the
relays through which it serves its receivers, the weights it publishes after an update
(partial rollouts; a one-bucket model's one-call sync), and its membership of the NCCL
transport's engine group. `TrainerWorker` holds one and answers the receivers' calls
through it; a transport (transport.py) is handed it as the `sender`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import ray

from ratchet.catalog.weight_transports import WEIGHT_TRANSPORTS

from ..lora import sync_view
from .protocol import RelayRegistry, StreamReport
from .ray_transport import PublishedSource
from .trainer_side import check_finite_shards, gather_and_offer, sync_plan

if TYPE_CHECKING:
    from ratchet.config.schema import RunConfig

    from ..policy_update import PolicyTrainer
    from .device_sync import EngineGroup


class WeightSender:
    def __init__(self, cfg: RunConfig, rank: int, world_size: int, policy: Callable[[], PolicyTrainer]):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self._policy = policy  # the rank's policy trainer, once the rank is set up
        self.relays = RelayRegistry()  # a rank with receivers: the syncs it serves
        # (version, its buckets in the object store) after each update, on rank 0, when syncs
        # overlap updates (partial rollouts): a sync need not wait for the update in flight.
        self.published: tuple[int, PublishedSource] | None = None
        self.engine_group: EngineGroup | None = None  # rank 0: its membership of the NCCL transport's engine group

    def plan(self):
        t = self._policy()
        # sync_view: with LoRA, base + adapter merged under the base model's names (workers/lora.py).
        return sync_plan(
            sync_view(t.model), engine_dtype=self.cfg.model.dtype, bucket_mb=self.cfg.trainer.sync_bucket_mb, version=t.version
        )

    def publish(self) -> None:
        """Put this version's buckets into the object store (rank 0; every rank gathers)."""
        source = self._put_buckets(*self.plan())
        if source is not None:
            self.published = (self._policy().version, source)

    def one_bucket(self) -> PublishedSource | None:
        """The weights as one published bucket (rank 0; every rank gathers), or None when
        they need more than one (`sync_weights` then streams them)."""
        entries, manifest = self.plan()
        if len(manifest.buckets) != 1:
            return None
        return self._put_buckets(entries, manifest)

    def _put_buckets(self, entries, manifest) -> PublishedSource | None:
        """Every bucket of `manifest` into the object store, once the weights are checked
        finite; the source on rank 0, None on the others (they only join the gathers)."""
        check_finite_shards(entries, f"the weights of policy v{self._policy().version} (to be synced)", self.world_size)
        refs: list = []
        put = refs.append if self.rank == 0 and ray.is_initialized() else None
        gather_and_offer(entries, manifest, (lambda b: put(ray.put(b))) if put else None)
        return PublishedSource(manifest, refs) if put else None

    def send(self, sync_id: str, transport: str, consumers: int) -> StreamReport:
        """Plan, refuse non-finite weights before the first bucket leaves, then gather bucket
        by bucket (every rank: the gathers are collectives) and send by `transport`
        (catalog/weight_transports.py) to the `consumers` receivers this rank serves (0: it
        only joins the gathers)."""
        way = WEIGHT_TRANSPORTS.get(transport)
        relay = way.open_relay(self, consumers) if consumers > 0 else None
        t0 = time.perf_counter()
        if relay is not None:
            self.relays.open(sync_id, relay)
        try:
            entries, manifest = self.plan()
            check_finite_shards(entries, f"the weights of policy v{self._policy().version} (to be synced)", self.world_size)
        except Exception as e:
            if relay is not None:
                relay.fail(f"{type(e).__name__}: {e}")
            raise
        if relay is not None:
            relay.start(manifest)
        sent, failure = way.send(self, entries, manifest, relay)
        if failure is not None:
            raise failure
        return StreamReport(
            version=manifest.version,
            bytes=sent,
            buckets=len(manifest.buckets),
            seconds=time.perf_counter() - t0,
            window_peak=relay.peak_stored if relay is not None else 0,
        )

    def sync_device(self):
        """The device this rank's weights (and so its shared buckets) are on."""
        return next(self._policy().model.parameters()).device

    def join_engine_group(self, key: str, host: str, port: int, rank: int, world_size: int) -> str:
        """Rank 0 joins (hosts) the engine group for membership `key`; an older group is
        dropped (a member was recreated)."""
        from .device_sync import join_engine_group

        if self.rank != 0 or rank != 0:
            raise ValueError(f"only trainer rank 0 is member 0 of the engine group (this is rank {self.rank}, asked to be {rank})")
        self.engine_group = None
        self.engine_group = join_engine_group(key, host, port, 0, world_size)
        return key
