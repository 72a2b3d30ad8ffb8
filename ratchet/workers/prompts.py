"""Prompts of a verl-layout parquet file, tokenized once with the model's chat template."""

from __future__ import annotations

import pyarrow.parquet as pq

from ratchet.config.dataset_check import encode_prompts


class PromptSet:
    def __init__(self, path: str, tokenizer, *, prompt_key: str = "prompt", max_prompt_length: int = 1024):
        table = pq.read_table(path).to_pylist()
        if not table:
            raise ValueError(f"{path}: no rows")
        self.rows = table
        # The same encoding the submit-time check measured (config/dataset_check.py).
        self.token_ids = encode_prompts(tokenizer, [row[prompt_key] for row in table])
        for i, ids in enumerate(self.token_ids):
            if len(ids) > max_prompt_length:
                raise ValueError(f"{path} row {i}: prompt has {len(ids)} tokens > data.max_prompt_length={max_prompt_length}")

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
