"""Generation engines behind one protocol; pick one with `rollout.engine`."""

from .base import Engine, Generation, SamplingParams, WeightSwap
from .hf import HFEngine

ENGINES = {"hf": HFEngine}

__all__ = ["ENGINES", "Engine", "Generation", "HFEngine", "SamplingParams", "WeightSwap"]
