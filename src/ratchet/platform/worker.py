"""`ratchet worker`: a Temporal worker process that runs ratchet's workflows and activities.

It is also a Ray driver: activities reach the run's actors through the Ray cluster at
`ray_address`. SIGTERM and SIGINT shut it down gracefully (running activities finish,
the workflow task is handed back), which avoids the sticky-queue stall that a killed
worker causes.

What it says, and when it gives up (one line each, on the `ratchet.platform.worker.status`
logger, which `ratchet worker` prints plainly):

- At start-up it checks that the Temporal frontend and the Ray head's GCS accept
  connections, before joining either. One that does not is named with the command that
  starts it, and the worker exits 1 at once (`ServiceUnreachable`): a user who forgot
  `ratchet up` learns it in a second, and a supervisor (systemd, Kubernetes, compose)
  restarts it as it restarts any failed process. `--wait-s` / RATCHET_WORKER_WAIT_S
  makes it wait that long for them first, for a supervisor that starts the worker
  together with the services.
- Once serving it prints `worker ready: ...`.
- When the Temporal server goes away (`ratchet down`, a restart), it says so once and
  retries quietly (the SDK's per-second gRPC retry warnings are held back meanwhile); a
  server back within RATCHET_WORKER_LOST_SERVER_S (default 120 s, `inf`: forever) is
  said once too and the worker carries on, which covers a server restart. Past that the
  worker says so and exits 1: after `ratchet down` no worker lingers in a terminal, and
  under a supervisor it is restarted and checks the services as at start-up.
- The Ray head is watched the same way, with a grace 5 s shorter than Ray's own (a
  driver whose GCS is gone 60 s is ended by Ray, with a C++ log line): the worker's line
  is the last one, and its exit code 1.

Why one module of ~440 lines: one job, the worker process's life (its start-up checks,
the Temporal worker, the watchdogs of the server and the Ray head, its exit), whose
parts share the settings and the order they run in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

from ratchet.private_paths import PRIVATE_UMASK
from ratchet.types import TASK_QUEUE
from ratchet.start_up_gc import start_up

from .reachability import ServiceUnreachable, check_services, host_port, tcp_unreachable_reason, temporal_unreachable_reason
from .services import ServiceSettings, ray_address, ray_auth_env, temporal_address
from .services.ray_auth import record_applied
from .temporal_connection import connect_options, namespace_from_env
from .temporal_connection import from_env as temporal_from_env

log = logging.getLogger(__name__)
# The few lines a user of `ratchet worker` reads (ready, server lost, back, giving up):
# the CLI prints this logger plainly, a log file gets them with the rest.
status_log = logging.getLogger(f"{__name__}.status")


def default_temporal_address() -> str:
    """$RATCHET_TEMPORAL_ADDRESS, else the embedded server's address (`ratchet up`'s settings)."""
    return os.environ.get("RATCHET_TEMPORAL_ADDRESS") or temporal_address(ServiceSettings.from_env())


@dataclass
class WorkerSettings:
    temporal_address: str = "127.0.0.1:7233"
    namespace: str = "default"
    ray_address: str = "127.0.0.1:6380"
    task_queue: str = TASK_QUEUE
    max_concurrent_activities: int = 16
    # How long a workflow waits for this (possibly dead) worker before another may take
    # its next task. Temporal's default of 10 s is long for a stalled training step.
    sticky_schedule_to_start_seconds: float = 10.0
    # RAY_AUTH_MODE and RAY_AUTH_TOKEN_PATH of the Ray head (`services.ray_auth_env`):
    # a path, not the token; kept out of the repr all the same.
    ray_auth_env: dict[str, str] = field(default_factory=dict, repr=False)
    # How Temporal names this worker (a pending activity's `last_worker_identity`); None:
    # the SDK's `pid@host`. A node of `ratchet up --nodes` sets `node-<i>/<pid>`.
    identity: str | None = None
    # How often the actors of closed runs are swept (besides at start-up); 0: only then.
    sweep_every_seconds: float = 300.0
    # At start-up: how long to wait for an unreachable Temporal server or Ray head before
    # exiting 1 (0: exit at once, naming it). For a supervisor that starts all at once.
    wait_s: float = 0.0
    # Once serving: how long a lost Temporal server may stay away (retried quietly) before
    # the worker exits 1; inf: forever. Long enough for a server restart.
    lost_server_s: float = 120.0
    # The Temporal payload key (payload_codec); None: $RATCHET_PAYLOAD_KEY_FILE, else
    # `<state folder>/payload.key`.
    payload_key_file: str | None = None

    @classmethod
    def from_env(cls) -> "WorkerSettings":
        from .payload_key import key_file_path

        env = os.environ
        return cls(
            temporal_address=default_temporal_address(),
            namespace=namespace_from_env(env),  # RATCHET_TEMPORAL_NAMESPACE or RATCHET_NAMESPACE
            ray_address=env.get("RATCHET_RAY_ADDRESS") or ray_address(ServiceSettings.from_env()),
            task_queue=env.get("RATCHET_TASK_QUEUE", TASK_QUEUE),
            sticky_schedule_to_start_seconds=float(env.get("RATCHET_STICKY_TIMEOUT_S", "10")),
            ray_auth_env=ray_auth_env(ServiceSettings.from_env()),
            identity=env.get("RATCHET_WORKER_IDENTITY") or None,
            sweep_every_seconds=float(env.get("RATCHET_SWEEP_EVERY_S", "300")),
            wait_s=float(env.get("RATCHET_WORKER_WAIT_S", "0")),
            lost_server_s=float(env.get("RATCHET_WORKER_LOST_SERVER_S", "120")),
            payload_key_file=str(key_file_path(env=env)),
        )


def _apply_ray_auth(auth_env: dict[str, str]) -> None:
    """Put the head's RAY_AUTH_* variables into this process's environment. Ray reads
    them once, when it is imported: refresh its config and token cache if it already was."""
    changed = {k: v for k, v in auth_env.items() if os.environ.get(k) != v}
    if not changed:
        return
    os.environ.update(changed)
    record_applied(os.environ, changed)
    if "ray" in sys.modules:
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # Ray's private API

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def connect_ray(address: str, auth_env: dict[str, str] | None = None) -> None:
    """Join the Ray head at `address` as a driver, with its token (`auth_env`, from
    `services.ray_auth_env`; the environment's own RAY_AUTH_* when None)."""
    if auth_env:
        _apply_ray_auth(auth_env)
    import ray

    if not ray.is_initialized():
        _quiet_head_shutdown()
        ray.init(address=address, namespace="ratchet", log_to_driver=False, configure_logging=False)


def _quiet_head_shutdown() -> None:
    """When the Ray head is stopped (`ratchet down`), its autoscaler pushes "The autoscaler
    failed ... Terminated with signal 15" and a traceback to every driver, which Ray prints
    on the driver's terminal: for a worker that is an ordinary stop, logged here in one
    line. Every other error Ray pushes is printed as before. (Ray's driver prints these
    from `ray._private.worker.print_to_stdstream`; without it, nothing changes.)"""
    try:
        import ray._private.worker as ray_worker
    except ImportError:  # pragma: no cover
        return
    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "ratchet_quiet", False):
        return

    def print_to_stdstream(data, ignore_prefix):
        text = "\n".join(data.get("lines") or ())
        if "The autoscaler failed" in text and "Terminated with signal" in text:
            log.info("the Ray head's autoscaler was stopped (the Ray head is stopping)")
            return
        original(data, ignore_prefix)

    print_to_stdstream.ratchet_quiet = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = print_to_stdstream


