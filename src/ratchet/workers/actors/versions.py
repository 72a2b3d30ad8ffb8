"""Whether an actor holds the policy version a caller expects: the check every group makes
before it hands an actor out (a lost or out-of-step one is rebuilt instead)."""

from __future__ import annotations

import logging

import ray

from .waiting import Waiter

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
