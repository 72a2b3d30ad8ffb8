"""Forking a run: a new run (its own id and folder) that starts from a checkpoint of another.

The child is started the way a resume from a checkpoint is (`Client.resume`): the
workflow's restore path stores the child's config, rebuilds the trainer from a checkpoint
and carries on from the checkpoint's run state. That path reads checkpoints from the run's
own folder, so the parent's checkpoint is copied into the child's folder first, with the
policy RL started from (the parent's warm-up model, when it had one: the child's rollout
workers start from it, and it is the KL reference). The parent's folder is only read.
Overrides follow the resume rules (config/resume_keys.py); a key set in the overrides
replaces the value the parent may have set live. The child carries `RunLineage(parent run,
checkpoint)` from submit on.
"""

from __future__ import annotations

import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ratchet.ids import check_id
from ratchet.types import RunLineage, TrainingInput

from .stored_runs import make_run_id, read_run_state, stored_config_with
from .taken_ids import check_new_run_id

if TYPE_CHECKING:
    from ratchet.storage.object_store import ObjectStore

    from .taken_ids import KnowsWorkflows

log = logging.getLogger(__name__)

_STEP = re.compile(r"step-(\d+)")  # matched whole (fullmatch): `$` lets a final newline through
_MANIFESTS = ("MANIFEST.json", "manifest.json")  # committed last: a half copy does not exist


def checkpoint_name(name: str) -> str:
    """`step-20` or `step-00000020` as the stored name; any other name as given."""
    from ratchet.storage.layout import RunLayout

    match = _STEP.fullmatch(name)
    return RunLayout.checkpoint_name(int(match.group(1))) if match else name


def copy_tree(src: ObjectStore, dst: ObjectStore, prefix: str) -> int:
    """Copy every object under `prefix` from `src` to `dst` (manifests last; a retired
    marker is not copied: the copy is live in the child). Returns the files copied."""
    from ratchet.storage.layout import RunLayout

    keys = [k for k in src.list(prefix) if not k.endswith("/" + RunLayout.CHECKPOINT_RETIRED)]
    keys.sort(key=lambda k: (k.rsplit("/", 1)[-1] in _MANIFESTS, k))
    with tempfile.TemporaryDirectory(prefix="ratchet-fork-") as tmp:
        for i, key in enumerate(keys):
            local = Path(tmp) / str(i)
            src.get_file(key, local)
            dst.put_file(key, local)
            local.unlink()
    return len(keys)


@dataclass(frozen=True)
class ForkStart:
    """What `Client.fork` starts: the child's workflow input and its memo."""

    inp: TrainingInput
    memo: dict


def prepare_fork(
    client: KnowsWorkflows, run_id: str, checkpoint: str, overrides: Sequence[str] = (), *, root: str | None = None,
    new_run_id: str | None = None,
) -> ForkStart:  # fmt: skip
    """The child of checkpoint `checkpoint` of run `run_id` (see the module doc), its folder
    holding the copied checkpoint; `client` only answers whether the child's id is taken."""
    from ratchet.config.live_keys import without
    from ratchet.config.loop_plan import loop_plan
    from ratchet.storage.checkpoint_store import CheckpointStore
    from ratchet.storage.object_store import ObjectStore
    from ratchet.storage.layout import RunLayout

    check_id(run_id)
    name = check_id(checkpoint_name(checkpoint), "checkpoint name")
    if new_run_id is not None:
        check_id(new_run_id)
    parent, stored, cfg, changed = stored_config_with(run_id, root, overrides)
    checkpoints = CheckpointStore(parent)
    names = [c.name for c in checkpoints.list()]
    if name not in names:
        raise FileNotFoundError(
            f"run {run_id!r} has no checkpoint {checkpoint!r}; it has: {', '.join(names) or 'none'} (ratchet checkpoints {run_id})"
        )
    if not checkpoints.verify(name):
        raise ValueError(f"checkpoint {name!r} of run {run_id!r} is corrupted; pick another (ratchet checkpoints {run_id})")
    state = read_run_state(checkpoints.read_files(name, [RunLayout.RUN_STATE])[RunLayout.RUN_STATE])  # where its manifest says
    if "algorithm.kl.coef" in changed:
        state.kl_coef = cfg.algorithm.kl.coef  # the saved (possibly adapted) one would override it
    state.live.values = without(state.live.values, list(changed))
    if state.next_step >= cfg.loop.steps:
        raise ValueError(
            f"checkpoint {name!r} is at step {state.next_step} and the fork would end at loop.steps={cfg.loop.steps}: "
            f"nothing to train; pass loop.steps=N with N > {state.next_step}"
        )
    child_id = new_run_id or check_id(make_run_id(cfg.tracking.name), "run id made from tracking.name")
    check_new_run_id(client, child_id, cfg.storage.root)  # IdTaken: another run's (a FileExistsError)
    child = ObjectStore(cfg.storage.root).child(child_id)
    copied = copy_tree(parent, child, RunLayout.checkpoint(name))
    if cfg.warmup.steps > 0:
        copied += copy_tree(parent, child, RunLayout.WARMUP_MODEL)
    log.info("fork %s: copied %d files of %s/%s", child_id, copied, run_id, name)
    lineage = RunLineage(parent_run_id=run_id, parent_checkpoint=name)
    inp = TrainingInput(
        run_id=child_id,
        config=cfg.model_dump(mode="json"),
        plan=loop_plan(cfg),
        resume=state,
        restore=True,
        lineage=lineage,
        restore_from=name,  # progress reads `restoring from <name>` until the first step
    )
    memo = {"tags": cfg.tracking.tags, "model": cfg.model.path, "steps": cfg.loop.steps, "parent": f"{run_id}/{name}"}
    return ForkStart(inp=inp, memo=memo)
