"""The run's config as `prepare_run` stored it, read once per worker process and config id:
what every activity of a run starts from."""

from __future__ import annotations

from functools import lru_cache

from ratchet.config.schema import RunConfig
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout


@lru_cache(maxsize=64)
def stored_run_config(run_uri: str, config_id: str = "") -> RunConfig:
    # A stored config never changes under its id (a resume with a new one gets a new id).
    return RunConfig.model_validate(ObjectStore(run_uri).get_json(RunLayout.CONFIG))
