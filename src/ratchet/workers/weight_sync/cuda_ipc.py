"""Weight sync by CUDA IPC handles, for a trainer and an engine colocated on one GPU: the
trainer packs a bucket into one flat device tensor and sends only its IPC handle (tens of
bytes); the engine process opens the handle (a view of the trainer's memory, no copy
over PCIe), copies the weights into its own parameters and acknowledges, after which the
trainer frees or reuses the bucket. Peak extra GPU memory: the flat bucket(s) in flight.

`flatten_bucket` / `unflatten_bucket` are pure and run on CPU too (the tests check them
there); `share` / `open_shared` are torch's own tensor reductions
(torch.multiprocessing.reductions.reduce_tensor and the rebuild function it returns),
which carry a CUDA IPC handle for a CUDA tensor, and shared memory for a CPU one: the
CPU tests run the same code. colocated_process.py pairs a trainer with an engine process
through it without Ray (what the GPU check measures).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .buckets import TensorSpec

# Each tensor starts at a multiple of this many bytes in a flat bucket (aligned loads).
ALIGN_BYTES = 256


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a bucket lies in its flat byte buffer."""

    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]  # byte offsets
    nbytes: int


def flat_layout(specs: tuple[TensorSpec, ...]) -> FlatLayout:
    offsets, pos = [], 0
    for s in specs:
        pos += -pos % ALIGN_BYTES
        offsets.append(pos)
        pos += s.nbytes
    return FlatLayout(specs=specs, offsets=tuple(offsets), nbytes=pos)


def flatten_bucket(tensors: list[torch.Tensor], layout: FlatLayout, device: torch.device | str) -> torch.Tensor:
    """One uint8 tensor on `device` holding `tensors` at the layout's offsets."""
    flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    for t, spec, off in zip(tensors, layout.specs, layout.offsets):
        t = t.detach().to(device=device, dtype=getattr(torch, spec.dtype)).contiguous()
        flat[off : off + spec.nbytes].copy_(t.view(-1).view(torch.uint8))
    return flat


def unflatten_bucket(flat: torch.Tensor, layout: FlatLayout) -> list[tuple[str, torch.Tensor]]:
    """(name, view) pairs into `flat`: no copy."""
    out = []
    for spec, off in zip(layout.specs, layout.offsets):
        view = flat[off : off + spec.nbytes].view(getattr(torch, spec.dtype)).view(spec.shape)
        out.append((spec.name, view))
    return out


def share(flat: torch.Tensor):
    """A picklable handle of `flat` (for a CUDA tensor: its CUDA IPC handle). The sender
    keeps `flat` alive until the receiver acknowledged."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(flat)


def open_shared(handle, device_index: int | None = None) -> torch.Tensor:
    """The tensor a `share` handle names, in this process. `device_index`: the GPU as this
    process numbers it, when CUDA_VISIBLE_DEVICES differs between the two processes."""
    rebuild, args = handle
    if device_index is not None and len(args) > 6:
        args = list(args)
        args[6] = device_index  # rebuild_cuda_tensor's storage_device
    return rebuild(*args)