def build_worker(client, settings: WorkerSettings, executor: ThreadPoolExecutor):
    from temporalio.worker import Worker

    from ratchet.activities.nodes import NODE_ACTIVITIES
    from ratchet.activities.sweep_trials import SWEEP_ACTIVITIES
    from ratchet.activities.training import ALL_ACTIVITIES
    from ratchet.activities.supervised import SUPERVISED_ACTIVITIES
    from ratchet.workflows.launch import ScheduledLaunchWorkflow
    from ratchet.workflows.pipeline import PipelineWorkflow, SupervisedStageWorkflow
    from ratchet.workflows.sweep import SweepWorkflow
    from ratchet.workflows.training import TrainingWorkflow

    return Worker(
        client,
        task_queue=settings.task_queue,
        workflows=[TrainingWorkflow, SweepWorkflow, ScheduledLaunchWorkflow, PipelineWorkflow, SupervisedStageWorkflow],
        activities=[*ALL_ACTIVITIES, *SWEEP_ACTIVITIES, *NODE_ACTIVITIES, *SUPERVISED_ACTIVITIES],
        activity_executor=executor,
        max_concurrent_activities=settings.max_concurrent_activities,
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=settings.sticky_schedule_to_start_seconds),
        graceful_shutdown_timeout=timedelta(seconds=10),
        **({"identity": settings.identity} if settings.identity else {}),
    )


