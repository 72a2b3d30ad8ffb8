"""What the CLI says instead of a traceback when a user's situation, not a bug, stops a
command: one line naming what is wrong and the command that fixes it, and an exit code
(1: the world is not as the command needs it; 2: the command was asked of something that
does not exist or is wrong).

Two halves, used by src/ratchet/platform/cli.py:

- `explain(exc)`, called once in `main()` around every command: the exceptions a user can
  cause (an unreachable Temporal server, a lost one, a call on a run that ended, a
  Temporal setting that is wrong) mapped to (line, exit code). Anything else is a bug and
  keeps its traceback. `ratchet --debug CMD` or RATCHET_DEBUG=1 shows the traceback of
  these too.
- The checks a command makes before it acts on a run, so that it fails in a second with
  the reason rather than after a timeout: `check_run` (the run exists and is open) and
  `no_worker_line` (whether a worker polls the run's task queue: without one a query waits
  for its timeout and a run sits queued). They raise `CliError`, which `explain` prints.

Why a poller list and not a test query: a query on a run nobody serves waits ~30 s for
the server's timeout. DescribeTaskQueue answers at once; it lists a worker that stopped
for minutes after, so a poller counts only if the server saw it within `POLLER_FRESH_S`
(an idle worker's long poll renews that every minute), and a query still gets a short
timeout of its own (`QUERY_TIMEOUT_S`) for the worker that went in between.
"""

from __future__ import annotations

import os
import time

from .reachability import TEMPORAL_FIX, ServiceUnreachable, temporal_unreachable_reason
from .worker import default_temporal_address

# A worker long-polls each task queue for up to a minute; its last poll is older than this
# only when it has gone.
POLLER_FRESH_S = 90.0
# How long `ratchet progress` waits for a run's answer (the SDK's default is ~30 s).
QUERY_TIMEOUT_S = 10.0
DEBUG_ENV = "RATCHET_DEBUG"
_debug = False


