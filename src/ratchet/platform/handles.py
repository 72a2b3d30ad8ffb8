"""What the handle of a run and the handle of a sweep share: one workflow to query for its
progress, wait on for its result, follow until it closes, and signal."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, ClassVar, Iterator, Protocol

from ratchet.types import RunCommand


class ClientConnection(Protocol):
    """What a handle (and the start of a sweep or a pipeline) needs of the client that made
    it: platform/client.py's `Client` is one. A protocol, so that the handles' modules need
    not import the client that imports them."""

    task_queue: str
    _temporal: Any  # temporalio.client.Client
    _loop: asyncio.AbstractEventLoop

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any: ...

    def has_search_attributes(self) -> bool: ...

    def workflow_status(self, workflow_id: str) -> str | None: ...


def command_for(workflow_id: str) -> RunCommand:
    """The argument of a `pause`, `resume`, `stop` (a run) or `cancel` (a sweep) signal to
    workflow `workflow_id`, issued now: the workflow ignores these signals without one
    (ratchet.types.RunCommand says why). Every sender outside workflow code builds it here."""
    return RunCommand(workflow_id=workflow_id)


class WorkflowHandle:
    """A mixin for a dataclass with `client`; subclasses name their workflow id and the
    types of its `progress` query and its result."""

    client: ClientConnection
    summary_type: ClassVar[type]
    progress_type: ClassVar[type]

    @property
    def workflow_id(self) -> str:
        raise NotImplementedError

    def _handle(self):
        return self.client._temporal.get_workflow_handle(self.workflow_id, result_type=self.summary_type)

    def progress(self, timeout: float | None = None) -> Any:
        """The workflow's progress query; `timeout`: seconds to wait for a worker to answer
        (an RPCError after them; None: the SDK's default, about 30 s)."""
        from datetime import timedelta

        rpc = {"rpc_timeout": timedelta(seconds=timeout)} if timeout else {}
        return self.client._run(self._handle().query("progress", result_type=self.progress_type, **rpc))

    def result(self, timeout: float | None = None) -> Any:
        coro = self._handle().result()
        return self.client._run(asyncio.wait_for(coro, timeout) if timeout else coro)

    def follow(self, every: float = 0.5) -> Iterator[Any]:
        """Yield the progress every `every` seconds until the workflow closes."""
        from temporalio.service import RPCError

        done = self.client._loop.create_task(self._handle().result())
        try:
            while not done.done():
                try:
                    yield self.progress()
                except RPCError:  # no workflow task has run yet, so the query has no answer
                    pass
                self.client._run(asyncio.wait([done], timeout=every))
        finally:
            if not done.done():
                done.cancel()
            else:
                done.exception()  # retrieved here; result() reports it

    def status(self) -> str:
        desc = self.client._run(self._handle().describe())
        return desc.status.name if desc.status else "UNKNOWN"

    def _signal(self, name: str) -> None:
        """Send `pause`, `resume`, `stop` or `cancel` with the RunCommand the workflow acts
        on (ratchet.types.RunCommand: sealed with the payload key, for this workflow)."""
        self.client._run(self._handle().signal(name, command_for(self.workflow_id)))
