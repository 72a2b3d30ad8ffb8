"""LoRA (peft) on the trainer's policy: adapters trained, the base frozen and shared with
the reference, the merged weights what the rollout engines get.

`trainer.lora.rank > 0` wraps the policy in a peft `PeftModel` (`load_policy`). Then:

- only the adapters (`lora_A`, `lora_B` of each target linear) require gradients, and the
  optimizer holds only them (`trainable_parameters`);
- the KL reference is the same model with the adapters off (`adapter_disabled`, peft's
  `disable_adapter()`), so no second copy of the base is kept: with B initialised to zero
  the adapter-off model *is* the initial policy;
- a checkpoint's trainer state holds the adapters and their AdamW moments only
  (checkpointing.py saves what requires grad: DCP's `ignore_frozen_params`), and its
  `hf/` folder the adapter in peft's layout (`write_adapter_folder`: loadable with
  `PeftModel.from_pretrained(base, folder)`). The base stays where it was (model.path, or
  the run's warm-up model); the checkpoint records which (`LoraBase`: its address and a
  fingerprint of its weights), and a restore onto another base is refused;
- a weight sync sends base + delta merged, under the base model's Hugging Face names
  (`sync_view`): each adapted weight is W + (alpha / r) * B @ A, computed bucket by bucket
  as the sync gathers it, so every engine (HF, vLLM, SGLang) loads it unchanged and no
  merged copy of the model is ever held. Why merged rather than the adapter: docs/lora.md
  (measured with benchmarks/lora_sync.py).

QLoRA (`trainer.lora.quantize: "4bit"`) loads the base in 4-bit NF4 with bitsandbytes,
which needs CUDA: refused here, with the reason, on a machine without it.

Under FSDP2 (world size > 1) the adapters are sharded like every other parameter; the
merge gathers base, A and B (collectives, the same order on every rank).

Why one module of ~450 lines: one job, LoRA as the trainer, a checkpoint, the export and a
weight sync see it; the adapters' build, merge and folder format change together.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

if TYPE_CHECKING:
    from ratchet.config.schema import RunConfig

log = logging.getLogger(__name__)

# peft's names around the base model's: `base_model.model.<hf name>`, and an adapted
# linear's own weight under `<module>.base_layer.weight`.
PEFT_PREFIX = "base_model.model."
BASE_LAYER = ".base_layer"
ADAPTER = "default"  # the one adapter a ratchet policy carries
ADAPTER_CONFIG = "adapter_config.json"  # peft's file names in a saved adapter folder
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# What a ratchet adapter folder adds: the base it needs (LoraBase as JSON).
ADAPTER_BASE = "ratchet_base.json"


@dataclass(frozen=True)
class LoraSettings:
    """`trainer.lora`, read by attribute (the GPU check runs without pydantic)."""

    rank: int
    alpha: float
    target_modules: Any  # "all-linear" or a list of module names
    dropout: float = 0.0
    quantize: str | None = None

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def lora_settings(cfg: RunConfig) -> LoraSettings | None:
    """The run's LoRA settings, or None when it trains the whole policy (rank 0)."""
    section = cfg.trainer.lora
    if int(section.rank) <= 0:
        return None
    targets = section.target_modules
    return LoraSettings(
        rank=int(section.rank),
        alpha=float(section.alpha),
        target_modules=targets if isinstance(targets, str) else list(targets),
        dropout=float(section.dropout),
        quantize=section.quantize,
    )


def check_quantize(settings: LoraSettings, device: torch.device) -> None:
    """A ConfigError naming trainer.lora.quantize and the fix, unless 4-bit can run here
    (a CUDA device and bitsandbytes). ConfigError, because no retry can help: the workflow
    does not retry it (errors.NON_RETRYABLE)."""
    if settings.quantize is None:
        return
    from ratchet.config.loader import ConfigError

    key = "trainer.lora.quantize"
    if settings.quantize != "4bit":
        raise ConfigError([(key, f'{settings.quantize!r} is not a quantization; use null or "4bit"')])
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError([(key, (
            f"\"4bit\" (QLoRA) needs a CUDA GPU: bitsandbytes' 4-bit kernels do not run on {device.type}, where this "
            "trainer runs. Set trainer.lora.quantize=null to train LoRA on the unquantized base, or run the trainer on a GPU"
        ))])  # fmt: skip
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError([(key, (
            "\"4bit\" (QLoRA) needs the bitsandbytes package in the trainer's environment (pip install bitsandbytes); "
            "or set trainer.lora.quantize=null"
        ))]) from None  # fmt: skip


