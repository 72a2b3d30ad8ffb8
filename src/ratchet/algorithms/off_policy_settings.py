"""The settings of the rollout correction (IS weights, rejection criteria) and their checks,
without torch: the config schema (`algorithm.off_policy.is_weights`, `.rejection`) and the
torch code (rollout_correction.py) validate with the same functions, so a config that
passes at submit time cannot fail the same check inside a trainer.

Each check returns the list of problems as (field, message) pairs, the field relative to
the setting (`high`, `low`, ...), so the schema can name `algorithm.off_policy.rejection.1.low`
and a direct caller gets a ValueError naming the same field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any

IS_LEVELS = ("token", "sequence", "geometric")
IS_KINDS = ("truncate", "icepop")
STATISTICS = ("ratio", "k2", "k3")
REJECTION_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")
# Modes that already put weights on the tokens (tis, decoupled) or that do not recompute the
# proximal log-probs the IS weights and rejection statistics are taken from (bypass).
MODES_WITHOUT_IS_WEIGHTS = ("tis", "decoupled", "bypass")
MODES_WITHOUT_REJECTION = ("bypass",)

Problem = tuple[str, str]


@dataclass(frozen=True)
class ISWeights:
    """Importance weights w = pi_old / mu multiplied into the policy loss (verl's `rollout_is`)."""

    level: str = "token"  # token | sequence (product) | geometric (geometric mean)
    low: float | None = None  # truncate: lower clamp (None: none); icepop: lower bound (required)
    high: float | None = 2.0  # truncate: upper clamp (required); icepop: upper bound (required)
    kind: str = "truncate"  # truncate (TIS) | icepop (weight 0 outside [low, high])
    batch_normalize: bool = False  # divide by the batch mean of the weights (mean 1 afterwards)


@dataclass(frozen=True)
class RejectionCriterion:
    """Drop a token (level token) or a whole sequence (seq_*) whose statistic is outside
    [low, high]; None leaves that side open. Several criteria: kept only if all pass."""

    statistic: str  # ratio (pi_old / mu) | k2 (0.5 log^2 ratio) | k3 (ratio - 1 - log ratio)
    level: str = "token"  # token | seq_sum | seq_mean | seq_max
    low: float | None = None
    high: float | None = None

    @property
    def name(self) -> str:
        return f"{self.statistic}_{self.level}"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bounds(low: Any, high: Any, *, positive: bool) -> list[Problem]:
    out: list[Problem] = []
    for name, value in (("low", low), ("high", high)):
        if value is None:
            continue
        if not _number(value) or value != value or value in (float("inf"), float("-inf")):
            out.append((name, f"expected a finite number or null, got {value!r}"))
        elif positive and value <= 0:
            out.append((name, f"must be > 0 (a bound on the ratio pi_old / mu), got {value}"))
        elif not positive and value < 0:
            out.append((name, f"must be >= 0 (k2 and k3 are never negative), got {value}"))
    if not out and low is not None and high is not None and low > high:
        out.append(("low", f"{low} is above high ({high}): nothing could pass; swap them"))
    return out


def is_weights_problems(spec: ISWeights) -> list[Problem]:
    out: list[Problem] = []
    if spec.level not in IS_LEVELS:
        out.append(("level", f"expected one of: {', '.join(IS_LEVELS)}; got {spec.level!r}"))
    if spec.kind not in IS_KINDS:
        out.append(("kind", f"expected one of: {', '.join(IS_KINDS)}; got {spec.kind!r}"))
    out += _bounds(spec.low, spec.high, positive=True)
    if spec.high is None:
        out.append(("high", "must be set: untruncated importance weights have unbounded variance (TIS uses e.g. 2.0)"))
    if spec.kind == "icepop" and spec.low is None:
        out.append(("low", "icepop needs both bounds (the paper's are low=0.5, high=5)"))
    return out


def criterion_problems(spec: RejectionCriterion) -> list[Problem]:
    out: list[Problem] = []
    if spec.statistic not in STATISTICS:
        out.append(("statistic", f"expected one of: {', '.join(STATISTICS)}; got {spec.statistic!r}"))
    if spec.level not in REJECTION_LEVELS:
        out.append(("level", f"expected one of: {', '.join(REJECTION_LEVELS)}; got {spec.level!r}"))
    if spec.statistic == "ratio" and spec.level == "seq_max":
        out.append(("level", "the ratio has no seq_max level (as in verl): use token, seq_sum or seq_mean, or k2/k3 at seq_max"))
    if spec.low is None and spec.high is None:
        out.append(("high", "set low, high or both: a criterion without bounds rejects nothing"))
    out += _bounds(spec.low, spec.high, positive=spec.statistic == "ratio")
    return out


def rejection_problems(specs: list[RejectionCriterion]) -> list[Problem]:
    """Problems of each criterion (field `<index>.<name>`) and repeats of the same statistic and level."""
    out: list[Problem] = []
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        out += [(f"{i}.{name}", message) for name, message in criterion_problems(spec)]
        if spec.name in seen:
            out.append(
                (f"{i}", f"repeats statistic {spec.statistic} at level {spec.level} of criterion {seen[spec.name]}; merge their bounds")
            )
        seen.setdefault(spec.name, i)
    return out


def mode_problems(mode: str, is_weights: ISWeights | None, rejection: list[RejectionCriterion]) -> list[Problem]:
    out: list[Problem] = []
    if is_weights is not None and mode in MODES_WITHOUT_IS_WEIGHTS:
        why = "does not recompute the old log-probs" if mode == "bypass" else "already weights the tokens"
        out.append(("is_weights", f"mode {mode!r} {why}; set algorithm.off_policy.mode=none (or rejection) to use is_weights"))
    if rejection and mode in MODES_WITHOUT_REJECTION:
        out.append(
            ("rejection", f"mode {mode!r} does not recompute the old log-probs the criteria compare; use mode none, tis or decoupled")
        )
    return out


def _get(obj: Any, name: str, default: Any) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _default(f: Field) -> Any:
    return None if f.default is MISSING else f.default


def as_is_weights(obj: Any) -> ISWeights | None:
    """An `ISWeights` from itself, None, a mapping, or any object with the same attributes
    (the pydantic config section: the trainer reads the config by attribute only)."""
    if obj is None or isinstance(obj, ISWeights):
        return obj
    return ISWeights(**{f.name: _get(obj, f.name, _default(f)) for f in fields(ISWeights)})


def as_rejection(items: Any) -> list[RejectionCriterion]:
    """`RejectionCriterion`s from None, or a list of criteria, mappings or config sections."""
    out = []
    for item in items or ():
        if isinstance(item, RejectionCriterion):
            out.append(item)
        else:
            out.append(RejectionCriterion(**{f.name: _get(item, f.name, _default(f)) for f in fields(RejectionCriterion)}))
    return out


def raise_problems(problems: list[Problem], prefix: str) -> None:
    if problems:
        raise ValueError("; ".join(f"{prefix}{'.' if field else ''}{field}: {message}" for field, message in problems))
