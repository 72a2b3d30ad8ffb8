"""Apply a verl-signature reward function to a batch's decoded responses (and, for a
function that asks for them, their token ids: tasks/loading.py)."""

from __future__ import annotations

import math
import traceback
from typing import Callable

import torch

from ratchet.algorithms.advantages import response_span_lengths
from ratchet.errors import NonFiniteError, RewardFunctionError
from ratchet.tasks.loading import RewardFunction

from .batch import RolloutBatch


def sample_where(batch_index: int | None, row: int, info: dict) -> str:
    """Where a sample is, for an error message: 'batch 3, row 1 (data_source 'x')'."""
    at = f"batch {batch_index}, " if batch_index is not None else ""
    return f"{at}row {row} (data_source {info.get('data_source')!r})"


def user_code_failed(what: str, e: Exception, where: str, field: str) -> RewardFunctionError:
    """The error for a user's function (reward, cost, rollout filter) that raised on a
    sample: what raised, on which sample, at which line of the user's code, and the key to
    fix. Not retryable: a bug there fails the same on every retry."""
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return RewardFunctionError(
        f"the {what} raised {type(e).__name__}: {e} at {where}, in {frame.filename}:{frame.lineno} ({frame.name}); fix {field}"
    )


def _call(
    reward_fn: Callable, batch_index: int | None, row: int, info: dict, text: str, token_args: dict | None = None,
    field: str = "reward.function",
):  # fmt: skip
    """The function's result; its own exception becomes a RewardFunctionError naming the
    sample and where in the function it failed: a bug there fails the same on every retry."""
    try:
        return reward_fn(
            data_source=info["data_source"],
            solution_str=text,
            ground_truth=info["ground_truth"],
            extra_info=info["extra_info"],
            **(token_args or {}),
        )
    except Exception as e:  # noqa: BLE001 - user code: any error is the user's to fix
        raise user_code_failed(_role(field), e, sample_where(batch_index, row, info), field) from e


def _role(field: str) -> str:
    """'reward function' for reward.function, 'cost function' for safety.cost_function."""
    return "cost function" if field.startswith("safety.") else "reward function"


def check_finite_rewards(rewards: torch.Tensor, samples: list[dict], batch_index: int | None, what: str) -> None:
    """NonFiniteError naming the first sample whose reward is NaN or infinite: one such
    reward makes every weight NaN after one update."""
    bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
    if bad:
        row = bad[0]
        raise NonFiniteError(
            f"{what} gave {float(rewards[row])} at {sample_where(batch_index, row, samples[row])} ({len(bad)} non-finite rewards in "
            "the batch); rewards must be finite numbers: fix the reward function or reward model"
        )


def token_args(batch: RolloutBatch, row: int, response: list[int], wanted: tuple[str, ...]) -> dict[str, list[int]]:
    """The token-id arguments a reward function asked for, for one row (unpadded)."""
    args: dict[str, list[int]] = {}
    for name in wanted:
        if name in ("response_ids", "completion_ids"):
            args[name] = list(response)  # a copy each: the function may change its list
        elif name == "prompt_ids":
            args[name] = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
    return args


def score_batch(
    batch: RolloutBatch, tokenizer, reward_fn: Callable, batch_index: int | None = None, *, field: str = "reward.function"
) -> tuple[torch.Tensor, list[dict]]:
    """Rewards [B] and, per sample, the extra numbers a dict-returning function gave.
    `field`: the config key of the function, named in its errors (safety.cost_function
    scores costs with the same contract)."""
    role = _role(field)
    fn = RewardFunction.wrap(reward_fn)  # a plain callable (tests, the local loop) is inspected here
    rewards, extras = [], []
    spans = response_span_lengths(batch.response_mask).tolist()  # the whole trajectory: tool output in holes too
    for row, info in enumerate(batch.samples):
        n = spans[row]
        response = batch.response_ids[row, :n].tolist()
        text = tokenizer.decode(response, skip_special_tokens=True)
        out = _call(fn, batch_index, row, info, text, token_args(batch, row, response, fn.token_params), field)
        if isinstance(out, dict):
            if "score" not in out:
                raise RewardFunctionError(
                    f"{role} returned a dict without 'score': {sorted(out)} at {sample_where(batch_index, row, info)}; fix {field}"
                )
            score = out["score"]
            extras.append({k: float(v) for k, v in out.items() if k != "score" and isinstance(v, (int, float))})
        else:
            score = out
            extras.append({})
        try:
            value = float(score)
        except (TypeError, ValueError):
            raise RewardFunctionError(
                f"the {role} returned {score!r} ({type(score).__name__}) at {sample_where(batch_index, row, info)}; it must "
                f"return a number or a dict with a numeric 'score' (fix {field})"
            ) from None
        if not math.isfinite(value):  # at once: the rows after it are not scored
            raise NonFiniteError(
                f"the {role} gave {value} at {sample_where(batch_index, row, info)}; {role.split()[0]}s must be finite numbers: fix {field}"
            )
        rewards.append(value)
    return torch.tensor(rewards, dtype=torch.float32), extras


class RewardModelScorer:
    """A sequence-classification reward model (one label) scoring prompt + response text.

    Text, not token ids, crosses from policy to reward model: the two may not share a
    tokenizer."""

    def __init__(self, model_path: str):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from .hf_io import local_hf_path

        path = local_hf_path(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward.model_path: {path} has {self.model.config.num_labels} labels; a reward model needs 1")

    @torch.no_grad()
    def score(self, batch: RolloutBatch, policy_tokenizer) -> torch.Tensor:
        texts = []
        spans = response_span_lengths(batch.response_mask).tolist()  # holes (tool output) included
        for row in range(len(batch)):
            prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
            n = spans[row]
            texts.append(
                policy_tokenizer.decode(prompt, skip_special_tokens=True)
                + " "
                + policy_tokenizer.decode(batch.response_ids[row, :n].tolist(), skip_special_tokens=True)
            )
        enc = self.tokenizer(texts, return_tensors="pt", padding=True)
        return self.model(**enc).logits[:, 0].float()
