"""Rollout filters (`rollout.filter`): a user function that sees each generated sample
before it is trained on (a safety classifier, a format check) and keeps or drops it, or
replaces its reward.

Contract: `fn(prompt, response, data_source, extra_info)`, called with keywords on the
decoded text of one sample (special tokens skipped, as the reward function gets it), returns
- `True` / `False` (numpy booleans too): keep the sample / drop it, or
- a dict `{"keep": bool, "reward": float}` ("keep" defaults to True, "reward" is optional):
  keep or drop it, and replace its reward with a finite number.

A dropped sample stays in the stored batch (its reward and cost are recorded) but leaves
the loss mask and the normaliser, as dynamic sampling's dropped groups do, and it leaves
its group too: the trainer gives it a group of its own (`filtered_groups`), so it moves
neither the group mean nor anyone's advantage. The reward worker runs the filter after
scoring, on every sample of the batch; the trainer counts the drops
(`rollout_filter/dropped`).
"""

from __future__ import annotations

import math

import torch

from ratchet.errors import NonFiniteError, RewardFunctionError
from ratchet.tasks.loading import load_filter_fn

from .batch import RolloutBatch
from .scoring import sample_where, user_code_failed

FIELD = "rollout.filter"


def filtered_groups(group: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The group ids with every dropped row in a group of its own (negative ids, which no
    prompt index takes): group-relative estimators give it advantage 0 and leave it out of
    its prompt's mean and std."""
    if keep is None or bool(keep.all()):
        return group
    own = -1 - torch.arange(len(group), dtype=group.dtype)
    return torch.where(keep.bool(), group, own)


def _texts(batch: RolloutBatch, row: int, tokenizer) -> tuple[str, str]:
    prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
    on = torch.nonzero(batch.response_mask[row]).flatten()
    end = int(on.max().item()) + 1 if on.numel() else 0  # the last response token: masks may have holes
    return (
        tokenizer.decode(prompt, skip_special_tokens=True),
        tokenizer.decode(batch.response_ids[row, :end].tolist(), skip_special_tokens=True),
    )


class RolloutFilter:
    """The configured filter, applied to a whole batch."""

    def __init__(self, spec: str):
        self.spec = spec
        self.fn = load_filter_fn(spec)

    def _verdict(self, out, where: str) -> tuple[bool, float | None]:
        if isinstance(out, dict):
            unknown = sorted(set(out) - {"keep", "reward"})
            if unknown:
                raise RewardFunctionError(
                    f"the rollout filter returned a dict with keys {unknown} at {where}; it may hold 'keep' and 'reward' only (fix {FIELD})"
                )
            keep, reward = out.get("keep", True), out.get("reward")
        else:
            keep, reward = out, None
        if not (isinstance(keep, bool) or type(keep).__name__ in ("bool", "bool_")):  # numpy's bool too
            raise RewardFunctionError(
                f"the rollout filter returned {out!r} ({type(out).__name__}) at {where}; it must return True/False or a dict "
                f"{{'keep': bool, 'reward': float}} (fix {FIELD})"
            )
        if reward is not None:
            try:
                reward = float(reward)
            except (TypeError, ValueError):
                raise RewardFunctionError(
                    f"the rollout filter returned reward {reward!r} at {where}; it must be a number (fix {FIELD})"
                ) from None
            if not math.isfinite(reward):
                raise NonFiniteError(f"the rollout filter gave reward {reward} at {where}; rewards must be finite numbers: fix {FIELD}")
        return bool(keep), reward

    def apply(
        self, batch: RolloutBatch, tokenizer, rewards: torch.Tensor, batch_index: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(keep [B] bool, rewards [B] with the filter's replacements)."""
        keep = torch.ones(len(batch), dtype=torch.bool)
        rewards = rewards.clone()
        for row, info in enumerate(batch.samples):
            prompt, response = _texts(batch, row, tokenizer)
            where = sample_where(batch_index, row, info)
            try:
                out = self.fn(prompt=prompt, response=response, data_source=info["data_source"], extra_info=info.get("extra_info"))
            except Exception as e:  # noqa: BLE001 - user code: any error is the user's to fix
                raise user_code_failed("rollout filter", e, where, FIELD) from e
            keep[row], reward = self._verdict(out, where)
            if reward is not None:
                rewards[row] = reward
        return keep, rewards
