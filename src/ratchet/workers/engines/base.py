"""The contract every generation engine (transformers, vLLM, SGLang) fulfils.

Engines are listed in `ratchet/catalog/engines.py`; this module imports neither torch nor numpy at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    greedy: bool = False
    seed: int = 0
    # One seed per prompt of the call (batch_seeds.prompt_seeds): prompt i's samples
    # then depend on prompt_seeds[i] alone, not on the other prompts of the call, so a
    # batch split over several engine replicas samples what one engine would. None: the
    # engine seeds the whole call with `seed` (the samples depend on the call's makeup).
    prompt_seeds: tuple[int, ...] | None = None


@dataclass
class Generation:
    """One sample: generated token ids (ending with EOS unless cut at max length) and the
    log-probability the engine assigned to each under its sampling distribution."""

    token_ids: list[int]
    logprobs: list[float]
    # The policy version that produced each token; it changes inside one sample when the
    # weights were swapped mid-generation (a partial rollout).
    versions: list[int] | None = None


# Called by the engine between decode steps; returns the new policy version when it has
# just loaded newer weights, else None. Lets a weight sync land inside a generation.
WeightSwap = Callable[[], "int | None"]


class EngineClass(Protocol):
    """What `ENGINES` (ratchet/catalog/engines.py) holds for a name: an `Engine` class, built
    as `cls(model_path, *, dtype, **options)` with its section's options (engines/build.py)."""

    def __call__(self, model_path: str, *, dtype: str, **options: Any) -> "Engine": ...


class Engine(Protocol):
    """Built as `cls(model_path, *, dtype)` (ratchet/catalog/engines.py): `model_path` a local Hugging Face
    model folder (weights and tokenizer), `dtype` one of `model.dtype`'s values."""

    # True when `generate` honours `weight_swap` (weights can change between decode steps).
    supports_partial_rollout: bool

    # The Hugging Face tokenizer of the served model (a `PreTrainedTokenizerBase`): `PromptSet`
    # encodes the prompts with its chat template and reward scoring decodes responses with it,
    # so the token ids given to and returned by `generate` must be this tokenizer's.
    tokenizer: Any

    # The id that pads prompts and responses to a rectangle in a `RolloutBatch`
    # (rollout_batching.generate_batch); never counted, the masks exclude it.
    pad_id: int

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, version: int = 0, weight_swap: WeightSwap | None = None
    ) -> list[list[Generation]]:
        """For each prompt, `params.n` generations (greedy: n identical ones), tagged with
        `version`, or with the version `weight_swap` reports from the step it swapped on."""
        ...

    # Optional, for colocated placement (docs/placement.md): `sleep()` frees the device for
    # the trainer (vLLM sleep mode, SGLang release_memory_occupation) and `wake_up()` takes
    # it back. An engine without them (HF) simply keeps its memory; RolloutWorker checks.

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> None:
        """Replace the engine's weights with the trainer's: (name, array) pairs named as in
        the Hugging Face model, consumed one at a time. The pairs may come from a stream
        of size-bounded buckets (workers/weight_sync.py), so an engine must not hold on to
        more than the pair it is loading; every parameter (a tied `lm_head.weight`
        excepted) arrives exactly once per call. An array in another dtype than the
        engine's is cast."""
        ...
