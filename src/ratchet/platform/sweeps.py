"""The sweep API: validate a sweep spec, start its workflow, watch and steer it.

    handle = client.sweep("examples/sweep_copy.yaml", ["sweep.trials=4"])
    for p in handle.follow():
        print(p.started, len(p.finished), p.best)
    summary = handle.result()          # SweepSummary: every trial and the best one

The spec and every trial config that can be known up front are validated here
(`compile_sweep`), so a bad space value is refused before any trial runs. Sweeps and their
trials are listed from the run registry (`sweep_records`), which the sweep's activities write.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Mapping, Sequence

from ratchet.ids import check_id
from ratchet.sweep_types import SweepInput, SweepPlan, SweepProgress, SweepSummary, trial_run_id
from .handles import ClientConnection, WorkflowHandle
from .taken_ids import check_new_sweep_id

if TYPE_CHECKING:
    from ratchet.config.sweep_spec import SweepSpec

SWEEP_WORKFLOW = "SweepWorkflow"


def make_sweep_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


def sweep_plan(spec: "SweepSpec") -> SweepPlan:
    es = spec.early_stopping
    return SweepPlan(
        trials=spec.num_trials,
        parallelism=spec.parallelism,
        direction=spec.objective.direction,
        stop_rule=es.rule,
        rungs=list(es.rungs) if es.rule != "none" else [],
        eta=es.eta,
        min_trials=es.min_trials,
        poll_seconds=spec.poll_seconds,
        stop_direction=es.direction or spec.objective.direction,
    )


def prepare_sweep(
    spec: "str | Path | Mapping[str, Any] | SweepSpec",
    overrides: Sequence[str] = (),
    *,
    sweep_id: str | None = None,
    search_attributes: bool = False,
) -> SweepInput:
    """The workflow input for `spec` (a YAML path, a mapping or a SweepSpec) plus overrides
    (`sweep.KEY=V` for the spec, `KEY=V` for the base run config); SweepSpecError, naming
    every bad field, trial and space value, before anything starts."""
    from ratchet.config.sweep_spec import compile_sweep, load_sweep_spec

    if sweep_id is not None:
        check_id(sweep_id, "sweep id")
    model, spec_dir = load_sweep_spec(spec, overrides)
    compiled = compile_sweep(model, spec_dir)
    sweep_id = sweep_id or check_id(make_sweep_id(model.name), "sweep id made from the spec's name")
    return SweepInput(
        sweep_id=sweep_id,
        spec=model.model_dump(mode="json"),
        base_config=compiled.base.model_dump(mode="json"),
        plan=sweep_plan(model),
        search_attributes=search_attributes,
    )


def start_sweep(client: ClientConnection, spec, overrides: Sequence[str] = (), *, sweep_id: str | None = None) -> "SweepHandle":
    """Start the sweep; `spec` may also be a SweepInput that `prepare_sweep` made (the CLI
    validates before it connects), started as it is."""
    has_attrs = client.has_search_attributes()
    if isinstance(spec, SweepInput):
        inp = replace(spec, search_attributes=has_attrs, sweep_id=check_id(sweep_id, "sweep id") if sweep_id else spec.sweep_id)
    else:
        inp = prepare_sweep(spec, overrides, sweep_id=sweep_id, search_attributes=has_attrs)
    # IdTaken: another sweep's (its trials' folders would be overwritten), before anything starts.
    check_new_sweep_id(client, inp.sweep_id, trial_run_id(inp.sweep_id, 0), inp.base_config["storage"]["root"])
    p = inp.plan
    summary = f"sweep {inp.spec['name']}: {p.trials} trials ({inp.spec['search']}), {p.parallelism} at once, objective {inp.spec['objective']['metric']}"
    client._run(client._temporal.start_workflow(SWEEP_WORKFLOW, inp, id=inp.sweep_id, task_queue=client.task_queue, static_summary=summary))
    return SweepHandle(client, inp.sweep_id)


@dataclass
class SweepHandle(WorkflowHandle):
    client: ClientConnection
    sweep_id: str

    summary_type: ClassVar[type] = SweepSummary
    progress_type: ClassVar[type] = SweepProgress

    @property
    def workflow_id(self) -> str:
        return self.sweep_id

    def follow(self, every: float = 1.0) -> Iterator[SweepProgress]:
        return super().follow(every)

    def pause(self) -> None:
        """Pause every running trial at its next step boundary; start no new ones."""
        self._signal("pause")

    def resume(self) -> None:
        self._signal("resume")

    def cancel(self) -> None:
        """Stop the running trials at their next step boundary and start no more; the sweep
        then completes as cancelled, with the best trial so far."""
        self._signal("cancel")


def sweep_records(sweep_id: str | None = None, *, url: str | None = None):
    """(sweeps, trials of `sweep_id`) from the run registry (RATCHET_REGISTRY_URL or the state folder's)."""
    from ratchet.registry.db import Registry

    with Registry.open(url) as reg:
        if sweep_id is None:
            return reg.sweeps(), []
        return [s for s in [reg.sweep(sweep_id)] if s is not None], reg.trials(sweep_id)


__all__ = ["SweepHandle", "make_sweep_id", "prepare_sweep", "start_sweep", "sweep_plan", "sweep_records"]
