"""Which config keys a running run may change (`ratchet set RUN trainer.lr=1e-5`), and the
check of a change.

A live change reaches the trainer with the next update (the workflow passes the values in
force in every `step` / `train` activity input, and the trainer applies them to that
update), so a key is live only if the trainer reads it afresh at every update and nothing
stored earlier depends on it. The updates a recovery replays are logged with the values
each used (`train_log/v<version>.json`), so a rebuilt trainer repeats them exactly and then
trains with the new values. The keys, each with why it is safe, are the `live` column of
config/key_rules.py; every other key is refused with the list of them, and its `instead`
column explains the refusals people ask for most.

Values go through the same pydantic fields (bounds, types, cross-field rules) as the run
config: the config with the change applied is validated as a whole. Standard library and
the config package only: the training workflow runs this check inside Temporal's sandbox
(the update's validator), and the client runs it before sending.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ratchet.config.key_rules import LIVE, NOT_LIVE  # the table of every key's rules

__all__ = ["LIVE", "NOT_LIVE", "check_live_changes", "effective_values", "parse_assignments", "refused_keys"]


def _issues_error(issues: list[tuple[str, str]]):
    from ratchet.config.loader import ConfigError

    return ConfigError(issues)


def refused_keys(keys: Sequence[str]) -> list[tuple[str, str]]:
    """(key, why) for each key that cannot change live; empty when all can."""
    allowed = ", ".join(LIVE)
    out = []
    for key in keys:
        if key in LIVE:
            continue
        why = NOT_LIVE.get(key, "it is read when the run's workers start, not at every update")
        out.append((key, f"cannot change while the run trains: {why}. Keys that can: {allowed}"))
    return out


def parse_assignments(items: Sequence[str] | Mapping[str, Any]) -> dict[str, Any]:
    """`["trainer.lr=1e-5", ...]` (values read as YAML) or a mapping, as key -> value."""
    import yaml

    if isinstance(items, Mapping):
        return {str(k).strip(): v for k, v in items.items()}
    out: dict[str, Any] = {}
    bad = []
    for item in items:
        key, sep, text = str(item).partition("=")
        if not sep or not key.strip():
            bad.append(("(set)", f"malformed {item!r}: expected key=value, e.g. trainer.lr=1e-5"))
            continue
        try:
            out[key.strip()] = yaml.safe_load(text)
        except yaml.YAMLError:
            out[key.strip()] = text
    if bad:
        raise _issues_error(bad)
    return out


def _with_values(config: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of `config` with each dotted key set."""
    import copy

    out = copy.deepcopy(dict(config))
    for key, value in values.items():
        section = out
        *parents, leaf = key.split(".")
        for part in parents:
            section = section.setdefault(part, {})
        section[leaf] = value
    return out


def _value_at(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return list(cfg) if isinstance(cfg, tuple) else cfg


def check_live_changes(config: Mapping[str, Any], current: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """The validated `changes` (key -> value as the config field holds it) to a run whose
    stored config is `config` and whose live values are `current`; a ConfigError naming
    each key that cannot change live, or each value its field refuses."""
    from ratchet.config.loader import ConfigError, parse_config

    if not changes:
        raise _issues_error([("(set)", f"nothing to change; give key=value pairs, e.g. trainer.lr=1e-5 (keys: {', '.join(LIVE)})")])
    issues = refused_keys(list(changes))
    kl = config.get("algorithm", {}).get("kl", {}).get("coef", 0.0)
    if "algorithm.kl.coef" in changes and not kl:
        issues.append(
            ("algorithm.kl.coef", "this run has no reference model (it started with algorithm.kl.coef=0), so a KL term "
             "cannot be switched on live; fork the run from a checkpoint with algorithm.kl.coef=... instead")
        )  # fmt: skip
    if issues:
        raise _issues_error(issues)
    try:
        cfg = parse_config(_with_values(config, {**current, **changes}))
    except ConfigError as exc:
        raise _issues_error(exc.issues) from None
    return {key: _value_at(cfg, key) for key in changes}


def effective_values(config: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    """Every live key's value in force: the live one where set, else the config's."""
    out = {}
    for key in LIVE:
        if key in live:
            out[key] = live[key]
            continue
        section: Any = config
        for part in key.split("."):
            section = section.get(part) if isinstance(section, Mapping) else None
        if section is not None:
            out[key] = section
    return out


def live_config(cfg: Any, live: Mapping[str, Any]):
    """`cfg` (a RunConfig) with the live values applied; `cfg` itself when there are none.
    The values were validated when set; a trainer applies them to one update."""
    from ratchet.config.schema import RunConfig

    if not live:
        return cfg
    return RunConfig.model_validate(_with_values(cfg.model_dump(mode="json"), live))


def without(live: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """The live values less `keys`: a resume or fork that sets a key in its overrides
    means the override, not the value the parent set live."""
    return {k: v for k, v in live.items() if k not in set(keys)}
