"""Build the engine a run config names (`rollout.engine`), with its own options section."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ratchet.catalog.engines import ENGINES

if TYPE_CHECKING:
    from ratchet.config.schema import RunConfig

    from .base import Engine


def build_engine(cfg: "RunConfig", model_path: str) -> "Engine":
    """`ENGINES[rollout.engine](model_path, dtype=model.dtype, **options)`: an engine with a
    section of its own (catalog/engines.py's ENGINE_OPTIONS: rollout.vllm, rollout.sglang)
    gets its fields as keyword options; a null max_model_len becomes the longest sequence
    the run can make (longest prompt plus longest response), so the engine reserves no more
    KV cache than the run needs."""
    options = cfg.rollout.engine_options()
    if "max_model_len" in options and options["max_model_len"] is None:
        options["max_model_len"] = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    return ENGINES.get(cfg.rollout.engine)(model_path, dtype=cfg.model.dtype, **options)