def load_policy(model_path: str, cfg: RunConfig, device: torch.device | None = None) -> torch.nn.Module:
    """The policy at `model_path`: a Hugging Face causal LM, wrapped with fresh LoRA
    adapters when `trainer.lora.rank > 0` (QLoRA: the base loaded in 4 bit on `device`)."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, cfg.model.dtype)
    settings = lora_settings(cfg)
    if settings is None:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    kwargs: dict = {}
    if settings.quantize is not None:
        check_quantize(settings, device or torch.device("cpu"))
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype if dtype != torch.float32 else torch.bfloat16
        )
        kwargs["device_map"] = {"": (device.index if device is not None else None) or 0}
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **kwargs)
    fingerprint = base_fingerprint(base)
    # The adapters' initialisation from the run's seed alone: every trainer rank makes the
    # same (FSDP2 keeps each rank's own rows of them), and the global generator is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(cfg.seed))
        model = wrap(base, settings)
    model.ratchet_base = LoraBase(path=str(model_path), fingerprint=fingerprint)
    return model


def wrap(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """`model` with fresh adapters (B = 0: the wrapped model computes what `model` did);
    every base parameter frozen."""
    from ratchet.extras import require

    require("lora", "trainer.lora.rank > 0")
    from peft import LoraConfig, get_peft_model

    if settings.quantize is not None:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, target_modules=settings.target_modules, lora_dropout=settings.dropout,
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    try:
        wrapped = get_peft_model(model, config, adapter_name=ADAPTER)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        from ratchet.config.loader import ConfigError  # a config mistake: the workflow does not retry it

        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError([("trainer.lora.target_modules", (
            f"{settings.target_modules!r}: {e}. This model's linear layers are named {names}; list some of them, or use "
            "\"all-linear\""
        ))]) from None  # fmt: skip
    return wrapped


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model (FSDP2's wrapper class included). By class, without
    importing peft: a trainer that never uses LoRA needs no peft installed."""
    return any(c.__module__.startswith("peft.") and c.__name__ == "PeftModel" for c in type(model).__mro__)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer updates: every parameter without LoRA, the adapters with it."""
    return [p for p in model.parameters() if p.requires_grad]


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The model with its adapters off (the base model: the reference policy), for the
    duration of the block; a model without adapters as it is."""
    if not is_lora(model):
        yield model
        return
    with model.disable_adapter():
        yield model


# --------------------------------------------------------------------------- the base


@dataclass(frozen=True)
class LoraBase:
    """The base model an adapter was trained on: where it was loaded from (for people) and
    a fingerprint of its weights (what a restore checks: a fork or a resume loads the same
    base from another address)."""

    path: str
    fingerprint: str

    def to_json(self) -> dict:
        return asdict(self)


# Above this many elements a tensor is fingerprinted by a strided sample: the whole of a
# 7B model would take tens of seconds to hash at every trainer start.
_FULL_HASH_NUMEL = 1 << 20


def base_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over the base model's state (names, shapes, dtypes and values; a tensor of
    over 1M elements by an evenly strided sample of 1M of them). Taken before any sharding,
    so every rank computes the same. A warm-up or another checkpoint changes every weight,
    so two bases that differ anywhere that matters differ here."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        flat = t.detach().reshape(-1)
        if flat.numel() > _FULL_HASH_NUMEL:
            flat = flat[:: flat.numel() // _FULL_HASH_NUMEL]
        flat = flat.to("cpu").contiguous()
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.dtype != torch.bool else flat.numpy().tobytes())
    return h.hexdigest()[:32]


def base_of(model: torch.nn.Module) -> LoraBase | None:
    return getattr(model, "ratchet_base", None)


class WrongBase(ValueError):
    """A LoRA checkpoint restored onto a base other than the one it was trained on."""


