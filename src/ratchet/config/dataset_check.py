"""Check the datasets, the tokenizer and the model's context against a config at submit time.

Without these checks a bad row surfaces late and badly: a plain-string prompt tokenizes to
an empty prompt, a missing `reward_model` scores against "", an int ground truth or a
missing `data_source` raises inside the reward function, and a missing column, an
over-long prompt, a tokenizer without a pad token or a chat template fail inside the
rollout actor, retried five times. Here each problem is one issue naming the file's field,
the first few rows (counted from 0, as pyarrow and pandas do) and how many rows share it.

Each file (parquet, JSON Lines or a `save_to_disk` folder: src/ratchet/data/files.py) is read
once, only the columns the run uses, and its prompts are tokenized in one batch with the
call the rollout makes (src/ratchet/data/prompt_format.py: the chat template with the
generation prompt, or the raw text), so a prompt passes here if and only if the rollout
accepts it. transformers and pyarrow are imported inside the functions: validating a
config without `check_files` stays free of them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ratchet.data.files import DatasetFileError, read_dataset
from ratchet.data.prompt_format import describe_kind, encode_prompts, prompt_problem, resolve_prompt_format

if TYPE_CHECKING:
    from ratchet.config.schema import RunConfig

Issue = tuple[str, str]

MAX_ROWS_SHOWN = 5
# config.json keys that give a model's context length, by architecture family.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
LAYOUT = "verl's layout: prompt (chat messages or a string), data_source, reward_model {ground_truth}, extra_info"


class RowProblems:
    """Rows grouped by problem, so 10,000 bad rows make one issue, not 10,000."""

    def __init__(self, field: str, total: int) -> None:
        self.field = field
        self.total = total
        self._rows: dict[str, list[int]] = {}

    def add(self, row: int, problem: str) -> None:
        self._rows.setdefault(problem, []).append(row)

    def issues(self) -> list[Issue]:
        return [(self.field, f"{self._where(rows)}: {problem}") for problem, rows in self._rows.items()]

    def _where(self, rows: list[int]) -> str:
        if len(rows) == 1:
            return f"row {rows[0]}"
        shown = ", ".join(str(r) for r in rows[:MAX_ROWS_SHOWN])
        more = f" and {len(rows) - MAX_ROWS_SHOWN} more" if len(rows) > MAX_ROWS_SHOWN else ""
        every = "every row" if len(rows) == self.total else f"{len(rows)} of {self.total} rows"
        return f"rows {shown}{more} ({every})"


def check_data(cfg: RunConfig) -> list[Issue]:
    """Issues with the model's context, its tokenizer and the train and eval files.

    Assumes the basic file checks passed for what it reads (callers skip a missing folder)."""
    issues = check_context(cfg)
    tokenizer, tokenizer_issues = load_tokenizer(cfg)
    issues += tokenizer_issues
    datasets = [("data.train_files", cfg.data.train_files), ("data.eval_files", cfg.data.eval_files)]
    template_issue_added = False
    for field, path in datasets:
        if path is None:
            continue
        rows, file_issues = check_dataset(cfg, field, path, tokenizer)
        for issue in file_issues:
            # One "no chat template" issue, even when both datasets hold chat messages.
            if issue[0] == "model.path" and template_issue_added:
                continue
            template_issue_added |= issue[0] == "model.path"
            issues.append(issue)
        if field == "data.train_files" and rows is not None and rows < cfg.loop.prompts_per_step:
            issues.append(
                (
                    "loop.prompts_per_step",
                    f"{cfg.loop.prompts_per_step} prompts per step, but data.train_files has only {rows} rows, so a "
                    f"batch would hold the same prompt twice; set loop.prompts_per_step to at most {rows} or add rows",
                )
            )
    return issues


# --- the model -----------------------------------------------------------------------------


def context_length(model_path: str) -> int | None:
    """The context length a model folder's config.json declares, or None when it declares none."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text_config = config.get("text_config")  # multimodal models keep the LM's settings here
    for section in (config, text_config if isinstance(text_config, dict) else {}):
        for key in CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def check_context(cfg: RunConfig) -> list[Issue]:
    """Prompt plus response must fit every model that reads them (policy, critic, reward model)."""
    prompt, response = cfg.data.max_prompt_length, cfg.rollout.max_response_length
    readers = [("model.path", cfg.model.path), ("reward.model_path", cfg.reward.model_path)]
    if cfg.uses_critic:
        readers.append(("critic.model_path" if cfg.critic.model_path else "model.path", cfg.critic.model_path or cfg.model.path))
    issues: list[Issue] = []
    for field, path in dict.fromkeys(readers):
        limit = context_length(path) if path else None
        if limit is not None and prompt + response > limit:
            issues.append(
                (
                    "rollout.max_response_length",
                    f"data.max_prompt_length={prompt} + rollout.max_response_length={response} = {prompt + response} "
                    f"tokens exceed the context of {field} ({limit} tokens, from {path}/config.json); "
                    f"lower them to {limit} in total",
                )
            )
    return issues


