"""The trainer's part of a sync, the same on every rank and for every transport: plan the
buckets, refuse non-finite weights before anything leaves, gather bucket by bucket."""

from __future__ import annotations

from typing import Callable

import torch

from .buckets import MB, Manifest, WeightBucket, gather_buckets, make_manifest, sync_entries
from .relay import SyncAborted
from .sources import ModelSource

# Prefixes wrappers add to parameter names (activation checkpointing, torch.compile, FSDP1):
# an engine knows the Hugging Face names only.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def sync_plan(model: torch.nn.Module, *, engine_dtype: str, bucket_mb: float, version: int) -> tuple[list, Manifest]:
    """(entries, manifest) of a sync of `model` (sharded or not) as policy `version`."""
    found, aliases = sync_entries(model)
    entries = [(hf_name(n), t) for n, t in found]
    aliases = [(hf_name(a), hf_name(n)) for a, n in aliases]
    manifest = make_manifest(entries, engine_dtype=engine_dtype, bound_bytes=max(1, int(bucket_mb * MB)), version=version, aliases=aliases)
    return entries, manifest


def check_finite_shards(entries: list, what: str, world_size: int) -> None:
    """NonFiniteError on every rank alike when any rank's shard holds NaN/inf: checked on
    the local shards before the first gather, so a bad version is refused before any of
    it reaches an engine (a sync stopped halfway would leave the engine torn)."""
    import torch.distributed as dist

    from ..policy_update import check_finite_weights
    from ratchet.errors import NonFiniteError

    local = {name: (t.to_local() if hasattr(t, "to_local") else t).detach() for name, t in entries}
    error: NonFiniteError | None = None
    try:
        check_finite_weights(local, what)
    except NonFiniteError as e:
        error = e
    if world_size > 1:
        flag = torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag)
        if flag.item() > 0 and error is None:
            error = NonFiniteError(
                f"{what} hold NaN/inf values on another trainer rank; they were not saved or synced. "
                "Resume the run from its last good checkpoint with a lower trainer.lr or trainer.grad_clip"
            )
    if error is not None:
        raise error


def gather_and_offer(entries: list, manifest: Manifest, offer: Callable[[WeightBucket], None] | None) -> tuple[int, Exception | None]:
    """Gather every bucket (every rank: the gathers are collectives) and hand each to
    `offer` (rank 0) as it is made. If `offer` fails, the gathering goes on to the end so
    the other ranks' collectives complete; the failure is returned, not raised."""
    sent, failure = 0, None
    for bucket in gather_buckets(entries, manifest):
        if offer is not None and failure is None:
            try:
                offer(bucket)
                sent += bucket.nbytes
            except SyncAborted as e:
                failure = e
        del bucket
    return sent, failure


def local_source(model: torch.nn.Module, *, engine_dtype: str, bucket_mb: float, version: int) -> ModelSource:
    """The in-process loop's sync: the model's buckets gathered as the engine loads them."""
    entries, manifest = sync_plan(model, engine_dtype=engine_dtype, bucket_mb=bucket_mb, version=version)
    return ModelSource(entries, manifest)