def check_restore(model: torch.nn.Module, saved: dict | None, where: str) -> None:
    """Refuse a restore that would pair an adapter with another base, a LoRA checkpoint
    with a full-policy trainer, or the reverse; `saved`: the checkpoint's `lora` entry."""
    live = base_of(model) if is_lora(model) else None
    if saved is None and live is None:
        return
    if saved is None:
        raise WrongBase(f"{where} holds a whole policy, not a LoRA adapter; set trainer.lora.rank=0 to restore it")
    if live is None:
        raise WrongBase(f"{where} holds a LoRA adapter (rank {saved.get('rank')}); set trainer.lora as it was trained to restore it")
    if saved["base"]["fingerprint"] != live.fingerprint:
        raise WrongBase(
            f"{where} holds a LoRA adapter trained on the base at {saved['base']['path']} (fingerprint "
            f"{saved['base']['fingerprint']}), but this trainer's base at {live.path} has fingerprint {live.fingerprint}: "
            "an adapter only means something on its own base. Resume with the model it was trained on"
        )
    shape = {k: v for k, v in (checkpoint_record(model) or {}).items() if k != "base"}  # a LoRA model here: never {}
    trained = {k: saved.get(k) for k in shape}
    if trained != shape:
        raise WrongBase(
            f"{where} holds a LoRA adapter of {trained}, but trainer.lora makes {shape}: set trainer.lora as it was trained to restore it"
        )


def checkpoint_record(model: torch.nn.Module) -> dict | None:
    """What a checkpoint records about the adapter (None without LoRA): the base it needs
    and the adapter's shape."""
    if not is_lora(model):
        return None
    config = model.peft_config[ADAPTER]
    base = base_of(model)
    return {
        "base": base.to_json() if base is not None else None,
        "rank": int(config.r),
        "alpha": float(config.lora_alpha),
        "target_modules": sorted(config.target_modules) if not isinstance(config.target_modules, str) else config.target_modules,
    }


# --------------------------------------------------------------------------- merged weights


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach()


def _dequantized(weight: torch.Tensor) -> torch.Tensor:
    """A bitsandbytes 4-bit weight as a plain tensor (QLoRA); any other as it is."""
    if type(weight).__name__ == "Params4bit":
        from peft.utils.integrations import dequantize_bnb_weight

        return dequantize_bnb_weight(weight, state=weight.quant_state)
    return weight


class MergedWeight:
    """An adapted linear's weight as the engine needs it, W + scaling * B @ A, computed
    when the sync gathers it (`full_tensor`, a collective under FSDP2) and never kept.
    Looks enough like a (D)Tensor for the sync's plan: `shape`, `dtype`, `full_tensor`,
    and `to_local` (this rank's pieces of W, A and B, for the finiteness check)."""

    def __init__(self, base: torch.Tensor, layer):
        self.base, self.layer = base, layer
        self.shape = tuple(base.shape)
        if type(base).__name__ == "Params4bit":  # packed: the logical shape is the layer's
            self.shape = (layer.base_layer.out_features, layer.base_layer.in_features)
        self.dtype = base.dtype if base.dtype.is_floating_point else layer.lora_A[ADAPTER].weight.dtype

    def _adapters(self):
        layer = self.layer
        for name in layer.active_adapters:
            if name in layer.lora_A and not layer.disable_adapters and not layer.merged:
                yield layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name]

    def full_tensor(self) -> torch.Tensor:
        with torch.no_grad():
            weight = _full(_dequantized(self.base))
            for a, b, scaling in self._adapters():
                # peft's LoraLayer.get_delta_weight, in the adapter's dtype, then added as
                # its merge adds it: the same numbers as merge_and_unload.
                delta = _full(b) @ _full(a)
                if getattr(self.layer, "fan_in_fan_out", False):
                    delta = delta.T
                weight = (weight + delta * scaling).to(self.dtype)
            return weight

    def to_local(self) -> torch.Tensor:
        parts = [_local(self.base).float().reshape(-1)] if self.base.dtype.is_floating_point else []
        for a, b, _ in self._adapters():
            parts += [_local(a).float().reshape(-1), _local(b).float().reshape(-1)]
        return torch.cat(parts) if parts else torch.zeros(0)


def hf_name(peft_name: str) -> str:
    """A peft parameter name as the base model names it."""
    name = peft_name[len(PEFT_PREFIX) :] if peft_name.startswith(PEFT_PREFIX) else peft_name
    return name.replace(BASE_LAYER + ".", ".")


