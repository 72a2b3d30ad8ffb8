"""ratchet's optional features and the extra that installs each (`pip install
'ratchet-rl[mlflow]'`; `[all]` installs every one, and `make venv` does).

The core (`pip install ratchet-rl`) trains, checkpoints and recovers runs: torch,
transformers, Ray, Temporal, the config and storage layers. What only some runs use is an
extra, imported only where a run or command uses it: MLflow and wandb tracking, sweeps
(Optuna, over the run registry), the run registry itself (SQLAlchemy and Alembic), LoRA
(peft) and `ratchet plot` (matplotlib). A worker image for runs that use none of them
installs none of them.

Where a feature is asked for and its packages are missing, the error says so before
anything starts: the config check names the field (`tracking.mlflow`, `trainer.lora`),
a command names itself, and a worker whose environment lacks what a run needs fails that
run with `MissingExtra` (not retried). Standard library only.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from ratchet.errors import MissingExtra

PACKAGE = "ratchet-rl"


@dataclass(frozen=True)
class Extra:
    name: str  # as pyproject.toml's [project.optional-dependencies] names it
    modules: tuple[str, ...]  # what it installs, by the module each is imported as
    feature: str  # what needs it, in words

    def missing(self) -> list[str]:
        """The modules of this extra that cannot be imported here."""
        return [m for m in self.modules if importlib.util.find_spec(m) is None]

    def message(self, what: str | None = None) -> str:
        return (
            f"{what or self.feature} needs {', '.join(self.missing() or self.modules)}, which this environment lacks: "
            f"pip install '{PACKAGE}[{self.name}]' (or '{PACKAGE}[all]')"
        )


EXTRAS: dict[str, Extra] = {
    e.name: e
    for e in (
        Extra("mlflow", ("mlflow",), "MLflow tracking (tracking.mlflow) and the MLflow UI"),
        Extra("wandb", ("wandb",), "Weights & Biases tracking (tracking.wandb)"),
        Extra("registry", ("sqlalchemy", "alembic"), "the run registry (`ratchet runs`, `ratchet registry`)"),
        Extra("sweeps", ("optuna", "sqlalchemy", "alembic"), "a sweep (`ratchet sweep`: Optuna's trials in the run registry)"),
        Extra("lora", ("peft",), "LoRA adapters (trainer.lora)"),
        Extra("plots", ("matplotlib",), "`ratchet plot`"),
    )
}


def installed(name: str) -> bool:
    return not EXTRAS[name].missing()


def require(name: str, what: str | None = None) -> None:
    """MissingExtra naming `what` (by default the extra's feature) and the install command,
    unless every package of extra `name` is importable."""
    extra = EXTRAS[name]
    if extra.missing():
        raise MissingExtra(extra.message(what))


def missing_message(name: str, what: str | None = None) -> str | None:
    """The message `require` would raise, or None when extra `name` is installed."""
    extra = EXTRAS[name]
    return extra.message(what) if extra.missing() else None
