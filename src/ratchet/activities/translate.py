"""The one place where worker-layer errors become Temporal's.

The worker layer raises ratchet.errors domain errors (and Ray raises its own, wrapping an
error raised inside an actor); an activity fails with
`ApplicationError(message, type=<class name>, non_retryable=<the class's answer>)`, whose
type the workflow's retry policy matches (ratchet.errors.NON_RETRYABLE).

Ray wraps an error raised inside an actor (RayTaskError, or ActorDiedError when the
actor's constructor raised), so a class could never match: `from_ray_error` classifies by
the cause. A domain error that no retry can fix becomes a non-retryable ApplicationError
of the cause's type; infrastructure errors (an actor died, an object was lost) stay
retryable.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import TypeVar

import ray
from temporalio.exceptions import ApplicationError

from ratchet.errors import NON_RETRYABLE, DomainError

F = TypeVar("F", bound=Callable)
# The last line of a Python traceback: `package.module.ClassName: message`.
_TRACEBACK_TAIL = re.compile(r"^(?:[\w]+\.)*(\w+): (.*)$")


def domain_error(exc: DomainError) -> ApplicationError:
    """A domain error raised in this process (by the worker layer), for Temporal."""
    return ApplicationError(str(exc), type=type(exc).__name__, non_retryable=exc.non_retryable)


def _non_retryable_type(exc: BaseException | None) -> str | None:
    """The first non-retryable domain error type among exc's classes and causes."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for cls in type(exc).__mro__:
            if cls.__name__ in NON_RETRYABLE:
                return cls.__name__
        exc = exc.__cause__ or exc.__context__
    return None


def from_ray_error(err: BaseException) -> BaseException:
    """The error an activity should raise for `err`, an error from `ray.get`."""
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = err.cause if err.cause is not None else err
        kind = _non_retryable_type(cause)
        if kind is not None:
            return ApplicationError(f"{kind}: {cause}", type=kind, non_retryable=True)
        return err
    if isinstance(err, ray.exceptions.RayActorError) and getattr(err, "_actor_init_failed", False):
        # The constructor raised; only its traceback text crossed over.
        lines = [x for x in (getattr(err, "error_msg", "") or "").splitlines() if x.strip()]
        m = _TRACEBACK_TAIL.match(lines[-1].strip()) if lines else None
        if m is not None and m.group(1) in NON_RETRYABLE:
            return ApplicationError(f"{m.group(1)}: {m.group(2)}", type=m.group(1), non_retryable=True)
    return err


def temporal_errors(fn: F) -> F:
    """Wrap an activity: a domain error it lets out fails it as an ApplicationError."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DomainError as exc:
            raise domain_error(exc) from exc

    return wrapper  # type: ignore[return-value]
