"""What the Temporal UI shows of a run: its search attributes, its static summary and
details, each activity's summary and the live current details.

One module for all of it so that the client (at submit and resume), the training workflow
(as the run goes) and a sweep workflow (starting trials as child workflows) label runs
the same way. It imports only the standard library, `temporalio.common` and
`ratchet.types`, so it loads inside the workflow sandbox.

Search attributes must exist in the namespace before a workflow sets them: an upsert of an
unknown name fails the workflow task, which Temporal retries forever while the run shows
RUNNING. `ratchet up` registers them on the embedded server (`dev_server_flags`); on a
cluster they are created once with `temporal operator search-attribute create`
(docs/temporal_ui.md). The client asks the namespace which it has (`missing_from`) and
only then sets them at start and tells the workflow to upsert
(`TrainingInput.search_attributes`), so a server without them still runs every run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from temporalio.common import SearchAttributeKey, SearchAttributePair, SearchAttributeUpdate, TypedSearchAttributes

from ratchet.types import RunLineage

EXPERIMENT = SearchAttributeKey.for_keyword("ratchet_experiment")
SWEEP = SearchAttributeKey.for_keyword("ratchet_sweep")
ALGORITHM = SearchAttributeKey.for_keyword("ratchet_algorithm")
LOOP_MODE = SearchAttributeKey.for_keyword("ratchet_loop_mode")
MODEL = SearchAttributeKey.for_keyword("ratchet_model")
STEP = SearchAttributeKey.for_int("ratchet_step")
REWARD = SearchAttributeKey.for_float("ratchet_reward")
EVAL_REWARD = SearchAttributeKey.for_float("ratchet_eval_reward")
STATUS = SearchAttributeKey.for_keyword("ratchet_status")
PARENT = SearchAttributeKey.for_keyword("ratchet_parent")

ALL_KEYS: tuple[SearchAttributeKey, ...] = (
    EXPERIMENT, SWEEP, ALGORITHM, LOOP_MODE, MODEL, STEP, REWARD, EVAL_REWARD, STATUS, PARENT,
)  # fmt: skip

# What each key means, for `ratchet find`'s help, the invalid-query message and the docs.
MEANING: dict[str, str] = {
    EXPERIMENT.name: "tracking.experiment",
    SWEEP.name: "the sweep the run is a trial of",
    ALGORITHM.name: "algorithm.adv_estimator (grpo, ppo, rloo, ...)",
    LOOP_MODE.name: "loop.mode (sync, one_step_off, fully_async)",
    MODEL.name: "the model folder's name (last part of model.path)",
    STEP.name: "training steps done",
    REWARD.name: "the latest step's mean reward",
    EVAL_REWARD.name: "the latest evaluation's mean reward",
    STATUS.name: "running, paused, completed, stopped, failed, cancelled",
    PARENT.name: "the run this one was forked from",
}

# Keyword values are indexed up to a few hundred bytes; longer ones are cut, not refused.
_KEYWORD_MAX = 200


class Status:
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    STOPPED = "stopped"
    FAILED = "failed"
    CANCELLED = "cancelled"


def type_name(key: SearchAttributeKey) -> str:
    """The type as `temporal` CLI flags spell it: Keyword, Int, Double."""
    return {"KEYWORD": "Keyword", "INT": "Int", "DOUBLE": "Double"}[key.indexed_value_type.name.removeprefix("INDEXED_VALUE_TYPE_")]


def dev_server_flags() -> list[str]:
    """`--search-attribute NAME=Type` for each key, for `temporal server start-dev`."""
    flags: list[str] = []
    for key in ALL_KEYS:
        flags += ["--search-attribute", f"{key.name}={type_name(key)}"]
    return flags


def create_commands(namespace: str = "default") -> list[str]:
    """The `temporal operator` commands that create the keys on a cluster's namespace."""
    return [
        f"temporal operator search-attribute create --namespace {namespace} --name {key.name} --type {type_name(key)}" for key in ALL_KEYS
    ]


def missing_from(registered: Mapping[str, int]) -> list[str]:
    """The keys a namespace lacks (or has with another type), given its custom attributes
    as `ListSearchAttributesResponse.custom_attributes` maps them (name -> IndexedValueType)."""
    return [k.name for k in ALL_KEYS if registered.get(k.name) != int(k.indexed_value_type)]


# -- what a run is, from its config ----------------------------------------------------


