"""Example rollout filters (`rollout.filter`): a stand-in for a safety classifier that
looks at each generated sample before it is trained on.

Contract (workers/rollout_filter.py): `fn(prompt, response, data_source, extra_info)`,
called with keywords on the decoded text of one sample, returns
- `True` / `False`: keep the sample / drop it from the loss and its normaliser, or
- a dict `{"keep": bool, "reward": float}` (`reward` optional): keep or drop it, and
  replace its reward (a kept sample's new reward is what it is trained on).
"""

from __future__ import annotations

from .costs import FORBIDDEN_DIGIT


def drop_forbidden(prompt: str, response: str, data_source: str, extra_info: dict | None = None) -> bool:
    """Drop every response that writes the forbidden digit (tasks/costs.py)."""
    return FORBIDDEN_DIGIT not in response


def zero_reward_forbidden(prompt: str, response: str, data_source: str, extra_info: dict | None = None) -> dict:
    """Keep every response, but one that writes the forbidden digit earns reward 0."""
    if FORBIDDEN_DIGIT in response:
        return {"keep": True, "reward": 0.0}
    return {"keep": True}
