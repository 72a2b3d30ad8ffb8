"""Which config keys a resume from a checkpoint may change (`ratchet resume R key=value`).

A resume carries on from a checkpoint's trainer state and run state. A key the resumed run
would not honour (the checkpoint's optimizer state or run state overrides it), or one that
would make the checkpoint describe another run (another model, other data, another
algorithm), is refused by `Client.resume` rather than stored and silently ignored.
Everything not listed here is refused; each entry says why it is safe to change.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any, Mapping

from ratchet.config.loader import ConfigError

# Glob patterns over dotted keys, each with the reason a resume honours a change.
RESUMABLE: dict[str, str] = {
    "trainer.lr": "loaded into the optimizer's param groups after the checkpoint's optimizer state",
    "trainer.weight_decay": "loaded into the optimizer's param groups after the checkpoint's optimizer state",
    "trainer.betas": "loaded into the optimizer's param groups after the checkpoint's optimizer state",
    "trainer.grad_clip": "read at every update",
    "trainer.ppo_epochs": "read at every update",
    "trainer.micro_batch_size": "only splits an update into micro-batches; the update is the same",
    "trainer.world_size": "the sharded trainer state is resharded when a checkpoint is loaded",
    "algorithm.kl.coef": "becomes the run state's KL coefficient; the reference is the initial policy either way",
    "algorithm.entropy_coeff": "a loss weight read at every update",
    "algorithm.clip_ratio_*": "PPO clip bounds read at every update",
    "loop.steps": "where the run ends; the workflow reads it",
    "loop.eval_every": "an evaluation schedule; the workflow reads it",
    "loop.heartbeat_timeout_s": "how soon a lost worker is noticed",
    "loop.continue_as_new_every": "only how long a workflow history grows",
    "checkpoint.*": "when checkpoints are written and which are kept; those written stay readable",
    "resources.*": "the actors are rebuilt on a resume with the new reservations",
    "rollout.replicas": "how many engines share a batch; a batch is the same however it is split (seeds per prompt)",
    "reward.timeout_s": "a time limit per reward call, read on each call",
    "tracking.tags": "labels only",
    "tracking.experiment": "labels only",
    "tracking.mlflow*": "trackers only (a new mlflow_uri starts a new MLflow run in that store)",
    "tracking.wandb.*": "trackers only",
}


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value; lists (betas, tags) are values, not sections."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def may_change(key: str) -> bool:
    return any(fnmatchcase(key, pattern) for pattern in RESUMABLE)


def changed_keys(stored: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (stored value, new value) for every key whose value differs."""
    old, now = flatten(stored), flatten(new)
    missing = object()
    return {key: (old.get(key), now.get(key)) for key in sorted(old.keys() | now.keys()) if old.get(key, missing) != now.get(key, missing)}


def check_resume_changes(stored: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The changed keys, if a resume may change all of them; else a ConfigError naming each
    refused key and listing the keys that may change."""
    changed = changed_keys(stored, new)
    allowed = ", ".join(RESUMABLE)
    refused = [
        (key, f"a resume cannot change it (stored {old!r}, asked {now!r}); a resume may change: {allowed}. "
              "Start a new run for this change")
        for key, (old, now) in changed.items()
        if not may_change(key)
    ]  # fmt: skip
    if refused:
        raise ConfigError(refused)
    return changed
