"""A dataset's prompts, tokenized once: through the chat template or as raw text
(src/ratchet/data/prompt_format.py), from parquet, JSON Lines or a save_to_disk folder."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ratchet.data.files import read_dataset
from ratchet.data.prompt_format import encode_prompts, prompt_problem, resolve_prompt_format

if TYPE_CHECKING:
    from ratchet.config.schema import DataConfig

# What a prompt's reward needs besides its prompt (verl's layout).
SAMPLE_COLUMNS = ("data_source", "reward_model", "extra_info")


class PromptSet:
    def __init__(self, path: str, tokenizer, *, prompt_key: str = "prompt", max_prompt_length: int = 1024, prompt_format: str = "auto"):
        table = read_dataset(path, [prompt_key, *SAMPLE_COLUMNS])
        if table.num_rows == 0:
            raise ValueError(f"{path}: no rows")
        if table.unreadable:
            row, why = next(iter(table.unreadable.items()))
            raise ValueError(f"{path} row {row}: {why}")
        if prompt_key not in table.columns:
            raise ValueError(f"{path}: no column {prompt_key!r} (data.prompt_key); its columns: {', '.join(table.column_names)}")
        self.rows = table.rows()
        prompts = table.columns[prompt_key]
        # The same format and encoding the submit-time check measured (config/dataset_check.py).
        self.prompt_format = resolve_prompt_format(prompt_format, prompts)
        for i, prompt in enumerate(prompts):
            problem = prompt_problem(prompt, self.prompt_format, prompt_format)
            if problem is not None:
                raise ValueError(f"{path} row {i}: {prompt_key} {problem}")
        self.token_ids = encode_prompts(tokenizer, prompts, self.prompt_format)
        for i, ids in enumerate(self.token_ids):
            if len(ids) > max_prompt_length:
                raise ValueError(f"{path} row {i}: prompt has {len(ids)} tokens > data.max_prompt_length={max_prompt_length}")

    @classmethod
    def from_config(cls, data: DataConfig, path: str, tokenizer) -> PromptSet:
        """The prompts of `path` (data.train_files or data.eval_files) as `data` says to read them."""
        return cls(path, tokenizer, prompt_key=data.prompt_key, max_prompt_length=data.max_prompt_length, prompt_format=data.prompt_format)

    def __len__(self) -> int:
        return len(self.rows)

    def sample_info(self, index: int) -> dict:
        """What the reward function needs about a prompt; JSON-serialisable."""
        row = self.rows[index]
        return {
            "data_source": row.get("data_source") or "",
            "ground_truth": (row.get("reward_model") or {}).get("ground_truth", ""),
            "extra_info": row.get("extra_info") or {},
        }
