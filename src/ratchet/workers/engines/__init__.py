"""Generation engines behind one protocol (`base.Engine`); pick one with `rollout.engine`.

The engines a config can name are listed in `ratchet/catalog/engines.py`: that is where one
is added. This package's `__init__` imports no torch (only that catalog): import an engine
from its module (`ratchet.workers.engines.hf`, `.vllm`, `.sglang`; `build.build_engine`
builds the configured one), so the config schema reads the catalog without loading torch or
transformers.
"""

from __future__ import annotations

from ratchet.catalog.engines import ENGINES

__all__ = ["ENGINES"]
