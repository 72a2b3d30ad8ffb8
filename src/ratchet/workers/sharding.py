"""How a trainer lays a Hugging Face decoder over its devices: FSDP2 units found from the
model's own `_no_split_modules`, mixed precision, activation checkpointing.

Every Hugging Face model class names the blocks that must stay whole on one device
(`_no_split_modules`: `LlamaDecoderLayer`, `Qwen3DecoderLayer`, `GemmaDecoderLayer`, ...).
Those are exactly the units worth sharding one by one, so wrapping by class name works for
any decoder family without knowing where it keeps its layers (`model.model.layers` is a
Llama-ism; other families nest them elsewhere). The root module is sharded last and holds
what is left (embeddings, final norm, a tied or untied head).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardingPlan:
    """What `shard_model` does to a model; resolved from `trainer.*` and the device."""

    mixed_precision: bool  # compute in bf16, reduce gradients in fp32
    activation_checkpointing: bool


def resolve_mixed_precision(setting: str, device: torch.device) -> bool:
    """`trainer.mixed_precision`: auto is bf16 on CUDA only (CPU bf16 matmuls are slow
    and the CPU tests compare fp32 numbers)."""
    if setting not in ("auto", "bf16", "none"):
        raise ValueError(f"trainer.mixed_precision={setting!r}; use auto, bf16 or none")
    return setting == "bf16" or (setting == "auto" and device.type == "cuda")


def unit_classes(model: torch.nn.Module) -> tuple[type, ...]:
    """The classes of the model's `_no_split_modules` that occur in it; a clear error when a
    model names none (it cannot be sharded block by block)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not found:
        raise ValueError(
            f"{type(model).__name__} declares no decoder blocks to shard (_no_split_modules={sorted(names) or None} "
            "matches no module in it); use a Hugging Face causal LM whose class sets _no_split_modules"
        )
    return tuple(sorted(found, key=lambda c: c.__name__))


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder block in the backward pass (Hugging Face's own switch, so
    parameter names, and therefore checkpoints and weight sync, are unchanged;
    non-reentrant, which FSDP2 requires)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing; set trainer.activation_checkpointing=false")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # A KV cache is useless in training and conflicts with recomputation.
    model.config.use_cache = False


def shard_model(model: torch.nn.Module, mesh, plan: ShardingPlan, *, trainable: bool = True) -> list[str]:
    """Apply FSDP2 (`fully_shard`) to every decoder block, then to the root, on `mesh`.
    Moves the parameters to the mesh's device. Returns the unit class names (for logs and
    tests). A frozen model (`trainable=False`, the reference policy) gets the same units
    and precision but no activation checkpointing: it never runs a backward pass."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    classes = unit_classes(model)
    if plan.activation_checkpointing and trainable:
        enable_activation_checkpointing(model)
    kwargs = {}
    if plan.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # Post-order: a block nested in another block is sharded before its parent.
    units = [m for m in model.modules() if isinstance(m, classes) and m is not model]
    for module in reversed(units):
        fully_shard(module, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    names = [c.__name__ for c in classes]
    log.debug("sharded %s: %d units of %s", type(model).__name__, len(units), names)
    return names
