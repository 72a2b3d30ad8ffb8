"""Domain errors that cross from workers to the workflow, named in one place.

The worker layer raises these classes; `activities/translate.py` turns one into
`ApplicationError(message, type=<class name>, non_retryable=<its non_retryable>)`, and
the workflow's retry policy matches on the names in `NON_RETRYABLE`. Ray wraps an error
raised inside an actor, so `activities/ray_calls.py` classifies such an error by the class
name of its cause. Standard library only: workflow code imports it inside the Temporal
sandbox.
"""

from __future__ import annotations


class DomainError(Exception):
    """An error the workflow sees by its class name. `non_retryable` says whether a retry
    could help; an instance may override its class's answer (`non_retryable=` keyword)."""

    non_retryable: bool = False

    def __init__(self, *args: object, non_retryable: bool | None = None):
        super().__init__(*args)
        if non_retryable is not None:
            self.non_retryable = non_retryable


class NonFiniteError(DomainError, ValueError):
    """A NaN or infinite reward, loss, gradient norm or weight: training on it would make
    every weight NaN, so the step stops before anything is updated, synced or saved."""

    non_retryable = True


class RewardFunctionError(DomainError, ValueError):
    """The configured reward function raised: a bug in user code, the same on every retry."""

    non_retryable = True


class WorkerLost(DomainError, RuntimeError):
    """Lost state that only a checkpoint could restore: retrying cannot help."""

    non_retryable = True


class ResourcesUnavailable(DomainError, RuntimeError):
    """The cluster cannot place the run's actors (too few free CPUs, or none placed in
    time); a retry would wait for the same CPUs, so the run fails naming who holds them."""

    non_retryable = True


class CheckpointFailed(DomainError, RuntimeError):
    """A checkpoint could not be written or committed; a retry redoes the upload (unless
    the trainer trained on and the state is gone: raised with non_retryable=True)."""


class RewardTimeout(DomainError, TimeoutError):
    """Scoring took longer than reward.timeout_s; a retry scores with a fresh reward actor."""


class MissingExtra(DomainError, ImportError):
    """An optional feature the run uses whose packages this environment lacks (ratchet's
    extras: src/ratchet/extras.py); the message names the extra to install. A retry runs
    in the same environment."""

    non_retryable = True


# Errors of the config and task layers, which keep their own classes (they are raised
# before a run exists, or inside a reward actor's constructor).
CONFIG_ERROR = "ConfigError"
REWARD_LOAD_ERROR = "RewardLoadError"

DOMAIN_ERRORS = (NonFiniteError, RewardFunctionError, WorkerLost, ResourcesUnavailable, CheckpointFailed, RewardTimeout, MissingExtra)
# Errors no retry can fix: a retry would run the same code on the same input.
NON_RETRYABLE = (CONFIG_ERROR, REWARD_LOAD_ERROR, *(c.__name__ for c in DOMAIN_ERRORS if c.non_retryable))
