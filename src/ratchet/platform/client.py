"""The Python client: submit a run, watch it, wait for its result.

    client = ratchet.Client.connect()
    handle = client.submit("examples/copy_grpo.yaml", overrides=["trainer.lr=3e-4"])
    print(handle.progress())
    summary = handle.result()

The config is validated here, before any workflow starts, so a typo costs a second and
not a failed run. The client is synchronous; it drives the async Temporal SDK on an event
loop of its own.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

from ratchet.ids import check_id
from ratchet.config.loop_plan import loop_plan
from ratchet.types import TASK_QUEUE, BatchStatus, LiveChange, Progress, RunState, RunSummary, TrainingInput
from .handles import WorkflowHandle, command_for  # noqa: F401 - command_for: re-exported for senders
from .stored_runs import make_run_id, read_run_state, stored_config_with  # noqa: F401 - read_run_state: re-exported
from .taken_ids import check_new_run_id

if TYPE_CHECKING:
    from .pipelines import PipelineHandle

WORKFLOW = "TrainingWorkflow"
# The demo recipe, in a source checkout.
RECIPE_PATH = Path(__file__).resolve().parents[3] / "examples" / "copy_grpo.yaml"


class RunIsLive(RuntimeError):
    """A resume from a checkpoint asked of a run whose workflow is still open."""


class NothingToResume(ValueError):
    """A resume from a checkpoint that would train no step: the run already reached
    loop.steps. Refused before any worker is built; the message names how to train further."""


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a resume from a checkpoint continues from."""

    checkpoint: str  # step-00000029
    step: int  # the run state's next step
    policy_version: int


class LiveChangeRefused(ValueError):
    """The run refused a live change (`RunHandle.set`): a key that cannot change live, a
    value its config field refuses, or a run that is not training any more."""


def _retire_unless_rewritten(checkpoints, old) -> None:
    """Retire checkpoint `old` if its manifest is still the one listed before the resume."""
    try:
        if checkpoints.get(old.name) != old:
            return  # the resumed run wrote it again already: it is the new continuation's
    except FileNotFoundError:
        return
    checkpoints.retire(old.name)


@dataclass
class RunHandle(WorkflowHandle):
    client: "Client"
    run_id: str
    # Set by Client.resume from a checkpoint: which one it chose (`ratchet resume` prints it).
    resumed_from: ResumePoint | None = None

    summary_type: ClassVar[type] = RunSummary
    progress_type: ClassVar[type] = Progress

    @property
    def workflow_id(self) -> str:
        return self.run_id

    def pause(self) -> None:
        """Pause at the next step boundary (in-flight work finishes first)."""
        self._signal("pause")

    def resume(self) -> None:
        self._signal("resume")

    def stop(self) -> None:
        """End the run at the next step boundary; it exports the policy and completes."""
        self._signal("stop")

    def drain(self, node_id: str) -> None:
        """Ray node `node_id` is about to go: the run checkpoints at its next step boundary
        and moves its actors off it (`ratchet drain NODE` finds the runs and sends this)."""
        self.client._run(self._handle().signal("drain", node_id))

    def set(self, changes: Sequence[str] | Mapping[str, Any] = (), /, **values: Any) -> LiveChange:
        """Change hyper-parameters from the run's next step boundary:
        `handle.set(["trainer.lr=1e-5"])` or `handle.set(**{"trainer.lr": 1e-5})`. The keys
        that may change, and why, are in `ratchet.config.live_keys.LIVE`; values are checked
        against the config's fields by the run itself (a Temporal update with a validator),
        so a refused change never enters its history. Returns the values set, the ones they
        replace and the step they apply from; LiveChangeRefused says why a change was refused."""
        from temporalio.client import WorkflowUpdateFailedError
        from temporalio.service import RPCError

        from ratchet.config import ConfigError
        from ratchet.config.live_keys import parse_assignments, refused_keys

        asked = {**parse_assignments(changes), **values}
        refused = refused_keys(list(asked))
        if refused:
            raise ConfigError(refused)
        try:
            return self.client._run(self._handle().execute_update("set_params", asked, result_type=LiveChange))
        except WorkflowUpdateFailedError as exc:
            cause = exc.cause
            raise LiveChangeRefused(f"run {self.run_id}: {getattr(cause, 'message', None) or cause or exc}") from None
        except RPCError as exc:
            raise LiveChangeRefused(f"run {self.run_id} is not running, so nothing can change live ({exc})") from None

    def batches(self) -> list[BatchStatus]:
        """Batches in flight and ready, with the policy version of each."""
        return self.client._run(self._handle().query("batches", result_type=list[BatchStatus]))

    def running(self) -> bool:
        """Whether the run's workflow is open (running or paused)."""
        from temporalio.client import WorkflowExecutionStatus
        from temporalio.service import RPCError

        try:
            desc = self.client._run(self._handle().describe())
        except RPCError:
            return False  # never started here
        return desc.status == WorkflowExecutionStatus.RUNNING

    def cancel(self) -> None:
        self.client._run(self._handle().cancel())

    def history(self):
        """The run's Temporal event history (one workflow run)."""
        return self.client._run(self._handle().fetch_history())