class _QuietRetries(logging.Filter):
    """Holds back the SDK core's gRPC retry warnings (one a second per poller while the
    server is away) while the watchdog has said the server is lost; otherwise lets one
    through a minute, so that a failure the TCP probe cannot see still shows."""

    def __init__(self, every_s: float = 60.0):
        super().__init__()
        self.server_lost = False
        self.every_s = every_s
        self._last = float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        if "retry" not in record.name and "retried" not in record.getMessage():
            return True
        if self.server_lost:
            return False
        now = time.monotonic()
        if now - self._last < self.every_s:
            return False
        self._last = now
        return True


def _quiet_runtime(retries: _QuietRetries):
    """A Temporal runtime whose core logs go through Python logging (the default writes
    them straight to stderr, where nothing can hold back the retry warnings)."""
    from temporalio.runtime import LogForwardingConfig, LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter

    core_log = logging.getLogger("temporalio.core")
    core_log.addFilter(retries)
    return Runtime(
        telemetry=TelemetryConfig(
            logging=LoggingConfig(
                filter=TelemetryFilter(core_level="WARN", other_level="ERROR"), forwarding=LogForwardingConfig(logger=core_log)
            )
        )
    )


async def _connect_temporal(client_cls, settings: WorkerSettings, timeout_s: float = 120.0, runtime=None):
    """Connect, waiting out a Temporal server that is restarting (its port open, its
    namespace not served yet): a worker that a supervisor starts in that moment would
    otherwise exit and leave its runs without a worker. Said once, not per attempt."""
    from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

    # TLS and API key from the environment, checked before the first attempt: a bad setting
    # is a ValueError naming the variable, never retried as an unreachable server.
    from .payload_codec import data_converter

    options = connect_options(settings.namespace)
    # The payload key (payload_codec): a start or signal sealed without it is refused.
    options["data_converter"] = data_converter(settings.payload_key_file)
    if runtime is not None:
        options["runtime"] = runtime
    said: list[bool] = []  # one entry once the wait was logged

    def before_sleep(state) -> None:
        if not said:
            status_log.warning("Temporal at %s does not answer yet; retrying for up to %g s", settings.temporal_address, timeout_s)
            said.append(True)

    try:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(RuntimeError),
            stop=stop_after_delay(timeout_s),
            wait=wait_exponential(multiplier=0.5, max=5.0),
            reraise=True,
            before_sleep=before_sleep,
        ):
            with attempt:
                return await client_cls.connect(settings.temporal_address, **options)
    except RuntimeError as exc:
        if isinstance(exc, ServiceUnreachable):
            raise
        raise ServiceUnreachable.temporal(settings.temporal_address, temporal_unreachable_reason(str(exc))) from exc


