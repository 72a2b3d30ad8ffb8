"""Prompts of a verl-layout parquet file, tokenized once with the model's chat template."""

from __future__ import annotations

import pyarrow.parquet as pq


class PromptSet:
    def __init__(self, path: str, tokenizer, *, prompt_key: str = "prompt", max_prompt_length: int = 1024):
        table = pq.read_table(path).to_pylist()
        if not table:
            raise ValueError(f"{path}: no rows")
        self.rows = table
        self.token_ids: list[list[int]] = []
        for i, row in enumerate(table):
            messages = row[prompt_key]
            ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            if len(ids) > max_prompt_length:
                raise ValueError(f"{path} row {i}: prompt has {len(ids)} tokens > data.max_prompt_length={max_prompt_length}")
            self.token_ids.append(list(ids))

    def __len__(self) -> int:
        return len(self.rows)

    def sample_info(self, index: int) -> dict:
        """What the reward function needs about a prompt; JSON-serialisable."""
        row = self.rows[index]
        return {
            "data_source": row.get("data_source", ""),
            "ground_truth": (row.get("reward_model") or {}).get("ground_truth", ""),
            "extra_info": row.get("extra_info") or {},
        }