class Client:
    def __init__(self, temporal_client, loop: asyncio.AbstractEventLoop, task_queue: str):
        self._temporal = temporal_client
        self._loop = loop
        self.task_queue = task_queue
        self._has_search_attributes = False  # the namespace has ratchet's (checked until it has)

    @classmethod
    def connect(
        cls,
        address: str | None = None,
        *,
        namespace: str | None = None,
        task_queue: str = TASK_QUEUE,
        payload_key_file: str | Path | None = None,
    ) -> "Client":
        """Connect to the Temporal frontend at `address` (default $RATCHET_TEMPORAL_ADDRESS or
        the embedded server's). The namespace (default $RATCHET_TEMPORAL_NAMESPACE, else
        `default`), TLS and an API key come from the environment (`temporal_connection`).
        Every payload is sealed with the workers' key (`payload_codec`): `payload_key_file`,
        else $RATCHET_PAYLOAD_KEY_FILE, else `<state folder>/payload.key`."""
        from temporalio.client import Client as TemporalClient

        from .payload_codec import data_converter
        from .temporal_connection import connect_options
        from .temporal_exit import guard_interpreter_exit
        from .worker import default_temporal_address

        address = address or default_temporal_address()
        options = connect_options(namespace)  # before the loop: a bad variable names itself
        options["data_converter"] = data_converter(payload_key_file)  # a bad key file names itself too
        guard_interpreter_exit()  # the SDK's threads can crash an exit that does not wait for them
        loop = asyncio.new_event_loop()
        temporal = loop.run_until_complete(TemporalClient.connect(address, **options))
        return cls(temporal, loop, task_queue)

    @classmethod
    def of_services(cls, settings) -> "Client":
        """A client of the services `settings` started (`services.up`): their Temporal
        address, and the payload key their workers hold ($RATCHET_PAYLOAD_KEY_FILE, else
        the key in *their* state folder; `connect` would take the default folder's)."""
        from .payload_key import key_file_path
        from .services import temporal_address

        return cls.connect(temporal_address(settings), payload_key_file=key_file_path(settings.state_dir))

    def _run(self, coro):
        return self._loop.run_until_complete(coro)

    def workflow_status(self, workflow_id: str) -> str | None:
        """The status of the workflow with that id ("running", "completed", "terminated", ...),
        or None when Temporal knows none."""
        from temporalio.service import RPCError, RPCStatusCode

        try:
            desc = self._run(self._temporal.get_workflow_handle(workflow_id).describe())
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return None
            raise
        return desc.status.name.lower() if desc.status is not None else "known"

    def submit(self, config: Any, overrides: Sequence[str] = (), *, run_id: str | None = None) -> RunHandle | PipelineHandle:
        """Validate `config` (a RunConfig, a dict, or a YAML path) and start the run."""
        from ratchet.config import RunConfig, load_config

        if run_id is not None:
            check_id(run_id)  # before the config is read, or anything stored or started
        if isinstance(config, (str, Path)):
            cfg = load_config(config, overrides)
        else:
            data = config.model_dump(mode="json") if isinstance(config, RunConfig) else dict(config)
            cfg = load_config(None, overrides, base=data)
        run_id = run_id or check_id(make_run_id(cfg.tracking.name), "run id made from tracking.name")
        check_new_run_id(self, run_id, cfg.storage.root)  # IdTaken: another run's, before anything is written
        if cfg.stages:  # a pipeline of stages (src/ratchet/platform/pipelines.py): a PipelineHandle
            from .pipelines import start_pipeline

            return start_pipeline(self, cfg, run_id)
        inp = TrainingInput(run_id=run_id, config=cfg.model_dump(mode="json"), plan=loop_plan(cfg))
        self._start_run(inp, memo={"tags": cfg.tracking.tags, "model": cfg.model.path, "steps": cfg.loop.steps})
        return RunHandle(self, run_id)

    def has_search_attributes(self) -> bool:
        """Whether the namespace has ratchet's search attributes (asked until it has: a
        cluster may get them while this client lives)."""
        from .search import attributes_available

        if not self._has_search_attributes:
            self._has_search_attributes = self._run(attributes_available(self._temporal))
        return self._has_search_attributes

    def _start_run(self, inp: TrainingInput, **options: Any) -> None:
        """Start a training workflow as the Temporal UI shows it: a one-line summary and the
        config in short as its details, and, when the namespace has ratchet's search
        attributes, those set at start and the workflow told to upsert them as it goes
        (`inp.search_attributes`). Without them the run starts plain: a server not set up
        (docs/temporal_ui.md) must not stop a run. `options` go to `start_workflow`."""
        from ratchet.workflows import search_attributes as sa

        from .search import previous_lineage

        lineage = inp.lineage
        if inp.resume is not None and lineage == type(lineage)():
            lineage = self._run(previous_lineage(self._temporal, inp.run_id)) or lineage  # a resumed trial or fork
        inp.search_attributes = self.has_search_attributes()
        if inp.search_attributes:
            step = inp.resume.next_step if inp.resume is not None else 0
            options.setdefault("search_attributes", sa.resumed_attributes(inp.config, lineage, step))
        self._run(
            self._temporal.start_workflow(
                WORKFLOW,
                inp,
                id=inp.run_id,
                task_queue=self.task_queue,
                static_summary=sa.static_summary(inp.run_id, inp.config, lineage),
                static_details=sa.static_details(inp.run_id, inp.config, lineage),
                **options,
            )  # fmt: skip
        )

    def resume(self, run_id: str, overrides: Sequence[str] = (), *, root: str | None = None, checkpoint: str | None = None) -> RunHandle:
        """Continue a stopped or failed run from a checkpoint (the latest good one unless
        named), with its stored config plus `overrides` (say `trainer.world_size=2`; only
        the keys in `ratchet.config.resume_keys` may change). The run keeps its id and
        folder; the steps after the checkpoint are done again, and checkpoints newer than
        it are retired (`RETIRED.json`, see CheckpointStore.retire) once the resumed run
        has started. A run that is still open (running or paused) is refused: RunIsLive."""
        from ratchet.storage.checkpoint_store import CheckpointStore
        from ratchet.storage.layout import RunLayout

        check_id(run_id)
        if checkpoint is not None:
            check_id(checkpoint, "checkpoint name")
        if self.get(run_id).running():
            raise RunIsLive(
                f"run {run_id!r} is running (or paused): a paused run continues with `ratchet resume {run_id}` and no "
                f"overrides (RunHandle.resume()); to resume it from a checkpoint, stop it first (`ratchet stop {run_id}`) "
                "and wait until it has ended"
            )
        run_store, stored, cfg, changed = stored_config_with(run_id, root, overrides)
        checkpoints = CheckpointStore(run_store)
        info = checkpoints.get(checkpoint) if checkpoint else checkpoints.latest()
        if info is None:
            raise FileNotFoundError(f"run {run_id!r} has no valid checkpoint to resume from (checkpoint.every was 0?)")
        if not checkpoints.verify(info.name):
            raise ValueError(f"checkpoint {info.name!r} of run {run_id!r} is corrupted; pick another (ratchet checkpoints {run_id})")
        state = read_run_state(checkpoints.read_files(info.name, [RunLayout.RUN_STATE])[RunLayout.RUN_STATE])  # where its manifest says
        self._check_something_to_train(run_id, info.name, state, cfg.loop.steps, named=checkpoint is not None)
        if "algorithm.kl.coef" in changed:
            state.kl_coef = cfg.algorithm.kl.coef  # the saved (possibly adapted) one would override it
        state.live.values = {k: v for k, v in state.live.values.items() if k not in changed}  # the override wins
        newer = [c for c in checkpoints.list() if c.step is not None and info.step is not None and c.step > info.step]
        inp = TrainingInput(
            run_id=run_id, config=cfg.model_dump(mode="json"), plan=loop_plan(cfg), resume=state, restore=True,
            restore_from=info.name,
        )  # fmt: skip
        self._start_run(inp)
        # Newer checkpoints belong to the continuation being abandoned: recovery in the
        # resumed run must not restore one of them. Retired (not deleted), and only now that
        # the resumed run exists: a refused start leaves the run's checkpoints as they were.
        # One the resumed run has meanwhile written again under the same name is its own.
        for old in newer:
            _retire_unless_rewritten(checkpoints, old)
        return RunHandle(self, run_id, resumed_from=ResumePoint(info.name, state.next_step, state.policy_version))

    def _check_something_to_train(self, run_id: str, name: str, state: RunState, steps: int, *, named: bool) -> None:
        """NothingToResume when the resume would rebuild the workers only to train no step:
        the run completed all its loop.steps (and no override raised it), or the checkpoint
        is already at loop.steps. A run that completed with its last step after its latest
        checkpoint counts as completed too, unless a checkpoint was named."""
        done = None if named else self._completed_steps(run_id)
        if done is not None and done >= steps:
            raise NothingToResume(
                f"run {run_id} already completed all {done} steps: nothing to resume; train further with "
                f"`ratchet fork {run_id} --checkpoint {name} loop.steps={2 * done}`"
            )
        if state.next_step >= steps:
            again = f" --checkpoint {name}" if named else ""
            raise NothingToResume(
                f"checkpoint {name} of run {run_id} is at step {state.next_step} and loop.steps is {steps}: nothing to "
                f"resume; train further with `ratchet resume {run_id}{again} loop.steps={2 * state.next_step}`"
            )

    def _completed_steps(self, run_id: str) -> int | None:
        """The steps of the run's workflow if it completed all of them (not stopped early,
        not failed or cancelled), else None (also when Temporal no longer knows it)."""
        from temporalio.client import WorkflowExecutionStatus
        from temporalio.service import RPCError

        handle = self.get(run_id)._handle()
        try:
            if self._run(handle.describe()).status != WorkflowExecutionStatus.COMPLETED:
                return None
            summary = self._run(handle.result())
        except RPCError:
            return None
        return None if summary.stopped else summary.steps

    def fork(
        self, run_id: str, checkpoint: str, overrides: Sequence[str] = (), *, root: str | None = None, new_run_id: str | None = None
    ) -> RunHandle:
        """A new run that starts from checkpoint `checkpoint` (`step-20`) of run `run_id`,
        with `overrides` (the keys a resume may change: ratchet.config.resume_keys), linked
        to its parent (TrainingInput.lineage). The parent's folder is only read; see
        src/ratchet/platform/fork.py."""
        from .fork import prepare_fork

        child = prepare_fork(self, run_id, checkpoint, overrides, root=root, new_run_id=new_run_id)
        self._start_run(child.inp, memo=child.memo)  # its summary, details and search attributes (ratchet_parent)
        return RunHandle(self, child.inp.run_id)

    def find(self, where: str, *, limit: int = 200):
        """Runs by their search attributes: `client.find("ratchet_reward > 0.3")` ->
        list[RunListing], newest first; InvalidQuery names the attributes there are
        (src/ratchet/platform/search.py)."""
        from .search import find_runs

        return self._run(find_runs(self._temporal, where, limit=limit))

    def get(self, run_id: str) -> RunHandle:
        return RunHandle(self, check_id(run_id))

    def sweep(self, spec: Any, overrides: Sequence[str] = (), *, sweep_id: str | None = None):
        """Validate a sweep spec (a YAML path, a mapping or a SweepSpec; `sweep.KEY=V`
        overrides set spec keys, others the base run config) and every trial config known
        up front, then start the sweep; a SweepHandle (progress, result, pause, resume,
        cancel). src/ratchet/platform/sweeps.py."""
        from .sweeps import start_sweep

        return start_sweep(self, spec, overrides, sweep_id=sweep_id)

    def get_sweep(self, sweep_id: str):
        from .sweeps import SweepHandle

        return SweepHandle(self, check_id(sweep_id, "sweep id"))

    def close(self) -> None:
        self._loop.close()