def _get(config: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _keyword(value: Any) -> str:
    return str(value)[:_KEYWORD_MAX]


def model_name(config: Mapping[str, Any]) -> str:
    """The model folder's last part: what a person searches by (`SmolLM2-135M-Instruct`,
    not the machine's path to it)."""
    path = str(_get(config, "model.path", "") or "").rstrip("/\\")
    return path.replace("\\", "/").rsplit("/", 1)[-1] or path


def initial_attributes(config: Mapping[str, Any], lineage: RunLineage | None = None) -> TypedSearchAttributes:
    """The attributes a run starts with: what it is (experiment, algorithm, loop mode,
    model, sweep and parent when it has them), step 0, status running. `config` is the
    validated run config as JSON (`RunConfig.model_dump(mode="json")`, TrainingInput.config)."""
    lineage = lineage or RunLineage()
    pairs: list[SearchAttributePair] = [
        SearchAttributePair(EXPERIMENT, _keyword(_get(config, "tracking.experiment", "default"))),
        SearchAttributePair(ALGORITHM, _keyword(_get(config, "algorithm.adv_estimator", ""))),
        SearchAttributePair(LOOP_MODE, _keyword(_get(config, "loop.mode", "sync"))),
        SearchAttributePair(MODEL, _keyword(model_name(config))),
        SearchAttributePair(STEP, 0),
        SearchAttributePair(STATUS, Status.RUNNING),
    ]
    if lineage.sweep_id:
        pairs.append(SearchAttributePair(SWEEP, _keyword(lineage.sweep_id)))
    if lineage.parent_run_id:
        pairs.append(SearchAttributePair(PARENT, _keyword(lineage.parent_run_id)))
    return TypedSearchAttributes(pairs)


def resumed_attributes(config: Mapping[str, Any], lineage: RunLineage | None, step: int) -> TypedSearchAttributes:
    """A resume from a checkpoint starts a new workflow run: what it is, at its step."""
    attrs = initial_attributes(config, lineage)
    return TypedSearchAttributes([p if p.key.name != STEP.name else SearchAttributePair(STEP, step) for p in attrs])


def unsafe_tools(config: Mapping[str, Any]) -> list[str]:
    """The tools of a multi-turn run that run model code without isolation (`unsafe_local:
    true` in their config, tools/code_runner.py), by the name the model calls them."""
    if not _get(config, "rollout.multi_turn.enabled", False):
        return []
    names = []
    for tool in _get(config, "rollout.multi_turn.tools", None) or []:
        if isinstance(tool, Mapping) and isinstance(tool.get("config"), Mapping) and tool["config"].get("unsafe_local") is True:
            fn = (tool.get("tool_schema") or {}).get("function") or {}
            names.append(str(fn.get("name") or tool.get("class_name")))
    return names


def static_summary(run_id: str, config: Mapping[str, Any], lineage: RunLineage | None = None) -> str:
    """One line: what the run is. Shown as the workflow's summary in the UI's list and page."""
    lineage = lineage or RunLineage()
    algorithm = str(_get(config, "algorithm.adv_estimator", "")).upper()
    line = (
        f"{algorithm} on {model_name(config)} · {_get(config, 'loop.steps', '?')} steps, "
        f"{_get(config, 'loop.mode', 'sync')} loop · experiment {_get(config, 'tracking.experiment', 'default')}"
    )
    if lineage.sweep_id:
        line += f" · sweep {lineage.sweep_id} trial {lineage.trial_index}"
    if lineage.parent_run_id:
        line += f" · fork of {lineage.parent_run_id}" + (f" at {lineage.parent_checkpoint}" if lineage.parent_checkpoint else "")
    unsafe = unsafe_tools(config)
    if unsafe:
        line += f" · UNSAFE: model code runs unsandboxed ({', '.join(unsafe)})"
    return line


# Config values the details list, in order: the ones people compare runs by. Paths other
# than the model's are left out (the run folder has the whole config.json).
_DETAIL_KEYS: tuple[tuple[str, str], ...] = (
    ("model", "model.path"),
    ("algorithm", "algorithm.adv_estimator"),
    ("policy loss", "algorithm.policy_loss"),
    ("KL", "algorithm.kl.coef"),
    ("loop", "loop.mode"),
    ("steps", "loop.steps"),
    ("prompts per step", "loop.prompts_per_step"),
    ("samples per prompt", "rollout.n"),
    ("max response length", "rollout.max_response_length"),
    ("temperature", "rollout.temperature"),
    ("engine", "rollout.engine"),
    ("learning rate", "trainer.lr"),
    ("trainer ranks", "trainer.world_size"),
    ("warm-up steps", "warmup.steps"),
    ("checkpoint every", "checkpoint.every"),
    ("eval every", "loop.eval_every"),
    ("seed", "seed"),
    ("deterministic", "deterministic"),
)


def static_details(run_id: str, config: Mapping[str, Any], lineage: RunLineage | None = None) -> str:
    """The run's config in short, as Temporal markdown (the UI's "Details")."""
    lineage = lineage or RunLineage()
    lines = [f"**ratchet run** `{run_id}`", ""]
    tags = _get(config, "tracking.tags") or []
    lines.append(
        f"- experiment: `{_get(config, 'tracking.experiment', 'default')}`" + (f", tags: {', '.join(map(str, tags))}" if tags else "")
    )
    for label, dotted in _DETAIL_KEYS:
        value = _get(config, dotted)
        if value is not None:
            lines.append(f"- {label}: `{json.dumps(value) if isinstance(value, bool) else value}`")
    if lineage.parent_run_id:
        lines.append(
            f"- forked from: `{lineage.parent_run_id}`" + (f" at `{lineage.parent_checkpoint}`" if lineage.parent_checkpoint else "")
        )
    if lineage.sweep_id:
        lines.append(f"- sweep: `{lineage.sweep_id}`, trial {lineage.trial_index}")
    unsafe = unsafe_tools(config)
    if unsafe:
        lines.append(
            f"- **UNSAFE**: tool(s) {', '.join(f'`{n}`' for n in unsafe)} run model code without the sandbox (`unsafe_local: true`)"
        )
    return "\n".join(lines)


# -- as the run goes (called in workflow code: pure and deterministic) ---------------------


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def progress_updates(
    *, step: int | None = None, reward: float | None = None, eval_reward: float | None = None, status: str | None = None
) -> list[SearchAttributeUpdate]:
    """The updates for one upsert; None leaves a key as it is. A NaN reward is left out
    (visibility stores no NaN)."""
    out: list[SearchAttributeUpdate] = []
    if step is not None:
        out.append(STEP.value_set(int(step)))
    if (r := _finite(reward)) is not None:
        out.append(REWARD.value_set(float(r)))
    if (e := _finite(eval_reward)) is not None:
        out.append(EVAL_REWARD.value_set(float(e)))
    if status is not None:
        out.append(STATUS.value_set(status))
    return out


def current_details(
    *, phase: str, step: int, total_steps: int, policy_version: int, reward: float | None, eval_reward: float | None
) -> str:
    """The live line under the workflow's summary in the UI (Temporal markdown)."""
    parts = [f"**{phase}** · step {step}/{total_steps} · policy v{policy_version}"]
    if (r := _finite(reward)) is not None:
        parts.append(f"reward {r:.3f}")
    if (e := _finite(eval_reward)) is not None:
        parts.append(f"eval reward {e:.3f}")
    return " · ".join(parts)


def activity_summary(phase: str, arg: Any, step: int) -> str:
    """What one activity call does, in words ("generate batch 12 with v11"); `step` is the
    training step the workflow is on. Reads the input's fields by name and never fails:
    a label must not break a run."""
    f = lambda name, default="?": getattr(arg, name, default)  # noqa: E731
    if phase == "generate":
        part = f("part", 0)
        return f"generate batch {f('batch_index')} with v{f('policy_version')}" + (f" (round {part + 1})" if part else "")
    if phase == "score":
        return f"score batch {getattr(f('batch', None), 'index', '?')}"
    if phase == "train":
        return f"train step {step} on batch {getattr(f('batch', None), 'index', '?')}"
    if phase == "step":
        return f"step {step} (generate, score, train, sync)"
    if phase == "sync_weights":
        return f"sync weights v{f('policy_version')}"
    if phase == "checkpoint":
        return f"checkpoint step {f('step')}"
    if phase == "evaluate":
        return f"evaluate step {f('step')}"
    if phase == "record_step":
        return f"record metrics of step {f('step')}"
    if phase == "prepare_run":
        return f"prepare run {f('run_id')}"
    if phase == "warmup":
        return "supervised warm-up"
    if phase == "start_workers":
        version = f("restore_version", None)
        return "start workers" + (f" at v{version}" if version is not None else "")
    if phase == "finish_run":
        return f"finish: export the final policy v{f('policy_version')}"
    if phase == "release_run":
        return "release the run's actors"
    if phase == "evacuate_nodes":
        return f"move off draining node(s) {', '.join(n[:12] for n in f('node_ids', []) or [])}"
    return phase


__all__: Sequence[str] = (
    "ALL_KEYS", "ALGORITHM", "EVAL_REWARD", "EXPERIMENT", "LOOP_MODE", "MEANING", "MODEL", "PARENT", "REWARD",
    "STATUS", "STEP", "SWEEP", "Status", "activity_summary", "create_commands", "current_details", "dev_server_flags",
    "initial_attributes", "missing_from", "progress_updates", "resumed_attributes", "static_details", "static_summary",
    "type_name", "unsafe_tools",
)  # fmt: skip
