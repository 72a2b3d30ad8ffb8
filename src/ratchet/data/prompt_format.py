"""How a dataset's prompts become token ids: through the tokenizer's chat template, or as
raw text (TRL's "conversational" and "standard" dataset formats).

`data.prompt_format`:
- `auto` (default): each dataset decides by its prompts: chat messages (a list of
  {role, content}) go through the chat template, plain strings are tokenized as they are
  (as TRL does with a "standard" dataset, so a base model without a template works);
- `chat`: always the chat template; a plain-string prompt becomes one user message (a
  "standard" dataset on an instruct model);
- `raw`: plain strings only, no template (message lists are refused: rendering them needs
  a template).

Raw text is tokenized with the tokenizer's own special tokens (a BOS for Llama and Gemma
tokenizers), as the model saw text in pretraining; a chat template writes its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

PROMPT_FORMATS = ("auto", "chat", "raw")
Resolved = Literal["chat", "raw"]
MESSAGES = "a list of chat messages {role, content}"


def resolve_prompt_format(setting: str, prompts: Sequence[Any]) -> Resolved:
    """The format a dataset's prompts are encoded in: `setting` unless it is auto, then the
    kind of the first prompt that is a string or a list (rows of the other kind are then
    reported as bad rows, not silently encoded another way)."""
    if setting in ("chat", "raw"):
        return setting  # type: ignore[return-value]
    for prompt in prompts:
        if isinstance(prompt, str):
            return "raw"
        if isinstance(prompt, list):
            return "chat"
    return "chat"


def prompt_problem(prompt: Any, fmt: Resolved, setting: str = "auto") -> str | None:
    """What is wrong with one prompt in a dataset encoded as `fmt`, or None."""
    if fmt == "raw":
        if isinstance(prompt, str):
            return None if prompt else "must be a non-empty string, got an empty string"
        if isinstance(prompt, list) and setting == "raw":
            return f"is {MESSAGES}, which needs the chat template; set data.prompt_format=chat (or auto), or give plain strings"
        other = " (the dataset's first prompt is a string)" if setting == "auto" else ""
        return f"must be a string{other}, got {describe_kind(prompt)}"
    if isinstance(prompt, str):
        if setting == "chat":
            return None if prompt else "must be a non-empty string or messages, got an empty string"
        return f"must be {MESSAGES} (the dataset's first prompt is one), got a str; use one format for every row"
    expected = f"must be {MESSAGES}"
    if not isinstance(prompt, list):
        return f"{expected}, got {describe_kind(prompt)}"
    if not prompt:
        return f"{expected}, got an empty list"
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            return f"{expected}, but message {i} is {describe_kind(message)}"
        for part in ("role", "content"):
            if not isinstance(message.get(part), str):
                return f"{expected}, but message {i} has {describe_kind(message.get(part))} as its {part}"
    return None


def as_messages(prompt: str | list[dict]) -> list[dict]:
    """Chat format: a plain-string prompt is one user message."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def encode_prompts(tokenizer: Any, prompts: Sequence[Any], fmt: Resolved) -> list[list[int]]:
    """Token ids of the prompts, as the rollout feeds them to the engine: chat messages through
    the chat template with the generation prompt, raw text through the tokenizer."""
    if not prompts:
        return []
    if fmt == "raw":
        ids = tokenizer(list(prompts))["input_ids"]
    else:
        out = tokenizer.apply_chat_template([as_messages(p) for p in prompts], tokenize=True, add_generation_prompt=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
    return [list(i) for i in ids]


def describe_kind(value: Any) -> str:
    """'a str', 'an int', 'nothing (null)': a value's type for an error message."""
    if value is None:
        return "nothing (null)"
    name = type(value).__name__
    article = "an" if name[:1] in "aeiou" else "a"
    return f"{article} {name}"
