"""The sweep spec: a base run config, a search space over its dotted keys, how to search
it, what to optimise and when to stop a weak trial; validated whole before anything starts.

A sweep that fails on trial 5 of 40 because a sampled value makes an invalid config wastes
the first four trials' compute, so `compile_sweep` builds every trial's config that can be
known up front (grid and random: all of them; TPE: each choice and each range bound on the
base) and checks it through the run-config schema, naming the trial, the field and the
space value behind it. Problems are collected and raised together as a `SweepSpecError`
(a `ConfigError`, so the CLI prints it like a run config's).

    name: copy-lr
    base: copy_grpo.yaml            # a run config path (relative to this file) or a mapping
    overrides: [loop.steps=20]
    space:
      trainer.lr: {low: 1.0e-4, high: 3.0e-3, log: true}
      rollout.n: [4, 8]             # a bare list is a choice
    search: random                  # grid | random | tpe
    trials: 8
    parallelism: 2
    objective: {metric: eval_reward, direction: max}
    early_stopping: {rule: asha, rungs: [5, 10], eta: 2}

Why one module of ~400 lines: the spec's schema and its checks against the base config
(each space key a real, live field; a trial's config valid) share the field walkers.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ratchet.config.loader import ConfigError, Issue, load_config, validate_config
from ratchet.extras import missing_message
from ratchet.config.sections import section_in
from ratchet.config.schema import RunConfig
from ratchet.config.sweep_search import grid_points, grid_size, random_point

SEARCH_KINDS = ("grid", "random", "tpe")
STOP_RULES = ("none", "median", "asha")
# Sections whose values name files or code: a trial that changes one is checked against
# the file system (its files exist, its reward function imports), like a submitted run.
_FILE_SECTIONS = ("model.", "data.", "reward.", "storage.")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,79}$"


class SweepSpecError(ConfigError):
    """Every problem found in a sweep spec (and the trial configs it makes)."""

    def _render(self) -> str:
        lines = ["invalid sweep spec:"]
        lines.extend(f"  {path}: {message}" for path, message in self.issues)
        return "\n".join(lines)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ParamSpace(_Strict):
    """One parameter's values: a choice list (`values`), or a range (`low`..`high`, int or
    float, optionally log-scaled; `num` points of it for grid search)."""

    values: list[Any] | None = Field(None, description="The choices (numbers, strings, booleans, null).")
    low: float | None = Field(None, description="Range: the smallest value.")
    high: float | None = Field(None, description="Range: the largest value.")
    type: Literal["float", "int"] | None = Field(None, description="Range: int or float (default: int when both bounds are integers).")
    log: bool = Field(False, description="Range: sample (and space grid points) on a log scale; needs low > 0.")
    num: int | None = Field(
        None,
        ge=1,
        le=10_000,
        description="Grid search over a range: this many points, low and high included (at most 10000, the most trials).",
    )

    @property
    def bounds(self) -> tuple[float, float]:
        """(low, high) of a range; a choice has none."""
        if self.low is None or self.high is None:
            raise ValueError("a choice parameter has no low/high bounds")
        return self.low, self.high

    @model_validator(mode="before")
    @classmethod
    def _infer_int(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("type") is None and "low" in data and "high" in data:
            lo, hi = data["low"], data["high"]
            if isinstance(lo, int) and isinstance(hi, int) and not isinstance(lo, bool) and not isinstance(hi, bool):
                data = {**data, "type": "int"}
        return data

    @model_validator(mode="after")
    def _one_kind(self) -> "ParamSpace":
        is_range = self.low is not None or self.high is not None
        if self.values is not None and is_range:
            raise ValueError("give either values (a choice) or low/high (a range), not both")
        if self.values is not None:
            if not self.values:
                raise ValueError("values is empty: list at least one choice")
            bad = [v for v in self.values if not (v is None or isinstance(v, (bool, int, float, str)))]
            if bad:
                raise ValueError(
                    f"choices must be numbers, strings, booleans or null, got {bad[0]!r}; a list or mapping cannot be a choice"
                )
            if len({repr(v) for v in self.values}) != len(self.values):
                raise ValueError("values has duplicates: list each choice once")
            return self
        if self.low is None or self.high is None:
            raise ValueError("a range needs both low and high (or give values: [...] for a choice)")
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"a log-scale range needs low > 0, got {self.low}")
        if self.type == "int" and (self.low != int(self.low) or self.high != int(self.high)):
            raise ValueError("an int range needs integer bounds")
        return self

    @property
    def is_choice(self) -> bool:
        return self.values is not None


class Objective(_Strict):
    metric: str = Field(
        "eval_reward",
        description="eval_reward: the evaluation at the trial's last step (needs data.eval_files); any other name: "
        "that key of metrics.jsonl (e.g. reward_mean), averaged over the last `last_k` steps.",
    )
    last_k: int = Field(1, ge=1, le=10**9, description="Steps averaged for a metrics.jsonl metric (at most 1e9, loop.steps' own bound).")
    direction: Literal["max", "min"] = Field("max", description="Maximise or minimise the metric.")


class EarlyStopping(_Strict):
    rule: Literal["none", "median", "asha"] = Field(
        "none",
        description="median: stop a trial whose value at a rung is worse than the median of the other trials' values "
        "there; asha: stop it unless it is in the top 1/eta of the trials that reached the rung (itself included).",
    )
    rungs: list[int] = Field(default_factory=list, description="Steps at which trials are compared (ascending, each below loop.steps).")
    eta: int = Field(3, ge=2, le=10_000, description="asha: keep the top 1/eta at each rung (at most 10000, the most trials).")
    metric: str = Field("reward_mean", description="The metrics.jsonl key compared at the rungs.")
    direction: Literal["max", "min"] | None = Field(
        None, description="Whether a higher or lower value at a rung is better (default: the objective's direction)."
    )
    window: int = Field(
        1, ge=1, le=10**9, description="A trial's value at rung r: the mean of the metric over steps r-window+1..r (at most 1e9)."
    )
    min_trials: int = Field(
        1, ge=1, le=10_000, description="median: how many other trials must have reached the rung before one is stopped (at most 10000)."
    )

    @field_validator("rungs")
    @classmethod
    def _ascending(cls, rungs: list[int]) -> list[int]:
        if any(r < 1 for r in rungs):
            raise ValueError(f"rungs are step counts >= 1, got {rungs}")
        if rungs != sorted(set(rungs)):
            raise ValueError(f"rungs must be ascending and distinct, got {rungs}")
        return rungs

    @model_validator(mode="after")
    def _rungs_needed(self) -> "EarlyStopping":
        if self.rule != "none" and not self.rungs:
            raise ValueError(f"early_stopping.rule {self.rule!r} needs rungs: the steps to compare trials at, e.g. rungs: [5, 10]")
        return self


class SweepSpec(_Strict):
    """A sweep: trials of one base run config with values from `space`."""

    name: str = Field("sweep", pattern=NAME_PATTERN, description="Sweep name; the sweep id is '<name>-<timestamp>-<random>'.")
    base: str | dict[str, Any] = Field(description="The run config: a YAML path (relative to the spec's folder) or the config itself.")
    overrides: list[str] = Field(default_factory=list, description="Dotted overrides of the base, e.g. loop.steps=20.")
    space: dict[str, ParamSpace] = Field(description="Dotted run-config key -> its values (a list) or range.")
    search: Literal["grid", "random", "tpe"] = Field(
        "random", description="grid: every combination; random: seeded draws; tpe: Optuna's TPE sampler."
    )
    trials: int | None = Field(None, ge=1, le=10_000, description="How many trials (grid: at most, and by default, the grid size).")
    parallelism: int = Field(1, ge=1, le=1000, description="Most trials running at once.")
    objective: Objective = Field(default_factory=Objective)
    early_stopping: EarlyStopping = Field(default_factory=EarlyStopping)
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of the random and TPE samplers.")
    poll_seconds: float = Field(5.0, ge=0.2, le=600, description="How often the sweep reads its running trials' metrics (early stopping).")

    @field_validator("space", mode="before")
    @classmethod
    def _bare_lists(cls, space: Any) -> Any:
        if isinstance(space, Mapping):
            return {k: ({"values": list(v)} if isinstance(v, (list, tuple)) else v) for k, v in space.items()}
        return space

    @field_validator("space")
    @classmethod
    def _known_keys(cls, space: dict[str, ParamSpace]) -> dict[str, ParamSpace]:
        if not space:
            raise ValueError("space is empty: give at least one key, e.g. trainer.lr: {low: 1.0e-4, high: 1.0e-2, log: true}")
        for key in space:
            problem = _config_key_problem(key)
            if problem:
                raise ValueError(f"space key {key!r}: {problem}")
        return space

    @model_validator(mode="after")
    def _trials_fit(self) -> "SweepSpec":
        if self.search == "grid":
            for key, p in self.space.items():
                if not p.is_choice and p.type != "int" and p.num is None:
                    raise ValueError(f"space.{key}: grid search over a float range needs num (how many points), e.g. num: 4")
            size = grid_size(self.space)
            if self.trials is not None and self.trials > size:
                raise ValueError(f"trials ({self.trials}) exceeds the grid size ({size}); leave trials out to run the whole grid")
        elif self.trials is None:
            raise ValueError(f"search {self.search!r} needs trials: how many to run, e.g. trials: 20")
        return self

    @property
    def num_trials(self) -> int:
        return self.trials if self.trials is not None else grid_size(self.space)


def _config_key_problem(key: str) -> str | None:
    """Why `key` is not a settable leaf of the run config (None when it is)."""
    model: Any = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = model.model_fields
        if part not in fields:
            near = difflib.get_close_matches(part, list(fields), n=1)
            where = ".".join(parts[:i]) or "the config"
            hint = f"; did you mean {'.'.join([*parts[:i], near[0]])}?" if near else f" (keys of {where}: {', '.join(sorted(fields))})"
            return f"not a run config key{hint}"
        section = section_in(fields[part].annotation)  # X, or an optional X | None
        last = i == len(parts) - 1
        if last and section is not None:
            return f"is a section; name one of its keys, e.g. {key}.{next(iter(section.model_fields))}"
        if not last and section is None:
            return f"{'.'.join(parts[: i + 1])} is a value, not a section"
        model = section
    return None


# -- loading -------------------------------------------------------------------------------


def _issues(exc: ValidationError, prefix: str = "") -> list[Issue]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(spec)"
        msg = str((err.get("ctx") or {}).get("error", err["msg"]))
        if err["type"] == "extra_forbidden":
            msg = "unknown key; remove it (see docs/sweeps.md for the spec's keys)"
        elif err["type"] == "missing":
            msg = "required; add it (see docs/sweeps.md)"
        out.append((prefix + loc, msg))
    return out


def load_sweep_spec(spec: str | Path | Mapping[str, Any] | SweepSpec, overrides: Sequence[str] = ()) -> tuple[SweepSpec, Path]:
    """The spec from a YAML path, a mapping or a model, with `overrides` applied: `sweep.KEY=V`
    sets a spec key (sweep.trials=4), any other `KEY=V` is appended to the base's overrides.
    Returns it with the folder its relative `base` path is read from."""
    spec_dir = Path.cwd()
    if isinstance(spec, SweepSpec):
        raw: Any = spec.model_dump(mode="json")
    elif isinstance(spec, Mapping):
        raw = dict(spec)
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise SweepSpecError([(str(path), "sweep spec file not found")])
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise SweepSpecError([(str(path), f"invalid YAML: {exc}")]) from None
        spec_dir = path.resolve().parent
    if not isinstance(raw, Mapping):
        raise SweepSpecError([("(spec)", "expected a mapping with base:, space:, search:, ...")])
    raw = dict(raw)
    sweep_keys = [o for o in overrides if o.startswith("sweep.")]
    run_keys = [o for o in overrides if not o.startswith("sweep.")]
    if sweep_keys:
        try:
            merged = OmegaConf.merge(OmegaConf.create(raw), OmegaConf.from_dotlist([o[len("sweep.") :] for o in sweep_keys]))
            raw = OmegaConf.to_container(merged, resolve=True)
        except OmegaConfBaseException as exc:
            raise SweepSpecError([("(overrides)", f"cannot apply {sweep_keys}: {exc}")]) from None
    if run_keys:
        raw["overrides"] = [*(raw.get("overrides") or []), *run_keys]
    try:
        return SweepSpec.model_validate(raw), spec_dir
    except ValidationError as exc:
        raise SweepSpecError(_issues(exc)) from None


# -- trials ---------------------------------------------------------------------------------


def apply_params(config: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `config` (plain JSON) with each dotted key of `params` set."""
    out = copy.deepcopy(dict(config))
    for key, value in params.items():
        node = out
        *path, leaf = key.split(".")
        for part in path:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
    return out


