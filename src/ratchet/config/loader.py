"""Turn YAML plus dotted overrides into a validated `RunConfig`, or fail with every problem at once.

A run that starts with a typo in a key, a missing dataset or a reward function that does not
import wastes a cluster allocation and surfaces deep in a worker's log. So everything that
can be checked at submit time is checked here, and each problem is reported as a dotted
field path plus a message that says what was expected and how to fix it. Problems are
collected rather than raised one by one, so a user fixes a config in one round trip.

Why one module of ~400 lines: reading, merging and checking a config, and translating
pydantic's errors into field paths and fixes, all walk the same schema.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from ratchet.config import credentials, cross_checks
from ratchet.config.dataset_check import check_data
from ratchet.config.schema import RunConfig
from ratchet.config.sections import section_at
from ratchet.data.files import DatasetFileError, dataset_format
from ratchet.extras import missing_message
from ratchet.tasks.loading import RewardLoadError, load_filter_fn, load_reward_fn

__all__ = ["ConfigError", "Issue", "config_to_yaml", "load_config", "parse_config", "validate_config"]

Issue = tuple[str, str]
"""(dotted field path, message). Problems that belong to no field use a parenthesised path,
such as `(overrides)`, or the config file's path."""

PREPARE_HINT = "run `ratchet prepare` to build the demo model and data (`ratchet prepare --model smollm2-135m` for SmolLM2-135M)"
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_LEADING_PATH = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)\b")


class ConfigError(ValueError):
    """Every problem found in a run configuration.

    A ValueError so callers that already guard against bad values catch it; `issues` stays
    structured so the CLI and the Python client can render or inspect them field by field.
    """

    def __init__(self, issues: Sequence[Issue]) -> None:
        self.issues: list[Issue] = list(issues)
        super().__init__(self._render())

    def _render(self) -> str:
        lines = ["invalid run configuration:"]
        lines.extend(f"  {path}: {message}" for path, message in self.issues)
        return "\n".join(lines)

    def __reduce__(self) -> tuple[type[ConfigError], tuple[list[Issue]]]:
        # The default reduction would rebuild from the rendered text; errors cross process
        # boundaries (Ray, Temporal), so keep the structured issues.
        return (type(self), (self.issues,))


def load_config(
    path: str | Path | None,
    overrides: Sequence[str] = (),
    *,
    base: Mapping[str, Any] | None = None,
    check_files: bool = True,
) -> RunConfig:
    """Load a YAML file (or start from `base`, a plain dict), apply `key=value` overrides
    in order, and validate.

    OmegaConf does the merging so overrides use the same dotted syntax and YAML value
    parsing as verl and Hydra users already know; interpolations (`${...}`) are resolved
    before validation so the schema sees plain values.
    """
    if path is not None and base is not None:
        raise TypeError("give a YAML path or a base dict, not both")
    start = _load_yaml(Path(path)) if path is not None else OmegaConf.create(dict(base or {}))
    merged = _apply_overrides(start, overrides)
    # Before resolving: `${oc.env:AWS_SECRET_ACCESS_KEY}` is refused by name, whether set or not.
    refused = credentials.check_interpolations(OmegaConf.to_container(merged, resolve=False))
    if refused:
        raise ConfigError(refused)
    try:
        data = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError([(getattr(exc, "full_key", None) or "(config)", _first_line(exc))]) from exc
    assert isinstance(data, dict)  # the base is a DictConfig, and merging keeps it one
    return validate_config(data, check_files=check_files)


