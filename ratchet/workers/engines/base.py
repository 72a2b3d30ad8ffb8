"""The contract every generation engine (transformers, vLLM, SGLang) fulfils."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    greedy: bool = False
    seed: int = 0


@dataclass
class Generation:
    """One sample: generated token ids (ending with EOS unless cut at max length) and the
    log-probability the engine assigned to each under its sampling distribution."""

    token_ids: list[int]
    logprobs: list[float]


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        """For each prompt, `params.n` generations (greedy: n identical ones)."""
        ...

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        """Replace the engine's weights with the trainer's (same names as the HF model)."""
        ...
