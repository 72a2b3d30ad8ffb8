"""`ratchet worker`: a Temporal worker process that runs ratchet's workflows and activities.

It is also a Ray driver: activities reach the run's actors through the Ray cluster at
`ray_address`. SIGTERM and SIGINT shut it down gracefully (running activities finish,
the workflow task is handed back), which avoids the sticky-queue stall that a killed
worker causes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

from ratchet.types import TASK_QUEUE

from .services import ServiceSettings, ray_address, ray_auth_env, temporal_address
from .services.ray_auth import record_applied
from .temporal_connection import connect_options, namespace_from_env
from .temporal_connection import from_env as temporal_from_env

log = logging.getLogger(__name__)


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

    @classmethod
    def from_env(cls) -> "WorkerSettings":
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
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def connect_ray(address: str, auth_env: dict[str, str] | None = None) -> None:
    """Join the Ray head at `address` as a driver, with its token (`auth_env`, from
    `services.ray_auth_env`; the environment's own RAY_AUTH_* when None)."""
    if auth_env:
        _apply_ray_auth(auth_env)
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace="ratchet", log_to_driver=False, configure_logging=False)


def build_worker(client, settings: WorkerSettings, executor: ThreadPoolExecutor):
    from temporalio.worker import Worker

    from ratchet.activities.nodes import NODE_ACTIVITIES
    from ratchet.activities.sweep_trials import SWEEP_ACTIVITIES
    from ratchet.activities.training import ALL_ACTIVITIES
    from ratchet.workflows.launch import ScheduledLaunchWorkflow
    from ratchet.workflows.sweep import SweepWorkflow
    from ratchet.workflows.training import TrainingWorkflow

    return Worker(
        client,
        task_queue=settings.task_queue,
        workflows=[TrainingWorkflow, SweepWorkflow, ScheduledLaunchWorkflow],
        activities=[*ALL_ACTIVITIES, *SWEEP_ACTIVITIES, *NODE_ACTIVITIES],
        activity_executor=executor,
        max_concurrent_activities=settings.max_concurrent_activities,
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=settings.sticky_schedule_to_start_seconds),
        graceful_shutdown_timeout=timedelta(seconds=10),
        **({"identity": settings.identity} if settings.identity else {}),
    )


async def _connect_temporal(client_cls, settings: WorkerSettings, timeout_s: float = 120.0):
    """Connect, waiting out a Temporal server that is restarting: a worker that a supervisor
    starts in that moment would otherwise exit and leave its runs without a worker."""
    from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

    # TLS and API key from the environment, checked before the first attempt: a bad setting
    # is a ValueError naming the variable, never retried as an unreachable server.
    options = connect_options(settings.namespace)
    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type(RuntimeError),
        stop=stop_after_delay(timeout_s),
        wait=wait_exponential(multiplier=0.5, max=5.0),
        reraise=True,
        before_sleep=lambda state: log.warning("Temporal at %s not reachable yet; retrying", settings.temporal_address),
    ):
        with attempt:
            return await client_cls.connect(settings.temporal_address, **options)


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


async def serve(settings: WorkerSettings, stop: asyncio.Event | None = None) -> None:
    """Run until `stop` is set or the process gets SIGTERM/SIGINT."""
    from temporalio.client import Client

    # A bad TLS or API-key variable fails here, before Ray is joined; the line never holds the key.
    log.info("Temporal at %s: %s", settings.temporal_address, temporal_from_env(namespace=settings.namespace).describe())
    connect_ray(settings.ray_address, settings.ray_auth_env)
    client = await _connect_temporal(Client, settings)
    await _sweep_leftover_actors(client)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    with ThreadPoolExecutor(max_workers=settings.max_concurrent_activities, thread_name_prefix="activity") as executor:
        worker = build_worker(client, settings, executor)
        log.info(
            "worker on %s (queue %s), Ray at %s, pid %d", settings.temporal_address, settings.task_queue, settings.ray_address, os.getpid()
        )
        async with worker:
            sweeping = asyncio.ensure_future(_sweep_every(client, settings.sweep_every_seconds, stop))
            await stop.wait()
            log.info("shutting down")
            sweeping.cancel()


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


def run_worker(settings: WorkerSettings) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(settings))
    # The SDK can crash in PyGILState_Release at interpreter exit; leave without it.
    logging.shutdown()
    os._exit(0)


def main() -> None:
    run_worker(WorkerSettings.from_env())


if __name__ == "__main__":
    main()
