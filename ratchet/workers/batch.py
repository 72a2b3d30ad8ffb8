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

from ratchet.algorithms import remax_baselines
from ratchet.storage import BatchStore

from .columns import Fields, Parts, part_name

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

    def save(self, store: BatchStore, batch_index: int, name: str = Parts.ROLLOUT) -> str:
        return store.write(batch_index, name, {n: getattr(self, n) for n in TENSOR_FIELDS}, {Fields.SAMPLES: self.samples})

    @classmethod
    def load(cls, store: BatchStore, batch_index: int, name: str = Parts.ROLLOUT) -> "RolloutBatch":
        tensors, meta = store.read(batch_index, name)
        return cls(**{n: tensors[n] for n in TENSOR_FIELDS}, samples=meta[Fields.SAMPLES])

    @classmethod
    def concat(cls, parts: list["RolloutBatch"], pad_id: int) -> "RolloutBatch":
        """Rows of all parts; prompts re-left-padded and responses re-right-padded to the widest."""
        if len(parts) == 1:
            return parts[0]
        p_w = max(b.prompt_ids.shape[1] for b in parts)
        r_w = max(b.response_ids.shape[1] for b in parts)

        def left(t: torch.Tensor, fill) -> torch.Tensor:
            return torch.nn.functional.pad(t, (p_w - t.shape[1], 0), value=fill)

        def right(t: torch.Tensor, fill) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, r_w - t.shape[1]), value=fill)

        return cls(
            prompt_ids=torch.cat([left(b.prompt_ids, pad_id) for b in parts]),
            prompt_mask=torch.cat([left(b.prompt_mask, 0) for b in parts]),
            response_ids=torch.cat([right(b.response_ids, pad_id) for b in parts]),
            response_mask=torch.cat([right(b.response_mask, 0.0) for b in parts]),
            rollout_logprobs=torch.cat([right(b.rollout_logprobs, 0.0) for b in parts]),
            policy_version=torch.cat([right(b.policy_version, 0) for b in parts]),
            prompt_index=torch.cat([b.prompt_index for b in parts]),
            samples=[s for b in parts for s in b.samples],
        )


def save_scores(store: BatchStore, batch_index: int, rewards: torch.Tensor, extras: list[dict], name: str = Parts.SCORES) -> str:
    return store.write(batch_index, name, {Fields.REWARD: rewards.float()}, {Fields.EXTRAS: extras})


def load_scores(store: BatchStore, batch_index: int, name: str = Parts.SCORES) -> tuple[torch.Tensor, list[dict]]:
    tensors, meta = store.read(batch_index, name)
    return tensors[Fields.REWARD], meta[Fields.EXTRAS]


@dataclass
class ScoredStep:
    """Everything the trainer needs about one step: all rollout rounds, concatenated."""

    batch: RolloutBatch
    rewards: torch.Tensor  # [B]
    baseline_rewards: torch.Tensor | None  # [B] (ReMax), aligned with batch rows


def load_step(store: BatchStore, batch_index: int, parts: int = 1) -> ScoredStep:
    """The stored batch `batch_index` (its `parts` rollout rounds) as one training step's input."""
    # Padding positions are masked out everywhere, so any valid id (0) can fill them.
    batches = [RolloutBatch.load(store, batch_index, part_name(Parts.ROLLOUT, p)) for p in range(parts)]
    rewards = torch.cat([load_scores(store, batch_index, part_name(Parts.SCORES, p))[0] for p in range(parts)])
    batch = RolloutBatch.concat(batches, pad_id=0)
    baseline = None
    if store.has(batch_index, part_name(Parts.BASELINE_SCORES, 0)):
        greedy = [RolloutBatch.load(store, batch_index, part_name(Parts.BASELINE, p)).prompt_index for p in range(parts)]
        scores = [load_scores(store, batch_index, part_name(Parts.BASELINE_SCORES, p))[0] for p in range(parts)]
        baseline = remax_baselines(batch.prompt_index, torch.cat(greedy), torch.cat(scores))
    return ScoredStep(batch=batch, rewards=rewards, baseline_rewards=baseline)