def _is_adapter_entry(name: str) -> bool:
    return ".lora_" in name


def merged_entries(model: torch.nn.Module) -> dict[str, Any]:
    """Hugging Face name -> tensor (or `MergedWeight` for an adapted linear's weight) of
    every weight the engine needs, in state-dict order; a tied weight is the same object
    under both names, as in the model's own state dict."""
    from peft.tuners.lora import LoraLayer

    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    merged: dict[int, MergedWeight] = {}
    out: dict[str, Any] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if _is_adapter_entry(name):
            continue
        owner = name[: -len(BASE_LAYER + ".weight")] if name.endswith(BASE_LAYER + ".weight") else None
        if owner is not None and owner in layers:
            if id(tensor) not in merged:
                merged[id(tensor)] = MergedWeight(tensor, layers[owner])
            out[hf_name(name)] = merged[id(tensor)]
        else:
            out[hf_name(name)] = tensor
    return out


class SyncView:
    """What a weight sync reads from a LoRA policy: its merged weights under the base
    model's names (`state_dict(keep_vars=True)`, as `weight_sync.buckets.sync_entries`
    reads a model)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self, keep_vars: bool = False) -> dict[str, Any]:
        entries = merged_entries(self.model)
        return entries if keep_vars else {k: _full(v) if not isinstance(v, MergedWeight) else v.full_tensor() for k, v in entries.items()}

    def parameters(self):
        return self.model.parameters()


def sync_view(model: torch.nn.Module):
    """What to hand a weight sync (`weight_sync.trainer_side.sync_plan`): the model itself,
    or for a LoRA policy its merged view."""
    return SyncView(model) if is_lora(model) else model


def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The merged weights, whole, by Hugging Face name (a collective when sharded)."""
    return {name: (t.full_tensor() if isinstance(t, MergedWeight) else _full(t)) for name, t in merged_entries(model).items()}


# --------------------------------------------------------------------------- the adapter on its own


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights, whole, by peft's saved names (`...q_proj.lora_A.weight`): what
    `PeftModel.from_pretrained` reads (a collective when sharded)."""
    from peft import get_peft_model_state_dict

    return {k: _full(v).cpu().contiguous() for k, v in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()}


def adapter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the adapter's weights (what an adapter sync would move)."""
    return sum(p.numel() * p.element_size() for p in trainable_parameters(model))


def write_adapter_folder(model: torch.nn.Module, state: dict[str, torch.Tensor], out: str | Path) -> Path:
    """The adapter in peft's layout (`adapter_config.json`, `adapter_model.safetensors`),
    plus `ratchet_base.json` naming the base it needs. `state`: `adapter_state(model)`."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = base_of(model)
    config = model.peft_config[ADAPTER].to_dict()
    config["base_model_name_or_path"] = base.path if base is not None else None
    for key, value in config.items():
        if isinstance(value, set):
            config[key] = sorted(value)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1, sort_keys=True, default=str))
    save_file(state, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_BASE).write_text(json.dumps(base.to_json() if base is not None else None, indent=1))
    return out


# --------------------------------------------------------------------------- checkpoints


def adapter_only(model: torch.nn.Module, model_sd: dict) -> dict:
    """A model state dict (DCP's `get_model_state_dict`) cut to what a LoRA checkpoint
    holds: the trainable adapters. DCP's own `ignore_frozen_params` keeps a tied frozen
    weight (`lm_head.weight`, the embedding's second name), which for a tied 135M model is
    most of the checkpoint. Without LoRA, the dict as it is."""
    if not is_lora(model):
        return model_sd
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: t for name, t in model_sd.items() if name in trainable}


def check_adapter_loaded(model: torch.nn.Module, loaded, where: str) -> None:
    """After a non-strict load of a LoRA checkpoint (`loaded`: the missing and unexpected
    keys torch reports): every adapter weight came from the checkpoint, nothing else did."""
    missing_adapters = sorted(k for k in loaded.missing_keys if _is_adapter_entry(k))
    if missing_adapters or loaded.unexpected_keys:
        raise ValueError(
            f"{where}: the adapter does not fit this policy's: missing {missing_adapters[:3]}, unexpected "
            f"{sorted(loaded.unexpected_keys)[:3]}; restore it with the trainer.lora settings it was trained with"
        )
