"""Apply a verl-signature reward function to a batch's decoded responses."""

from __future__ import annotations

from typing import Callable

import torch

from .batch import RolloutBatch


def score_batch(batch: RolloutBatch, tokenizer, reward_fn: Callable) -> tuple[torch.Tensor, list[dict]]:
    """Rewards [B] and, per sample, the extra numbers a dict-returning function gave."""
    rewards, extras = [], []
    for row, info in enumerate(batch.samples):
        n = int(batch.response_mask[row].sum().item())
        text = tokenizer.decode(batch.response_ids[row, :n].tolist(), skip_special_tokens=True)
        out = reward_fn(
            data_source=info["data_source"], solution_str=text, ground_truth=info["ground_truth"], extra_info=info["extra_info"]
        )
        if isinstance(out, dict):
            if "score" not in out:
                raise ValueError(f"reward function returned a dict without 'score': {sorted(out)}")
            rewards.append(float(out["score"]))
            extras.append({k: float(v) for k, v in out.items() if k != "score" and isinstance(v, (int, float))})
        else:
            rewards.append(float(out))
            extras.append({})
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
        for row in range(len(batch)):
            prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
            n = int(batch.response_mask[row].sum().item())
            texts.append(
                policy_tokenizer.decode(prompt, skip_special_tokens=True)
                + " "
                + policy_tokenizer.decode(batch.response_ids[row, :n].tolist(), skip_special_tokens=True)
            )
        enc = self.tokenizer(texts, return_tensors="pt", padding=True)
        return self.model(**enc).logits[:, 0].float()
