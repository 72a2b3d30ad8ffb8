"""Supervised datasets: chat conversations for SFT and preference pairs for DPO, read and
turned into token ids with a loss mask over the assistant's tokens.

- SFT rows hold a list of chat messages (`messages` column, verl's multi-turn SFT layout;
  TRL's "conversational" format): {role, content}, roles system / user / assistant / tool,
  at least one assistant message. The loss covers the assistant turns only.
- Preference rows hold `prompt`, `chosen` and `rejected` (TRL's preference format): the
  prompt as a string or messages, each completion as a string or a list of assistant
  messages. The loss covers the completion's tokens.

A conversation is rendered with the tokenizer's chat template turn by turn: the tokens of
assistant turn i are those that `messages[: i + 1]` adds to `messages[: i]` rendered with
the generation prompt. That needs a template whose rendering of a conversation extends its
rendering of every prefix (true of the usual templates and of the tiny model's); one that
does not is refused with a message that says so, rather than training on shifted masks.

Bad rows fail with `SupervisedDataError` naming the file, the row and the column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .files import read_dataset
from .prompt_format import describe_kind

ROLES = ("system", "user", "assistant", "tool")


class SupervisedDataError(ValueError):
    """A supervised dataset row that cannot be used; the message names file, row and column."""


@dataclass(frozen=True)
class Encoded:
    """One training sequence: token ids and the 0/1 mask of the tokens the loss counts."""

    input_ids: list[int]
    loss_mask: list[int]


def _messages_problem(value: Any, *, need_assistant: bool) -> str | None:
    if not isinstance(value, list) or not value:
        return f"must be a non-empty list of chat messages {{role, content}}, got {describe_kind(value) if not isinstance(value, list) else 'an empty list'}"
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return f"message {i} is {describe_kind(m)}, not a {{role, content}} mapping"
        if m.get("role") not in ROLES:
            return f"message {i} has role {m.get('role')!r}; expected one of {', '.join(ROLES)}"
        if not isinstance(m.get("content"), str):
            return f"message {i} has {describe_kind(m.get('content'))} as its content; expected a string"
    if need_assistant and not any(m["role"] == "assistant" for m in value):
        return "has no assistant message, so nothing to train on"
    return None


def _plain(value: Any) -> Any:
    """numpy arrays and pyarrow structs as lists and dicts (parquet list columns)."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _column(path: str, key: str, what: str) -> list[Any]:
    table = read_dataset(path, [key])
    if key not in table.column_names:
        raise SupervisedDataError(f"{path}: no column {key!r} ({what}); its columns are {', '.join(table.column_names) or 'none'}")
    if table.unreadable:
        row, why = next(iter(sorted(table.unreadable.items())))
        raise SupervisedDataError(f"{path}: row {row} cannot be read: {why}")
    return [_plain(v) for v in table.columns[key]]


def read_conversations(path: str, messages_key: str = "messages") -> list[list[dict]]:
    """The conversations of an SFT dataset, every row checked."""
    rows = _column(path, messages_key, "the chat messages of each conversation")
    if not rows:
        raise SupervisedDataError(f"{path}: no rows")
    for i, value in enumerate(rows):
        problem = _messages_problem(value, need_assistant=True)
        if problem:
            raise SupervisedDataError(f"{path}: row {i}, column {messages_key!r}: {problem}")
    return rows


@dataclass(frozen=True)
class PreferencePair:
    prompt: list[dict]
    chosen: list[dict]
    rejected: list[dict]


def read_preferences(
    path: str, prompt_key: str = "prompt", chosen_key: str = "chosen", rejected_key: str = "rejected"
) -> list[PreferencePair]:
    """The preference pairs of a DPO dataset as conversations (a string prompt is one user
    message, a string completion one assistant message), every row checked."""
    cols = {
        k: _column(path, k, what)
        for k, what in ((prompt_key, "the prompt"), (chosen_key, "the preferred completion"), (rejected_key, "the other completion"))
    }
    n = len(cols[prompt_key])
    if not n:
        raise SupervisedDataError(f"{path}: no rows")
    pairs = []
    for i in range(n):
        prompt = cols[prompt_key][i]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) and prompt else prompt
        problem = _messages_problem(prompt, need_assistant=False)
        if problem:
            raise SupervisedDataError(f"{path}: row {i}, column {prompt_key!r}: {problem}")
        done = []
        for key in (chosen_key, rejected_key):
            value = cols[key][i]
            value = [{"role": "assistant", "content": value}] if isinstance(value, str) else value
            problem = _messages_problem(value, need_assistant=True)
            if problem is None and any(m["role"] != "assistant" for m in value):
                problem = "must hold assistant messages only (the completion)"
            if problem:
                raise SupervisedDataError(f"{path}: row {i}, column {key!r}: {problem}")
            done.append(value)
        pairs.append(PreferencePair(prompt, done[0], done[1]))
    return pairs


def _render(tokenizer, messages: list[dict], *, generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return list(ids)


def encode_conversation(tokenizer, messages: Sequence[dict], *, train_from: int = 0) -> Encoded:
    """Token ids of a conversation and a mask over its assistant turns at index
    >= `train_from` (preference pairs train the completion only). SupervisedDataError when
    the chat template does not render the conversation turn by turn (see the module doc)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise SupervisedDataError("the tokenizer has no chat template, which chat messages need; add a chat_template to the model folder")
    ids: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            before = _render(tokenizer, list(messages[:i]), generation_prompt=True) if i else []
            if before[: len(ids)] != ids:
                raise _not_incremental(i)
            mask += [0] * (len(before) - len(ids))
            ids = before
        full = _render(tokenizer, list(messages[: i + 1]), generation_prompt=False)
        if full[: len(ids)] != ids:
            raise _not_incremental(i)
        trained = 1 if m["role"] == "assistant" and i >= train_from else 0
        mask += [trained] * (len(full) - len(ids))
        ids = full
    return Encoded(ids, mask)


def _not_incremental(turn: int) -> SupervisedDataError:
    return SupervisedDataError(
        f"the tokenizer's chat template renders message {turn} by changing the tokens before it, so the assistant's tokens "
        "cannot be told apart; use a chat template whose rendering of a conversation extends the rendering of each of its prefixes"
    )


def encode_pair(tokenizer, pair: PreferencePair) -> tuple[Encoded, Encoded]:
    """(chosen, rejected) sequences: the prompt then the completion, the completion masked in."""
    start = len(pair.prompt)
    return (
        encode_conversation(tokenizer, pair.prompt + pair.chosen, train_from=start),
        encode_conversation(tokenizer, pair.prompt + pair.rejected, train_from=start),
    )
