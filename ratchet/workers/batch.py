"""The typed batch that travels between rollout, reward and trainer workers.

Layout: each row is one sample. `prompt_ids` is left-padded to the batch's longest
prompt, `response_ids` right-padded, so `cat(prompt_ids, response_ids)` is a valid causal
sequence. Per-token tensors (`rollout_logprobs`, `policy_version`) align with
`response_ids`: every token records the policy version that produced it, which the async
loops need to bound staleness.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ratchet.storage import BatchStore

TENSOR_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logprobs", "policy_version", "prompt_index")


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # [B, P] int64, left-padded
    prompt_mask: torch.Tensor  # [B, P] int64
    response_ids: torch.Tensor  # [B, R] int64, right-padded
    response_mask: torch.Tensor  # [B, R] float32: 1 on generated tokens up to and including EOS
    rollout_logprobs: torch.Tensor  # [B, R] float32, behaviour log-probs from the engine
    policy_version: torch.Tensor  # [B, R] int64, version that sampled each token
    prompt_index: torch.Tensor  # [B] int64, global prompt index: the GRPO group id
    samples: list[dict] = field(default_factory=list)  # per row: data_source, ground_truth, extra_info

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)

    def select(self, rows: torch.Tensor | slice) -> "RolloutBatch":
        idx = torch.arange(len(self))[rows]
        return RolloutBatch(
            **{name: getattr(self, name)[idx] for name in TENSOR_FIELDS},
            samples=[self.samples[i] for i in idx.tolist()],
        )

    def save(self, store: BatchStore, step: int) -> str:
        return store.write(step, "rollout", {n: getattr(self, n) for n in TENSOR_FIELDS}, {"samples": self.samples})

    @classmethod
    def load(cls, store: BatchStore, step: int) -> "RolloutBatch":
        tensors, meta = store.read(step, "rollout")
        return cls(**{n: tensors[n] for n in TENSOR_FIELDS}, samples=meta["samples"])


def save_scores(store: BatchStore, step: int, rewards: torch.Tensor, extras: list[dict]) -> str:
    return store.write(step, "scores", {"reward": rewards.float()}, {"extras": extras})


def load_scores(store: BatchStore, step: int) -> tuple[torch.Tensor, list[dict]]:
    tensors, meta = store.read(step, "scores")
    return tensors["reward"], meta["extras"]
