"""Refusing a new run (submit, fork) or sweep an id that another one has.

A run's id is its Temporal workflow id, its folder under `storage.root` and its row in the
run registry. Temporal lets the id of a closed workflow start again, and `prepare_run`
writes config.json into the folder it names: a new run under a taken id would overwrite
that run's config, checkpoints and metrics.jsonl. So submit, fork and sweep refuse a taken
id before anything is stored or started. Taken means any of: a workflow with that id in
Temporal, in any state (running, paused, completed, failed, cancelled, terminated); any
object under `<storage.root>/<id>`; a row in the run registry this process reads (when
it has one: the registry is a view of the object store, so one that cannot be read is
logged and skipped). Resuming a run (`Client.resume`) keeps its id on purpose and does
not come here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


class IdTaken(FileExistsError):
    """A new run or sweep asked for an id another one has; the message says how to go on."""


class KnowsWorkflows(Protocol):
    """What these checks need of a client (ratchet's `Client`)."""

    def workflow_status(self, workflow_id: str) -> str | None: ...


def check_new_run_id(client: KnowsWorkflows, run_id: str, storage_root: str) -> str:
    """`run_id` if no run has it (see the module doc); else IdTaken naming where it is
    taken and how to continue that run or pick another id."""
    where = _taken(client, "run", run_id, run_id, storage_root, "it has a folder")
    if where:
        raise IdTaken(
            f"run id {run_id!r} is taken ({'; '.join(where)}): a new run under it would overwrite that run's config, "
            f"checkpoints and metrics. Continue that run with `ratchet resume {run_id}` (Client.resume), start a new run "
            f"from one of its checkpoints with `ratchet fork {run_id} --checkpoint step-N` (Client.fork), or pick another "
            "id (leave the run id out for a fresh one)"
        )
    return run_id


def check_new_sweep_id(client: KnowsWorkflows, sweep_id: str, first_trial_id: str, storage_root: str) -> str:
    """`sweep_id` if no sweep has it: no workflow with that id in Temporal, no sweep row in
    the registry, and no folder of its first trial (`first_trial_id`) under `storage_root`
    (trials are runs `<sweep>-t<k>`: a sweep again under the id would overwrite them)."""
    where = _taken(client, "sweep", sweep_id, first_trial_id, storage_root, f"its trial {first_trial_id} has a folder")
    if where:
        raise IdTaken(
            f"sweep id {sweep_id!r} is taken ({'; '.join(where)}): a new sweep under it would overwrite its trials' "
            "configs, checkpoints and metrics. Pick another id (leave the sweep id out for a fresh one)"
        )
    return sweep_id


def _taken(client: KnowsWorkflows, kind: str, key: str, folder: str, storage_root: str, folder_says: str) -> list[str]:
    """Where `key` is taken, in words: Temporal, the folder `folder` under `storage_root`,
    the registry's `kind` ("run" | "sweep") rows. [] when nowhere."""
    from ratchet.storage.object_store import ObjectStore

    where = []
    status = client.workflow_status(key)
    if status is not None:
        where.append(f"Temporal has a {status} workflow with that id")
    if ObjectStore(storage_root).child(folder).list(""):
        where.append(f"{folder_says} under {storage_root}")
    if _in_registry(kind, key):
        where.append("the run registry lists it")
    return where


def _in_registry(kind: str, key: str) -> bool:
    """Whether the registry this process would open has a `kind` ("run" | "sweep") row for
    `key`. A default SQLite registry that does not exist yet holds nothing (and is not
    created here); a registry that cannot be read is logged and counts as holding nothing."""
    from ratchet.registry.urls import registry_enabled, registry_url

    if not registry_enabled():
        return False
    url = registry_url()
    if url.startswith("sqlite:"):
        from ratchet.registry.urls import parse

        database = parse(url).database
        if not database or database == ":memory:" or not Path(database).expanduser().exists():
            return False
    try:
        from ratchet.registry.db import Registry

        with Registry.open(url, upgrade=False) as reg:
            return (reg.run(key) if kind == "run" else reg.sweep(key)) is not None
    except Exception as exc:  # noqa: BLE001 - a view of the object store, which was checked
        log.warning("the run registry was not checked for %s %r: %s", kind, key, type(exc).__name__)
        return False
