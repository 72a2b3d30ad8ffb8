"""Recurring runs and sweeps through Temporal Schedules: create, list, trigger, delete.

A schedule's action starts `ScheduledLaunchWorkflow` (workflows/launch.py) with a config
validated now, at creation: each time it fires, that workflow starts the run or the sweep
under an id made of the schedule's id and the fire time, and waits for it (so the
schedule's overlap policy, skip, keeps two of them from running at once). The server
keeps the schedule: it survives restarts of the client, the worker and the server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Sequence

from ratchet.ids import check_id
from ratchet.sweep_types import LaunchInput
from ratchet.types import TrainingInput

if TYPE_CHECKING:
    from .client import Client

LAUNCH_WORKFLOW = "ScheduledLaunchWorkflow"
_INTERVAL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class ScheduleError(ValueError):
    """A schedule that cannot be made: the message names the option and the fix."""


def parse_interval(text: str) -> timedelta:
    """'90s', '30m', '6h', '1d' as a timedelta (at least one minute: Temporal's floor is seconds,
    but a training run every few seconds is a mistake)."""
    m = _INTERVAL.match(text or "")
    if not m:
        raise ScheduleError(f"--every {text!r}: expected a number and a unit (s, m, h, d), e.g. 30m or 6h")
    every = timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])
    if every < timedelta(minutes=1):
        raise ScheduleError(f"--every {text!r}: at least 1m between runs")
    return every


@dataclass
class ScheduleRow:
    schedule_id: str
    kind: str
    when: str
    next_run: str
    recent: list[str]
    paused: bool


def launch_input(
    client: "Client", schedule_id: str, *, config: Any = None, sweep: Any = None, overrides: Sequence[str] = ()
) -> LaunchInput:
    """The schedule's action input: a validated run (config) or sweep (sweep spec)."""
    from ratchet.config import load_config

    from .client import loop_plan
    from .sweeps import prepare_sweep

    if (config is None) == (sweep is None):
        raise ScheduleError("give a run config or a sweep spec (--sweep), exactly one")
    has_attrs = client.has_search_attributes()
    if sweep is not None:
        # The sweep id is made at launch; this one only passes validation.
        return LaunchInput(schedule_id, "sweep", sweep=prepare_sweep(sweep, overrides, sweep_id=schedule_id, search_attributes=has_attrs))
    cfg = load_config(config, overrides)
    training = TrainingInput(run_id=schedule_id, config=cfg.model_dump(mode="json"), plan=loop_plan(cfg), search_attributes=has_attrs)
    return LaunchInput(schedule_id, "run", training=training)


def create_schedule(
    client: "Client",
    schedule_id: str,
    *,
    config: Any = None,
    sweep: Any = None,
    overrides: Sequence[str] = (),
    every: str | timedelta | None = None,
    cron: str | None = None,
    paused: bool = False,
) -> str:
    """Create a schedule that starts the run (or sweep) every `every` or on `cron`."""
    from temporalio.client import Schedule, ScheduleActionStartWorkflow, ScheduleIntervalSpec, ScheduleSpec, ScheduleState

    check_id(schedule_id, "schedule id")
    if (every is None) == (cron is None):
        raise ScheduleError("give --every (e.g. 6h) or --cron (e.g. '0 3 * * *'), exactly one")
    interval = parse_interval(every) if isinstance(every, str) else every
    spec = ScheduleSpec(intervals=[ScheduleIntervalSpec(every=interval)]) if interval else ScheduleSpec(cron_expressions=[cron])
    inp = launch_input(client, schedule_id, config=config, sweep=sweep, overrides=overrides)
    what = f"{inp.kind} {schedule_id}"
    action = ScheduleActionStartWorkflow(
        LAUNCH_WORKFLOW, inp, id=f"{schedule_id}.launch", task_queue=client.task_queue, static_summary=f"scheduled {what}"
    )
    schedule = Schedule(action=action, spec=spec, state=ScheduleState(paused=paused, note=f"ratchet schedule: {what}"))
    client._run(client._temporal.create_schedule(schedule_id, schedule))
    return schedule_id


def list_schedules(client: "Client") -> list[ScheduleRow]:
    async def collect():
        rows = []
        async for entry in await client._temporal.list_schedules():
            info = entry.info
            spec = entry.schedule.spec if entry.schedule else None
            when = ""
            if spec is not None:
                when = ", ".join([f"every {i.every}" for i in spec.intervals] + list(spec.cron_expressions))
            kind = entry.schedule.action.workflow if entry.schedule and hasattr(entry.schedule.action, "workflow") else ""
            rows.append(
                ScheduleRow(
                    schedule_id=entry.id,
                    kind="ratchet" if kind == LAUNCH_WORKFLOW else str(kind),
                    when=when,
                    next_run=str(info.next_action_times[0]) if info and info.next_action_times else "",
                    recent=[a.action.workflow_id for a in (info.recent_actions if info else []) if hasattr(a.action, "workflow_id")],
                    paused=bool(entry.schedule.state.paused) if entry.schedule else False,
                )
            )
        return rows

    return client._run(collect())


def trigger_schedule(client: "Client", schedule_id: str) -> None:
    """Fire the schedule's action now (once), whatever its spec says."""
    client._run(client._temporal.get_schedule_handle(check_id(schedule_id, "schedule id")).trigger())


def delete_schedule(client: "Client", schedule_id: str) -> None:
    """Delete the schedule; runs it started carry on."""
    client._run(client._temporal.get_schedule_handle(check_id(schedule_id, "schedule id")).delete())


def launched_runs(client: "Client", schedule_id: str) -> list[str]:
    """Ids of the runs or sweeps the schedule's launches start (newest last); a launch
    that fired a moment ago may not have started its run yet."""
    desc = client._run(client._temporal.get_schedule_handle(check_id(schedule_id, "schedule id")).describe())
    from ratchet.workflows.launch import launched_id

    return [launched_id(a.action.workflow_id) for a in desc.info.recent_actions if hasattr(a.action, "workflow_id")]


__all__ = [
    "ScheduleError",
    "ScheduleRow",
    "create_schedule",
    "delete_schedule",
    "launch_input",
    "launched_runs",
    "list_schedules",
    "parse_interval",
    "trigger_schedule",
]