def validate_config(data: Mapping[str, Any], *, check_files: bool = True) -> RunConfig:
    """Validate a plain mapping (the Python client's entry point) and return it with paths made absolute.

    Paths are resolved against this process's working directory because workers run in
    other folders, or on other machines sharing a file system, and must open the same files.
    `check_files=False` skips checks of the local file system and of importing the reward
    function, for configs that are meant for another machine.
    """
    if not isinstance(data, Mapping):
        raise ConfigError([("(config)", f"expected a mapping of sections, got {type(data).__name__}")])
    # First and alone: the other checks echo the values they refuse, and a credential must
    # not reach a terminal or a log that way.
    refused = credentials.check_values(data)
    if refused:
        raise ConfigError(refused)
    cfg = _resolve_paths(_parsed(data))
    issues = _cross_section_issues(cfg)
    if check_files:
        file_issues = _check_files(cfg)
        # The data checks read what the file checks vouch for; a missing model or dataset
        # is already reported and would only add noise.
        blamed = {path for path, _ in file_issues}
        if not blamed & {"model.path", "data.train_files", "data.eval_files"}:
            file_issues += check_data(cfg)
        issues = file_issues + issues
    if issues:
        raise ConfigError(issues)
    return cfg


def parse_config(data: Mapping[str, Any]) -> RunConfig:
    """`data` as a RunConfig that passed every check of the config alone: each section's
    own (the schema) and those across sections (cross_checks.py); a ConfigError naming each
    field otherwise. No file is read."""
    cfg = _parsed(data)
    issues = _cross_section_issues(cfg)
    if issues:
        raise ConfigError(issues)
    return cfg


def _parsed(data: Mapping[str, Any]) -> RunConfig:
    """`data` through the schema: each section's own checks."""
    try:
        return RunConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError([_translate(err) for err in exc.errors()]) from None


def _cross_section_issues(cfg: RunConfig) -> list[Issue]:
    return [(path or _leading_field_path(message) or "(config)", message) for path, message in cross_checks.problems(cfg)]


def config_to_yaml(cfg: RunConfig) -> str:
    """The full config, defaults included, as YAML that `load_config` reads back unchanged.

    Stored next to each run so what ran can be reproduced without knowing which defaults
    were in force at the time.
    """
    return OmegaConf.to_yaml(cfg.model_dump(mode="json"))


# --- reading and merging ------------------------------------------------------------------


def _load_yaml(path: Path) -> DictConfig:
    where = str(path.expanduser().resolve())
    if not path.exists():
        raise ConfigError([(where, "config file not found")])
    if not path.is_file():
        raise ConfigError([(where, "not a file; expected a YAML config file")])
    try:
        loaded = OmegaConf.load(path)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError([(where, f"invalid YAML{at}: {exc.problem or exc.context}")]) from None
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as exc:
        raise ConfigError([(where, f"cannot read YAML: {_first_line(exc)}")]) from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError([(where, "expected a mapping of sections (model:, data:, ...) at the top level, got a list")])
    return loaded


def _apply_overrides(base: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """Merge overrides one at a time, so a merge that fails can name the override that caused it."""
    malformed = [o for o in overrides if "=" not in o or not o.split("=", 1)[0].strip()]
    if malformed:
        raise ConfigError([("(overrides)", f"malformed override {o!r}: expected key=value, e.g. trainer.lr=3e-4") for o in malformed])
    merged = base
    for override in overrides:
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([override]))
        except (OmegaConfBaseException, TypeError, ValueError) as exc:
            key = override.split("=", 1)[0].strip()
            raise ConfigError([(key, f"cannot apply override {override!r}: {_first_line(exc)}")]) from None
    assert isinstance(merged, DictConfig)
    return merged


# --- translating pydantic errors ----------------------------------------------------------