def trial_params(spec: SweepSpec, index: int) -> dict[str, Any] | None:
    """Trial `index`'s values where they follow from the spec and seed alone (grid, random);
    None for TPE, whose values come from Optuna's study."""
    return None if spec.search == "tpe" else fixed_trial_params(spec, index)


def fixed_trial_params(spec: SweepSpec, index: int) -> dict[str, Any]:
    """Trial `index`'s values in a grid or random search."""
    if spec.search == "grid":
        return grid_points(spec.space)[index]
    if spec.search == "random":
        return random_point(spec.space, spec.seed, index)
    raise ValueError(f"search {spec.search!r} takes its values from Optuna's study, not from the spec")


def trial_config(base: Mapping[str, Any], params: Mapping[str, Any], *, check_files: bool = True) -> RunConfig:
    """Trial config: the base with `params` set, validated as a submitted run's would be."""
    touches_files = any(k.startswith(_FILE_SECTIONS) for k in params)
    return validate_config(apply_params(base, params), check_files=check_files and touches_files)


@dataclass
class CompiledSweep:
    spec: SweepSpec
    base: RunConfig  # base + overrides, validated, paths absolute
    params: list[dict[str, Any]] | None  # every trial's values (grid, random); None for TPE


def compile_sweep(spec: SweepSpec, spec_dir: Path | None = None) -> CompiledSweep:
    """Validate the base and every trial config that can be known now; SweepSpecError
    lists every problem, each naming the trial (or space value), field and fix."""
    spec_dir = spec_dir or Path.cwd()
    not_installed = missing_message("sweeps")
    if not_installed:  # nothing of a sweep runs without Optuna and the registry
        raise SweepSpecError([("(sweep)", not_installed)])
    try:
        if isinstance(spec.base, str):
            path = Path(spec.base).expanduser()
            path = path if path.is_absolute() else spec_dir / path
            base = load_config(path, spec.overrides)
        else:
            base = load_config(None, spec.overrides, base=spec.base)
    except ConfigError as exc:
        raise SweepSpecError([(f"base: {p}", m) for p, m in exc.issues]) from None
    issues: list[Issue] = []
    if spec.objective.metric == "eval_reward" and base.data.eval_files is None:
        issues.append(
            (
                "objective.metric",
                "eval_reward needs eval data: set data.eval_files in the base, or use a metrics.jsonl key such as reward_mean",
            )
        )
    too_late = [r for r in spec.early_stopping.rungs if r >= base.loop.steps]
    if spec.early_stopping.rule != "none" and too_late:
        issues.append(
            (
                "early_stopping.rungs",
                f"rungs {too_late} are not below loop.steps ({base.loop.steps}): a trial never stops there; lower them",
            )
        )
    base_json = base.model_dump(mode="json")
    params = None
    if spec.search in ("grid", "random"):
        params = [fixed_trial_params(spec, k) for k in range(spec.num_trials)]
        for k, values in enumerate(params):
            issues += _trial_issues(base_json, values, f"trial {k}")
    else:  # TPE: each choice, and each range's bounds, on the base
        for key, p in spec.space.items():
            candidates = list(p.values or ()) if p.is_choice else [_typed(p, bound) for bound in p.bounds]
            for value in candidates:
                issues += _trial_issues(base_json, {key: value}, f"space value {key}={value!r}")
    if issues:
        raise SweepSpecError(issues)
    return CompiledSweep(spec=spec, base=base, params=params)


def _typed(p: ParamSpace, value: float) -> int | float:
    return int(value) if p.type == "int" else float(value)


def _trial_issues(base: Mapping[str, Any], params: Mapping[str, Any], what: str) -> list[Issue]:
    try:
        trial_config(base, params)
    except ConfigError as exc:
        shown = ", ".join(f"{k}={v!r}" for k, v in params.items())
        return [
            (f"{what}: {path}", f"{message} (from {shown}; narrow space so every value makes a valid config)")
            for path, message in exc.issues
        ]
    return []


__all__ = [
    "SEARCH_KINDS", "STOP_RULES", "CompiledSweep", "EarlyStopping", "Objective", "ParamSpace", "SweepSpec", "SweepSpecError",
    "apply_params", "compile_sweep", "load_sweep_spec", "trial_config", "trial_params",
]  # fmt: skip