class CliError(Exception):
    """A situation the command explains on one line and ends with `code`."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.message = message
        self.code = code


def set_debug(on: bool) -> None:
    global _debug
    _debug = on


def debug() -> bool:
    """`--debug` was given or RATCHET_DEBUG is set: show tracebacks, explain nothing."""
    return _debug or os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def explain(exc: BaseException) -> tuple[str, int] | None:
    """(the line to print, the exit code) for an exception a user can cause; None for
    any other (a bug: its traceback is the useful output)."""
    from .payload_key import PayloadKeyError, PayloadKeyMismatch
    from .temporal_connection import TemporalConnectionError

    from ratchet.errors import MissingExtra

    if isinstance(exc, CliError):
        return exc.message, exc.code
    if isinstance(exc, MissingExtra):  # an optional feature not installed: the extra to install
        return str(exc), 2
    if isinstance(exc, ServiceUnreachable):
        return str(exc), 1
    if isinstance(exc, TemporalConnectionError):  # a RATCHET_TEMPORAL_* variable: its name and the fix
        return f"Temporal connection settings: {exc}", 2
    if isinstance(exc, (PayloadKeyError, PayloadKeyMismatch)):  # the key file: its path and the fix
        return f"Temporal payload key: {exc}", 2
    if isinstance(exc, RuntimeError) and str(exc).startswith("Failed client connect"):
        # The SDK's error from Client.connect(), which the CLI calls with the default address
        # (Client.connect keeps the SDK's error and its TLS details for the Python API).
        return str(ServiceUnreachable.temporal(default_temporal_address(), temporal_unreachable_reason(str(exc)))), 1
    return _explain_rpc(exc)


def _explain_rpc(exc: BaseException) -> tuple[str, int] | None:
    try:
        from temporalio.service import RPCError, RPCStatusCode
    except ImportError:  # pragma: no cover - temporalio is a dependency
        return None
    if not isinstance(exc, RPCError):
        return None
    address = default_temporal_address()
    status, message = exc.status, exc.message or str(exc)
    if status == RPCStatusCode.UNAVAILABLE:
        return f"lost the Temporal server at {address} during the command ({temporal_unreachable_reason(message)}): {TEMPORAL_FIX}", 1
    if status == RPCStatusCode.FAILED_PRECONDITION and "no poller" in message:
        return "no worker is polling the run's task queue: start one with `ratchet worker`", 1
    if status in (RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED) and "timeout" in message.lower():
        return (
            f"the Temporal server at {address} did not answer in time ({message}): a query waits for a worker; "
            "is one running? start one with `ratchet worker`"
        ), 1
    if status == RPCStatusCode.NOT_FOUND and "temporal-sys-scheduler:" in message:
        schedule = message.rsplit("temporal-sys-scheduler:", 1)[-1].strip()
        return f"no schedule '{schedule}' on the Temporal server at {address}: see `ratchet schedule list`", 2
    if status == RPCStatusCode.NOT_FOUND:
        return f"not found on the Temporal server at {address} ({message}): `ratchet status` lists what runs", 2
    return None


# -- checks before a command acts on a run ---------------------------------------------

_CLOSED = {  # WorkflowExecutionStatus name -> how the line says it
    "COMPLETED": "already completed",
    "FAILED": "already failed",
    "CANCELED": "was cancelled",
    "TERMINATED": "was terminated",
    "TIMED_OUT": "timed out",
    "CONTINUED_AS_NEW": "continued as a new run",
}


def server_address(client) -> str:
    """The Temporal frontend `client` talks to."""
    try:
        return client._temporal.service_client.config.target_host
    except AttributeError:  # pragma: no cover - an SDK without the attribute
        return default_temporal_address()


def ended_line(run_id: str, status: str, nothing: str) -> str:
    """`run X already completed: nothing to pause (...)`: how it ended, and how to go on."""
    said = _CLOSED.get(status, f"ended ({status.lower().replace('_', ' ')})")
    if status == "COMPLETED":
        go_on = f"fork it to train on: `ratchet fork {run_id} --checkpoint NAME`, names from `ratchet checkpoints {run_id}`"
    else:
        go_on = f"continue it from a checkpoint: `ratchet resume {run_id}`, see `ratchet checkpoints {run_id}`"
    return f"run {run_id} {said}: {nothing} ({go_on})"


def check_run(client, run_id: str, nothing: str) -> str:
    """The open run's task queue; CliError when there is no run `run_id` on the server
    (exit 2) or it has ended (exit 1, `ended_line` with `nothing`: "nothing to pause")."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.service import RPCError, RPCStatusCode

    try:
        desc = client._run(client._temporal.get_workflow_handle(run_id).describe())
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise CliError(f"no run '{run_id}' on the Temporal server at {server_address(client)}: see `ratchet runs`", 2) from None
        raise
    if desc.status != WorkflowExecutionStatus.RUNNING:
        raise CliError(ended_line(run_id, desc.status.name if desc.status else "UNKNOWN", nothing), 1)
    return desc.task_queue or client.task_queue


def live_pollers(client, task_queue: str) -> int:
    """How many workers the server saw polling `task_queue` for workflow tasks (what
    answers a query and starts a run) within POLLER_FRESH_S."""
    from datetime import timedelta

    from temporalio.api.enums.v1 import TaskQueueType
    from temporalio.api.taskqueue.v1 import TaskQueue
    from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

    request = DescribeTaskQueueRequest(
        namespace=client._temporal.namespace,
        task_queue=TaskQueue(name=task_queue),
        task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
    )
    reply = client._run(client._temporal.workflow_service.describe_task_queue(request, timeout=timedelta(seconds=5)))
    now = time.time()
    return sum(1 for p in reply.pollers if now - p.last_access_time.ToSeconds() < POLLER_FRESH_S)


def no_worker_line(client, task_queue: str | None = None) -> str | None:
    """`no worker is polling task queue 'ratchet': ...` when none is, else None."""
    task_queue = task_queue or client.task_queue
    if live_pollers(client, task_queue):
        return None
    return f"no worker is polling task queue '{task_queue}': start one with `ratchet worker`"