def _translate(err: ErrorDetails) -> Issue:
    """One pydantic error as an issue a user can act on without knowing pydantic."""
    loc = tuple(err["loc"])
    path = ".".join(str(part) for part in loc) or "(config)"
    kind, ctx, given = err["type"], err.get("ctx") or {}, err.get("input")
    got = f"got {_show(given)}"

    if kind == "extra_forbidden":
        return path, _unknown_key(loc)
    if kind == "missing":
        return path, _missing(loc)
    if kind == "value_error":
        # Field validators (the registries) and the run-level validator already phrase a
        # complete message, listing valid names; pydantic only prefixes "Value error, ".
        message = str(ctx.get("error", err["msg"]))
        if not loc:
            path = _leading_field_path(message) or path
        return path, message
    if kind == "literal_error":
        allowed = _literal_values(loc)
        expected = ", ".join(str(v) for v in allowed) if allowed else ctx.get("expected", "?")
        return path, f"expected one of: {expected}; {got}"
    if kind == "finite_number":
        return path, f"must be a finite number, {got}; nan and inf are refused"
    if kind in ("float_type", "float_parsing"):
        return path, f"expected a number, {got}"
    if kind in ("int_type", "int_parsing", "int_from_float", "int_parsing_size"):
        return path, f"expected an integer, {got}"
    if kind in ("bool_type", "bool_parsing"):
        return path, f"expected true/false, {got}"
    if kind == "string_type":
        return path, f"expected a string, {got}"
    if kind in ("list_type", "tuple_type"):
        return path, f"expected a list, {got}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        section = _section_at(loc)
        keys = f" (keys: {', '.join(sorted(section.model_fields))})" if section is not None else ""
        return path, f"expected a mapping of settings{keys}, {got}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()), "?")
        return path, f"must be {bounds[kind]} {limit}, {got}"
    if kind == "string_pattern_mismatch":
        return path, f"must match the pattern {ctx.get('pattern')}, {got}"
    message = err["msg"]
    return path, f"{message[:1].lower()}{message[1:]}; {got}"


def _unknown_key(loc: tuple[Any, ...]) -> str:
    key = str(loc[-1])
    section = _section_at(loc[:-1])
    valid = sorted(section.model_fields) if section is not None else []
    where = f"of {'.'.join(map(str, loc[:-1]))}" if len(loc) > 1 else "at the top level"
    message = f"unknown key {'.'.join(map(str, loc))!r}; valid keys {where}: {', '.join(valid)}"
    close = difflib.get_close_matches(key, valid, n=1)
    if close:
        message += f" (did you mean {close[0]!r}?)"
    return message


def _missing(loc: tuple[Any, ...]) -> str:
    if loc and isinstance(loc[-1], int):
        return f"required field missing: too few values, item {loc[-1]} is missing"
    section = _section_at(loc)
    if section is not None:
        keys = ", ".join(sorted(section.model_fields))
        required = ", ".join(n for n, f in section.model_fields.items() if f.is_required())
        return f"required field missing: add a '{loc[-1]}' section (keys: {keys}; required: {required})"
    field = _field_at(loc)
    about = f" ({field.description.rstrip('.')})" if field is not None and field.description else ""
    return f"required field missing: set {'.'.join(map(str, loc))}{about}"


def _section_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The schema model that `loc` points at, or None when it points at a plain value."""
    return section_at(RunConfig, loc)


def _field_at(loc: tuple[Any, ...]) -> FieldInfo | None:
    if not loc:
        return None
    parent = _section_at(loc[:-1])
    return parent.model_fields.get(loc[-1]) if parent is not None and isinstance(loc[-1], str) else None


def _literal_values(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    field = _field_at(loc)
    if field is None or typing.get_origin(field.annotation) is not typing.Literal:
        return ()
    return typing.get_args(field.annotation)


def _leading_field_path(message: str) -> str | None:
    """`rollout.n` for "rollout.n must be >= 2 ...": run-level checks name the field they blame."""
    match = _LEADING_PATH.match(message)
    if match is None:
        return None
    loc = tuple(match.group(1).split("."))
    return match.group(1) if _field_at(loc) is not None else None


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --- paths and semantic checks ------------------------------------------------------------


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _resolve_paths(cfg: RunConfig) -> RunConfig:
    """A copy with local paths absolute; the caller's objects are never mutated."""
    data = cfg.data.model_copy(
        update={
            "train_files": _absolute(cfg.data.train_files),
            "eval_files": _absolute(cfg.data.eval_files) if cfg.data.eval_files else cfg.data.eval_files,
        }
    )
    root = cfg.storage.root
    storage = cfg.storage.model_copy(update={"root": root if _SCHEME.match(root) else _absolute(root)})
    function = cfg.reward.function
    if function is not None:
        target, sep, fn_name = function.rpartition(":")
        function = f"{_absolute(target)}:{fn_name}" if sep and target.endswith(".py") else function
    reward_model = _absolute(cfg.reward.model_path) if cfg.reward.model_path else None
    critic_model = _absolute(cfg.critic.model_path) if cfg.critic.model_path else None
    safety = cfg.safety.model_copy(
        update={
            "cost_function": _absolute_function(cfg.safety.cost_function),
            "cost_model_path": _absolute(cfg.safety.cost_model_path) if cfg.safety.cost_model_path else None,
        }
    )
    rollout = cfg.rollout.model_copy(update={"filter": _absolute_function(cfg.rollout.filter)})
    return cfg.model_copy(
        update={
            "safety": safety,
            "rollout": rollout,
            "model": cfg.model.model_copy(update={"path": _absolute(cfg.model.path)}),
            "data": data,
            "storage": storage,
            "reward": cfg.reward.model_copy(update={"function": function, "model_path": reward_model}),
            "critic": cfg.critic.model_copy(update={"model_path": critic_model}),
        }
    )