def load_tokenizer(cfg: RunConfig) -> tuple[Any, list[Issue]]:
    """The policy's tokenizer, as the rollout loads it, and what it lacks for this run."""
    folder = Path(cfg.model.path)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None, [
            (
                "model.path",
                f"{folder} has no tokenizer ({', '.join(TOKENIZER_FILES)}); save it next to the weights "
                "(tokenizer.save_pretrained(folder)), or run `ratchet prepare` for the demo model",
            )
        ]
    try:
        from ratchet.hf_imports import load_tokenizer as load_hf_tokenizer  # this function's name

        tokenizer = load_hf_tokenizer(cfg.model.path)  # the check runs at every submit: seconds less (hf_imports.py)
    except Exception as exc:  # any failure to load is a problem of the model folder
        text = " ".join(str(exc).split())
        text = text if len(text) <= 300 else text[:297] + "..."
        return None, [("model.path", f"cannot load the tokenizer from {folder}: {type(exc).__name__}: {text}")]
    issues: list[Issue] = []
    if tokenizer.pad_token_id is None:
        # The rollout pads prompts and responses with it (workers/engines/hf.py); it does
        # not fall back to the eos token.
        issues.append(
            (
                "model.path",
                f"the tokenizer in {cfg.model.path} has no pad token, which the rollout pads batches with; "
                "set pad_token in its tokenizer_config.json (the eos token will do)",
            )
        )
    if tokenizer.eos_token_id is None and cfg.warmup.steps > 0:
        issues.append(
            (
                "model.path",
                f"the tokenizer in {cfg.model.path} has no eos token, which the warm-up appends to every answer; "
                "set eos_token in its tokenizer_config.json, or warmup.steps=0",
            )
        )
    # Whether it needs a chat template depends on each dataset's prompt format (check_dataset).
    return tokenizer, issues


# --- one dataset ---------------------------------------------------------------------------


def required_columns(cfg: RunConfig) -> dict[str, str]:
    """Column -> why the run needs it."""
    needed = {cfg.data.prompt_key: "the prompts (data.prompt_key)"}
    if cfg.reward.function is not None:
        needed["data_source"] = "reward.function receives it"
        needed["reward_model"] = "reward.function receives reward_model.ground_truth"
    elif cfg.warmup.steps > 0:
        needed["reward_model"] = "the warm-up trains on reward_model.ground_truth"
    return needed


def check_dataset(cfg: RunConfig, field: str, path: str, tokenizer: Any) -> tuple[int | None, list[Issue]]:
    """(row count, issues) of one dataset file; the count is None when the file cannot be read."""
    needed = required_columns(cfg)
    try:
        table = read_dataset(path, [*needed, "extra_info"])
    except DatasetFileError as exc:  # unknown format, not parquet, truncated, unreadable
        return None, [(field, str(exc))]
    if table.num_rows == 0:
        return 0, [(field, f"{path} has no rows")]
    missing = [column for column in needed if column not in table.column_names]
    if missing:
        hint = "; set data.prompt_key to the column that holds the prompts" if cfg.data.prompt_key in missing else ""
        details = "; ".join(f"{c!r} ({needed[c]})" for c in missing)
        columns = ", ".join(sorted(table.column_names)) or "none"
        return table.num_rows, [(field, f"missing columns {details}; its columns: {columns}; expected {LAYOUT}{hint}")]
    problems = RowProblems(field, table.num_rows)
    for row, why in table.unreadable.items():
        problems.add(row, why)
    prompts = table.columns[cfg.data.prompt_key]
    fmt = resolve_prompt_format(cfg.data.prompt_format, [p for i, p in enumerate(prompts) if i not in table.unreadable])
    issues: list[Issue] = []
    if fmt == "chat" and tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        issues.append(_no_template_issue(cfg, field))
        tokenizer = None  # prompts cannot be measured without one
    for row in range(table.num_rows):
        if row not in table.unreadable:
            check_row(cfg, {name: values[row] for name, values in table.columns.items()}, row, problems, fmt)
    if tokenizer is not None:
        check_prompt_lengths(cfg, tokenizer, prompts, problems, fmt, skip=table.unreadable)
    return table.num_rows, issues + problems.issues()


