"""What `ratchet status` (and `ratchet up`) show: the embedded services with their
addresses and the Temporal UI link, and the training runs in flight as the Temporal
server's visibility store lists them, or one line saying why they cannot be listed.

Plain lines and a table from `tables`, so that no address, link or run id is cut at any
terminal width; `--json` prints the same facts for scripts (`status_json`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .search import WORKFLOW_TYPE, listing
from .services import ServicesStatus
from .tables import fact_column, show, text_column

# The most runs in flight listed; more are counted, not listed.
LIMIT = 100
_QUERY = f"WorkflowType = '{WORKFLOW_TYPE}' AND ExecutionStatus = 'Running'"


@dataclass(frozen=True)
class RunInFlight:
    """One open training workflow (running or paused)."""

    run_id: str
    status: str  # ratchet_status (running, paused) when the namespace has it, else "running"
    step: int | None  # steps done (ratchet_step); None without ratchet's search attributes
    steps: int | None  # loop.steps, from the memo `submit` writes; None for a resumed run
    since: datetime | None  # when its (latest) workflow execution started


async def _list(temporal, limit: int) -> tuple[list[RunInFlight], int]:
    runs = []
    async for w in temporal.list_workflows(_QUERY, limit=limit):
        found = listing(w)
        try:
            steps = await w.memo_value("steps", None)
        except Exception:  # noqa: BLE001 - a memo not sealed with our key (an older server's run, a stranger's): no count
            steps = None
        runs.append(
            RunInFlight(found.run_id, found.status or "running", found.step, steps if isinstance(steps, int) else None, found.start_time)
        )
    total = len(runs)
    if total == limit:  # there may be more: count them (one cheap call)
        total = (await temporal.count_workflows(_QUERY)).count
    return runs, total


def runs_in_flight(
    address: str, limit: int = LIMIT, fix: str = "start it with `ratchet up`", payload_key_file=None
) -> tuple[list[RunInFlight] | None, int, str | None]:
    """(runs, how many there are, None), or (None, 0, why not) when the Temporal server at
    `address` cannot be reached or asked: a line for the user, ending with `fix`.
    `payload_key_file`: the services' payload key (default: the environment's)."""
    from .client import Client

    try:
        client = Client.connect(address, payload_key_file=payload_key_file)
    except RuntimeError as exc:  # the SDK's "Failed client connect: ..." with the transport's details
        text = str(exc).lower()
        reason = "connection refused" if "refused" in text else "timed out" if "timed out" in text or "deadline" in text else _short(exc)
        return None, 0, f"Temporal does not answer at {address} ({reason}): {fix}"
    try:
        runs, total = client._run(_list(client._temporal, limit))
    except Exception as exc:  # noqa: BLE001 - the listing is an extra; its failure is reported, not raised
        return None, 0, f"the Temporal server at {address} did not list the runs: {_short(exc)}"
    return runs, total, None


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _ago(since: datetime | None, now: datetime) -> str:
    if since is None:
        return "-"
    s = max(0, int((now - since).total_seconds()))
    span = (
        f"{s} s" if s < 60 else f"{s // 60} min" if s < 3600 else f"{s // 3600} h {s % 3600 // 60} min" if s < 86400 else f"{s // 86400} d"
    )
    return f"{since.astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC ({span} ago)"


def runs_table(runs: list[RunInFlight], total: int, now: datetime | None = None) -> Table:
    now = now or datetime.now(timezone.utc)
    table = Table(title=f"runs in flight: {total}" + (f" (the newest {len(runs)} listed)" if total > len(runs) else ""))
    fact_column(table, "run id")
    text_column(table, "status")
    text_column(table, "step", justify="right")
    text_column(table, "since")
    for r in runs:
        step = "-" if r.step is None else str(r.step)
        table.add_row(r.run_id, r.status, step if r.steps is None else f"{step}/{r.steps}", _ago(r.since, now))
    return table


def _service_line(name: str, running: bool, address: str, note: str = "") -> Text:
    state = Text("running    ", style="green") if running else Text("not running", style="red")
    return Text.assemble(f"  {name:<13}", state, f"  {address}", (f"  {note}" if note else "", "dim"))


def print_services(console: Console, st: ServicesStatus, started: list[str] | None = None) -> None:
    """The services with their addresses, the Temporal UI link and the object store."""
    console.print(Text.assemble(("services", "bold"), f" (state folder {st.state_dir}, namespace {st.namespace})"), soft_wrap=True)
    fix = "start it with `ratchet up`"
    lines = [
        _service_line("temporal", st.temporal.running, st.temporal_address, _note(st.temporal, fix)),
        _service_line("Temporal UI", st.temporal.running, st.temporal_ui_url),
        *(
            [_service_line("codec server", st.codec_server.running, st.codec_server.address, st.codec_server.detail)]
            if st.codec_server
            else []
        ),
        _service_line("ray", st.ray.running, st.ray_address, _note(st.ray, fix, f"{st.ray_auth_mode} auth" if st.ray_auth_mode else "")),
        *[_service_line(n.name, n.running, n.address, _note(n, "`ratchet up` starts it again")) for n in st.nodes],
    ]
    if st.mlflow_ui is not None and st.mlflow_ui_url:
        lines.append(_service_line("MLflow UI", st.mlflow_ui.running, st.mlflow_ui_url, _note(st.mlflow_ui, fix)))
    lines.append(Text.assemble(f"  {'object store':<13}", f"{'':11}  {st.object_store_root}"))
    for line in lines:
        console.print(line, soft_wrap=True, highlight=False)
    if started is not None:
        console.print(f"started now: {', '.join(started)}" if started else "already running: nothing started", highlight=False)


def _note(state, fix: str, extra: str = "") -> str:
    parts = [f"pid {state.pid}"] if state.pid else []
    parts += [p for p in (state.detail, extra) if p]
    if not state.running:
        parts.append(fix)
    return ", ".join(parts)


def print_runs(console: Console, runs: list[RunInFlight] | None, total: int, why: str | None) -> None:
    if runs is None:
        console.print(Text.assemble(("runs in flight: unknown", "bold"), f": {why}"), soft_wrap=True, highlight=False)
    elif not runs:
        console.print(Text.assemble(("runs in flight: none", "bold"), " (`ratchet runs` lists the runs that have ended)"), highlight=False)
    else:
        show(console, runs_table(runs, total))


def status_json(st: ServicesStatus, runs: list[RunInFlight] | None, total: int, why: str | None) -> str:
    """The services (as `ServicesStatus.to_dict`, less `started`, which only `up` fills)
    and `runs_in_flight`: a list, or null with `runs_unknown` saying why."""
    data = st.to_dict()
    data.pop("started", None)
    data["runs_in_flight"] = None if runs is None else [asdict(r) for r in runs]
    data["runs_in_flight_total"] = None if runs is None else total
    if why:
        data["runs_unknown"] = why
    return json.dumps(data, default=str)


__all__ = ["LIMIT", "RunInFlight", "print_runs", "print_services", "runs_in_flight", "runs_table", "status_json"]
