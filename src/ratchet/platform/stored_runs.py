"""What a resume and a fork read from a run's folder before they start anything: its stored
config with the caller's overrides (checked as a resume checks them), a checkpoint's run
state, and a new run's id."""

from __future__ import annotations

import json
import secrets
import time
from typing import Sequence

from ratchet.types import RunState, upgrade_run_state


def _json_payload(data: bytes):
    from temporalio.api.common.v1 import Payload

    return Payload(metadata={"encoding": b"json/plain"}, data=data)


def read_run_state(raw: bytes) -> RunState:
    """A checkpoint's `run_state.json` as the RunState a resume carries on from; one written
    by an older ratchet (a per-step `rewards` list) is converted."""
    from temporalio.converter import default as default_converter

    data = json.dumps(upgrade_run_state(json.loads(raw))).encode()
    return default_converter().payload_converter.from_payloads([_json_payload(data)], [RunState])[0]


def normalised_config(stored: dict) -> dict:
    """A stored config with today's defaults filled in, so that a key added to the schema
    since the run started does not count as changed by the resume."""
    from ratchet.config import RunConfig

    try:
        return RunConfig.model_validate(stored).model_dump(mode="json")
    except ValueError:  # a check added since: load_config reports it with the new config
        return stored


def make_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


def stored_config_with(run_id: str, root: str | None, overrides: Sequence[str]):
    """A run's stored config plus `overrides`, checked as a resume checks them (what a
    resume and a fork both start from): (run folder, stored config, new config, changed keys)."""
    from ratchet.config import load_config
    from ratchet.config.resume_keys import check_resume_changes
    from ratchet.storage.object_store import ObjectStore
    from ratchet.storage.layout import RunLayout

    root = root or RunLayout.DEFAULT_ROOT
    run_store = ObjectStore(root).child(run_id)
    if not run_store.exists(RunLayout.CONFIG):
        raise FileNotFoundError(f"no run {run_id!r} under {root} (pass --root, the run's storage.root)")
    stored = run_store.get_json(RunLayout.CONFIG)
    cfg = load_config(None, overrides, base=stored)
    changed = check_resume_changes(normalised_config(stored), cfg.model_dump(mode="json"))
    return run_store, stored, cfg, changed