def _no_template_issue(cfg: RunConfig, field: str) -> Issue:
    why = (
        "with data.prompt_format=chat" if cfg.data.prompt_format == "chat" else "for its chat-message prompts (TRL's conversational format)"
    )
    return (
        "model.path",
        f"the tokenizer in {cfg.model.path} has no chat template, which {field} needs {why}; add a chat_template to "
        "its tokenizer_config.json or use an instruct model, or give the prompts as plain strings (TRL's standard "
        "format) with data.prompt_format=raw or auto",
    )


def check_row(cfg: RunConfig, row: dict[str, Any], index: int, problems: RowProblems, fmt: str = "chat") -> None:
    key = cfg.data.prompt_key
    problem = prompt_problem(row[key], fmt, cfg.data.prompt_format)  # type: ignore[arg-type]
    if problem is not None:
        problems.add(index, f"{key} {problem}")
    if "data_source" in row and not (isinstance(row["data_source"], str) and row["data_source"]):
        problems.add(
            index,
            f"data_source must be a non-empty string (the task name the reward function reads), got {describe_kind(row['data_source'])}",
        )
    if "reward_model" in row:
        spec = row["reward_model"]
        if not isinstance(spec, dict):
            problems.add(index, f"reward_model must be a mapping {{ground_truth: str, style?}}, got {describe_kind(spec)}")
        elif not isinstance(spec.get("ground_truth"), str):
            problems.add(
                index,
                f"reward_model.ground_truth must be a string, got {describe_kind(spec.get('ground_truth'))}; "
                "store answers as text (e.g. '42', not 42)",
            )
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        problems.add(index, f"extra_info must be a mapping or null, got {describe_kind(extra)}")


def check_prompt_lengths(
    cfg: RunConfig, tokenizer: Any, prompts: Sequence[Any], problems: RowProblems, fmt: str = "chat", skip: Any = ()
) -> None:
    """Tokenize the well-formed prompts in one batch and flag those over data.max_prompt_length."""
    setting = cfg.data.prompt_format
    rows = [i for i, p in enumerate(prompts) if i not in skip and prompt_problem(p, fmt, setting) is None]  # type: ignore[arg-type]
    if not rows:
        return
    try:
        lengths = dict(zip(rows, (len(ids) for ids in encode_prompts(tokenizer, [prompts[i] for i in rows], fmt))))  # type: ignore[arg-type]
    except Exception:
        # The chat template refused some conversation (e.g. roles that do not alternate):
        # find which, one row at a time; only this failure path pays per row.
        lengths = {}
        for i in rows:
            try:
                lengths[i] = len(encode_prompts(tokenizer, [prompts[i]], fmt)[0])  # type: ignore[arg-type]
            except Exception as exc:
                problems.add(i, f"the tokenizer's chat template refuses this prompt: {type(exc).__name__}: {_first_line(exc)}")
    limit = cfg.data.max_prompt_length
    too_long = [i for i, n in lengths.items() if n > limit]
    how = "with the chat template" if fmt == "chat" else "as raw text (data.prompt_format)"
    if too_long:
        longest = max(lengths[i] for i in too_long)
        for i in too_long:
            problems.add(
                i,
                f"prompt is longer than data.max_prompt_length={limit} tokens {how} (the longest has "
                f"{longest}); raise data.max_prompt_length or drop these rows",
            )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
