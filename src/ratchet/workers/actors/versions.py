"""Whether an actor holds the policy version a caller expects, and the rebuild when it does
not: what every group does before it hands an actor out."""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

import ray

from .restore_lease import restore_lease
from .waiting import Waiter

T = TypeVar("T")

log = logging.getLogger(__name__)


def holds_version(
    waiter: Waiter, run_id: str, actor, what: str, expected_version: int, *, retrying_update: bool = False, at_least: bool = False,
    log_mismatch: bool = False, held=None,
) -> bool:  # fmt: skip
    """`actor` (trainer rank 0, the critic) answers with `expected_version`; with
    `retrying_update`, also the version after it (a retried update whose first try got that
    far); with `at_least`, any newer one. `held`: the ObjectRef of an answer already asked."""
    try:
        version = waiter.wait(held if held is not None else actor.policy_version.remote())
    except ray.exceptions.RayError:
        version = None  # died just now, or broken: rebuilt
    if version == expected_version or (retrying_update and version == expected_version + 1):
        return True
    if at_least and version is not None and version > expected_version:
        return True
    if log_mismatch:
        log.warning("run %s: %s holds v%s, the workflow expects v%d; restoring", run_id, what, version, expected_version)
    return False


def found_or_rebuilt(
    run_id: str, role: str, waiter: Waiter, found: T, find: Callable[[], T], holds: Callable[[T, bool], bool], rebuild: Callable[[], T]
) -> T:  # fmt: skip
    """`found` if it `holds` the expected version (`holds(x, first)`: the first check logs a
    mismatch); else, under the run's lease for `role` (one rebuilder at a time), what `find`
    gives now if that holds it (another activity may have rebuilt it while this one waited
    for the lease), else `rebuild()`."""
    if holds(found, True):
        return found
    with restore_lease(run_id, role, waiter):
        found = find()
        if holds(found, False):
            return found
        return rebuild()