async def _sweep_leftover_actors(client) -> None:
    """Release the actors of runs that closed without releasing them (a run terminated
    from outside, a worker that died with its run); a failed sweep never stops the worker."""
    from ratchet.activities.sweep import sweep_closed_runs

    try:
        released = await sweep_closed_runs(client)
    except Exception:  # noqa: BLE001 - the worker is needed more than the sweep
        log.warning("sweeping the actors of closed runs failed", exc_info=True)
        return
    if released:
        log.info("released the actors of closed runs: %s", ", ".join(sorted(released)))


async def serve(settings: WorkerSettings, stop: asyncio.Event | None = None) -> int:
    """Run until `stop` is set or the process gets SIGTERM/SIGINT (0), or the Temporal
    server stays unreachable longer than `settings.lost_server_s` (1). ServiceUnreachable
    at start-up when the server or the Ray head accepts no connection."""
    from temporalio.client import Client

    # A bad TLS or API-key variable fails here, before Ray is joined; the line never holds the key.
    log.info("Temporal at %s: %s", settings.temporal_address, temporal_from_env(namespace=settings.namespace).describe())
    from .payload_codec import data_converter

    # The payload key, read (or created) before anything is joined: a bad key file fails here, named.
    log.info("Temporal payloads sealed with %s", data_converter(settings.payload_key_file).payload_codec.key.describe())
    # Before joining Ray: ray.init on an address with no GCS retries with a warning a second.
    await asyncio.get_running_loop().run_in_executor(None, check_services, settings.temporal_address, settings.ray_address, settings.wait_s)
    retries = _QuietRetries()
    with start_up():  # Ray, the activities and the workflows imported: src/ratchet/start_up_gc.py
        connect_ray(settings.ray_address, settings.ray_auth_env)
        client = await _connect_temporal(Client, settings, runtime=_quiet_runtime(retries))
        await _sweep_leftover_actors(client)
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        executor = ThreadPoolExecutor(max_workers=settings.max_concurrent_activities, thread_name_prefix="activity")
        worker = build_worker(client, settings, executor)
    log.info(
        "worker on %s (queue %s), Ray at %s, pid %d", settings.temporal_address, settings.task_queue, settings.ray_address, os.getpid()
    )
    running = asyncio.ensure_future(worker.run())
    namespace = "" if settings.namespace == "default" else f" (namespace {settings.namespace})"
    status_log.info(
        "worker ready: task queue '%s' on %s%s, Ray %s (Ctrl-C stops it)",
        settings.task_queue, settings.temporal_address, namespace, settings.ray_address,
    )  # fmt: skip
    sweeping = asyncio.ensure_future(_sweep_every(client, settings.sweep_every_seconds, stop))
    watching = asyncio.ensure_future(_watch_server(settings, retries, stop))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({running, stopping}, return_when=asyncio.FIRST_COMPLETED)
    sweeping.cancel()
    if watching.done() and watching.result():
        # The server is gone: a graceful shutdown would wait on calls to it, and the
        # activity threads on heartbeats to it. The caller leaves the process without
        # waiting either (run_worker: os._exit).
        executor.shutdown(wait=False, cancel_futures=True)
        return 1
    watching.cancel()
    try:
        if running.done():  # the SDK's worker failed: its error, as `async with worker` raised it
            stopping.cancel()
            running.result()
        log.info("shutting down")
        await worker.shutdown()
        await running
    finally:
        executor.shutdown(wait=True)
    return 0


