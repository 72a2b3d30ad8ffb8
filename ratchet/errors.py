"""Error types that cross from workers to the workflow, named in one place.

An activity fails with `ApplicationError(message, type=<one of these names>)`; the
workflow's retry policy matches on the name, and `activities/ray_calls.py` classifies an
error raised inside a Ray actor (which Ray wraps) by the class name of its cause. Standard
library only: workflow code imports it inside the Temporal sandbox.
"""

from __future__ import annotations

CONFIG_ERROR = "ConfigError"
REWARD_LOAD_ERROR = "RewardLoadError"
# Lost state that only a checkpoint could restore: retrying cannot help.
WORKER_LOST = "WorkerLost"
NON_FINITE = "NonFiniteError"
REWARD_FUNCTION_ERROR = "RewardFunctionError"
RESOURCES_UNAVAILABLE = "ResourcesUnavailable"
# Retryable ones: a retry redoes the upload, or scores with a fresh reward actor.
CHECKPOINT_FAILED = "CheckpointFailed"
REWARD_TIMEOUT = "RewardTimeout"

# Errors no retry can fix: a retry would run the same code on the same input.
NON_RETRYABLE = (CONFIG_ERROR, REWARD_LOAD_ERROR, WORKER_LOST, NON_FINITE, REWARD_FUNCTION_ERROR, RESOURCES_UNAVAILABLE)


class NonFiniteError(ValueError):
    """A NaN or infinite reward, loss, gradient norm or weight: training on it would make
    every weight NaN, so the step stops before anything is updated, synced or saved."""


class RewardFunctionError(ValueError):
    """The configured reward function raised: a bug in user code, the same on every retry."""


class CheckpointFailed(RuntimeError):
    """A checkpoint could not be written or committed."""
