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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

from ratchet.types import TASK_QUEUE

from .services import ServiceSettings, ray_address, temporal_address

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

    @classmethod
    def from_env(cls) -> "WorkerSettings":
        env = os.environ
        return cls(
            temporal_address=default_temporal_address(),
            namespace=env.get("RATCHET_NAMESPACE", "default"),
            ray_address=env.get("RATCHET_RAY_ADDRESS") or ray_address(ServiceSettings.from_env()),
            task_queue=env.get("RATCHET_TASK_QUEUE", TASK_QUEUE),
            sticky_schedule_to_start_seconds=float(env.get("RATCHET_STICKY_TIMEOUT_S", "10")),
        )


def connect_ray(address: str) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace="ratchet", log_to_driver=False, configure_logging=False)


def build_worker(client, settings: WorkerSettings, executor: ThreadPoolExecutor):
    from temporalio.worker import Worker

    from ratchet.activities.training import ALL_ACTIVITIES
    from ratchet.workflows.training import TrainingWorkflow

    return Worker(
        client,
        task_queue=settings.task_queue,
        workflows=[TrainingWorkflow],
        activities=ALL_ACTIVITIES,
        activity_executor=executor,
        max_concurrent_activities=settings.max_concurrent_activities,
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=settings.sticky_schedule_to_start_seconds),
        graceful_shutdown_timeout=timedelta(seconds=10),
    )


async def _connect_temporal(client_cls, settings: WorkerSettings, timeout_s: float = 120.0):
    """Connect, waiting out a Temporal server that is restarting: a worker that a supervisor
    starts in that moment would otherwise exit and leave its runs without a worker."""
    from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type(RuntimeError),
        stop=stop_after_delay(timeout_s),
        wait=wait_exponential(multiplier=0.5, max=5.0),
        reraise=True,
        before_sleep=lambda state: log.warning("Temporal at %s not reachable yet; retrying", settings.temporal_address),
    ):
        with attempt:
            return await client_cls.connect(settings.temporal_address, namespace=settings.namespace)


async def serve(settings: WorkerSettings, stop: asyncio.Event | None = None) -> None:
    """Run until `stop` is set or the process gets SIGTERM/SIGINT."""
    from temporalio.client import Client

    connect_ray(settings.ray_address)
    client = await _connect_temporal(Client, settings)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    with ThreadPoolExecutor(max_workers=settings.max_concurrent_activities, thread_name_prefix="activity") as executor:
        worker = build_worker(client, settings, executor)
        log.info("worker on %s (queue %s), Ray at %s", settings.temporal_address, settings.task_queue, settings.ray_address)
        async with worker:
            await stop.wait()
            log.info("shutting down")


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