def _ray_grace_s(lost_server_s: float) -> float:
    """How long a lost Ray head is waited for: a few seconds less than Ray gives a driver
    before it ends the process itself (gcs_rpc_server_reconnect_timeout_s, 60 s), so that
    the worker's own line is the last one, and never longer than a lost Temporal server."""
    try:  # Ray reads its system config from RAY_<name> variables
        limit = float(os.environ.get("RAY_gcs_rpc_server_reconnect_timeout_s", "60"))
    except ValueError:
        limit = 60.0
    return min(lost_server_s, max(limit - 5.0, 1.0))


async def _watch_server(
    settings: WorkerSettings, retries: _QuietRetries, stop: asyncio.Event, every_s: float = 2.0, ray_grace_s: float | None = None
) -> bool:
    """Probe the Temporal frontend and the Ray GCS every `every_s`: say once when one goes
    and once when it comes back, hold back the SDK's retry warnings while Temporal is
    away, and when one stays away past its grace (`settings.lost_server_s`; Ray:
    `_ray_grace_s`) say so and set `stop` (True: the worker should exit 1)."""
    ray_grace_s = _ray_grace_s(settings.lost_server_s) if ray_grace_s is None else ray_grace_s
    watched = [("Temporal server", settings.temporal_address, settings.lost_server_s)]
    if host_port(settings.ray_address or "") is not None:
        watched.append(("Ray head (GCS)", settings.ray_address, ray_grace_s))
    lost_at: dict[str, float] = {}
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=every_s)
            return False
        except asyncio.TimeoutError:
            pass
        for service, address, grace in watched:
            reason = await tcp_unreachable_reason(address)
            now = time.monotonic()
            if reason is None:
                if service in lost_at:
                    status_log.warning(
                        "the %s at %s is reachable again after %.0f s: serving", service, address, now - lost_at.pop(service)
                    )
                    retries.server_lost = "Temporal server" in lost_at
                continue
            if service not in lost_at:
                lost_at[service] = now
                retries.server_lost = "Temporal server" in lost_at
                until = "for as long as it takes" if grace == float("inf") else f"for up to {grace:g} s, then exits"
                status_log.warning("lost the %s at %s (%s): the worker retries quietly %s", service, address, reason, until)
            elif now - lost_at[service] >= grace:
                status_log.error(
                    "the %s at %s has been unreachable for %.0f s: the worker exits; start the services (`ratchet up`), "
                    "then `ratchet worker`", service, address, now - lost_at[service],
                )  # fmt: skip
                stop.set()
                return True
    return False


async def _sweep_every(client, seconds: float, stop: asyncio.Event) -> None:
    """Sweep again now and then, not only at start-up: a run terminated from outside can
    leave an activity that rebuilds actors after the run closed (until its heartbeat
    tells it), and those would hold their CPUs until some worker restarts."""
    while seconds > 0:
        try:
            await asyncio.wait_for(stop.wait(), timeout=seconds)
            return
        except asyncio.TimeoutError:
            await _sweep_leftover_actors(client)


def show_status(stream) -> None:
    """Write the worker's status lines (ready, server lost, back, giving up) to `stream` as
    they are, without the log format: what `ratchet worker` shows a user."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    status_log.addHandler(handler)
    status_log.setLevel(logging.INFO)
    status_log.propagate = False


def run_worker(settings: WorkerSettings) -> None:
    """Serve until stopped, then leave the process with serve's exit code. A service that
    is not reachable at start-up raises ServiceUnreachable (nothing was started)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # This process is ratchet's alone: what it writes (its Ray driver's logs, a local
    # object store's runs, downloads, the registry) is its user's only, as for the services.
    os.umask(PRIVATE_UMASK)
    # Not asyncio.run: after a lost server, its clean-up would wait on the SDK's tasks,
    # which wait on the server; the process ends here either way.
    loop = asyncio.new_event_loop()
    code = loop.run_until_complete(serve(settings))
    # The SDK can crash in PyGILState_Release at interpreter exit; leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def main() -> None:
    try:
        run_worker(WorkerSettings.from_env())
    except ServiceUnreachable as exc:
        log.error("%s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
