"""A pipeline's stages worked out from its config alone: the config each rl stage runs with
(the run config minus `stages`, plus the stage's overrides) and what is wrong with them,
checked at submit before any stage starts. No torch.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ratchet.config.schema import RunConfig

# A run config's cross-section problems (cross_checks.problems): (field or None, message).
StageChecks = Callable[["RunConfig"], list[tuple[str | None, str]]]


def _expanded(overrides: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys ('loop.steps': 3) as nested mappings ({'loop': {'steps': 3}})."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        parts = str(key).split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {key!r} sets a key inside {part!r}, which another override sets to a value")
        node[parts[-1]] = _expanded(value) if isinstance(value, dict) else value
    return out


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def rl_stage_dict(cfg: RunConfig, index: int) -> dict[str, Any]:
    """Stage `index`'s run config as a plain mapping (not validated)."""
    base = cfg.model_dump(mode="json")
    base.pop("stages", None)
    return _merged(base, _expanded(cfg.stages[index].overrides))


def rl_stage_config(cfg: RunConfig, index: int) -> RunConfig:
    # type(cfg): the schema's RunConfig, without importing the schema that calls this module.
    return type(cfg).model_validate(rl_stage_dict(cfg, index))


def stage_problems(cfg: RunConfig, *, stage_checks: StageChecks) -> list[str]:
    """What keeps the stages from running, each naming the stage and the key. Each rl
    stage's config must parse and pass `stage_checks` (the run config's own cross-section
    checks, handed in by cross_checks.py, which calls this)."""
    from pydantic import ValidationError

    problems: list[str] = []
    last = len(cfg.stages) - 1
    for i, stage in enumerate(cfg.stages):
        if stage.kind != "rl":
            continue
        where = f"stages.{i}.overrides"
        try:
            over = _expanded(stage.overrides)
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if "stages" in over:
            problems.append(f"{where}.stages: an rl stage cannot hold stages of its own")
            continue
        if i > 0 and "path" in over.get("model", {}):
            problems.append(f"{where}.model.path: an rl stage after another starts from that stage's model; remove the override")
        try:
            rl = rl_stage_config(cfg, i)
        except ValidationError as exc:
            for err in exc.errors():
                loc = ".".join(str(x) for x in err["loc"])
                problems.append(f"{where}{'.' + loc if loc else ''}: {err['msg']}")
            continue
        problems.extend(f"{where}{'.' + path if path else ''}: {message}" for path, message in stage_checks(rl))
        if i > 0 and rl.warmup.steps > 0:
            problems.append(
                f"{where}.warmup.steps={rl.warmup.steps}: an rl stage after another starts from that stage's model, which "
                "is already trained (an sft stage is the warm-up); set warmup.steps=0"
            )
        if i < last and not rl.checkpoint.export_final:
            problems.append(f"{where}.checkpoint.export_final=false: stage {i + 1} starts from this stage's final model; set it true")
    return problems
