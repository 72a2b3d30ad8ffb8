"""Generation engines behind one protocol (`base.Engine`); pick one with `rollout.engine`.

The engines a config can name are listed in `ratchet/catalog/engines.py`: that is where one is added. This
package imports no torch itself: the engine classes are imported on first use, so the
config schema can read the catalog without loading torch or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ratchet.lazy import lazy_exports

from ratchet.catalog.engines import ENGINES

if TYPE_CHECKING:
    from .base import Engine, Generation, SamplingParams, WeightSwap
    from .build import build_engine
    from .hf import HFEngine
    from .sglang import SGLangEngine
    from .vllm import VLLMEngine

_LAZY, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "base": ("Engine", "Generation", "SamplingParams", "WeightSwap"),
        "build": ("build_engine",),
        "hf": ("HFEngine",),
        "sglang": ("SGLangEngine",),
        "vllm": ("VLLMEngine",),
    },
)
__all__ = sorted(["ENGINES", *_LAZY])