def _absolute_function(spec: str | None) -> str | None:
    """'path/to/file.py:function' with the path made absolute; 'module:function' as it is."""
    if spec is None:
        return None
    target, sep, fn_name = spec.rpartition(":")
    return f"{_absolute(target)}:{fn_name}" if sep and target.endswith(".py") else spec


def _check_extras(cfg: RunConfig) -> list[Issue]:
    """The field of each feature the run turns on whose extra is not installed here."""
    wanted = [
        ("tracking.mlflow", cfg.tracking.mlflow, "mlflow", "tracking.mlflow (on by default; set it false to go without)"),
        ("tracking.wandb.enabled", cfg.tracking.wandb.enabled, "wandb", None),
        ("trainer.lora.rank", cfg.trainer.lora.rank > 0, "lora", None),
    ]
    found = [(field, missing_message(extra, what)) for field, on, extra, what in wanted if on]
    return [(field, message) for field, message in found if message]


def _check_files(cfg: RunConfig) -> list[Issue]:
    """Checks against this machine: the model, the datasets and the reward function must be
    usable, and the optional packages the run's features need installed (extras.py)."""
    issues: list[Issue] = _check_extras(cfg)
    models = [("model.path", cfg.model.path), ("reward.model_path", cfg.reward.model_path), ("critic.model_path", cfg.critic.model_path)]
    models.append(("safety.cost_model_path", cfg.safety.cost_model_path))
    for field, name in models:
        if name is None:
            continue
        model = Path(name)
        if not model.exists():
            issues.append((field, f"model folder not found: {model}; {PREPARE_HINT}"))
        elif not model.is_dir():
            issues.append((field, f"expected a Hugging Face model folder, got a file: {model}; {PREPARE_HINT}"))
        elif not (model / "config.json").is_file():
            issues.append((field, f"{model} has no config.json, so it is not a Hugging Face model folder; {PREPARE_HINT}"))
    datasets = [("data.train_files", cfg.data.train_files), ("data.eval_files", cfg.data.eval_files)]
    for field, name in datasets:
        if name is None:
            continue
        if not Path(name).exists():
            issues.append((field, f"file not found: {name}; {PREPARE_HINT}"))
        else:
            try:
                dataset_format(name)  # parquet, JSON Lines or a save_to_disk folder, by the path
            except DatasetFileError as exc:
                issues.append((field, str(exc)))
    if cfg.reward.function is not None:
        try:
            load_reward_fn(cfg.reward.function)
        except RewardLoadError as exc:
            issues.append(("reward.function", str(exc)))
    if cfg.safety.cost_function is not None:
        try:
            load_reward_fn(cfg.safety.cost_function)  # the reward function's contract
        except RewardLoadError as exc:
            issues.append(("safety.cost_function", str(exc)))
    if cfg.rollout.filter is not None:
        try:
            load_filter_fn(cfg.rollout.filter)
        except RewardLoadError as exc:
            issues.append(("rollout.filter", str(exc)))
    if cfg.rollout.multi_turn.enabled:  # the tool classes import and build (a tool of your own included)
        from ratchet.tools.config import tool_issues

        issues += tool_issues(cfg.rollout.multi_turn.tools)
    return issues
