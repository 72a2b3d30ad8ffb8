"""The typed batch that travels between rollout, reward and trainer workers.

Layout: each row is one sample. `prompt_ids` is left-padded to the batch's longest
prompt, `response_ids` right-padded, so `cat(prompt_ids, response_ids)` is a valid causal
sequence. Per-token tensors (`rollout_logprobs`, `policy_version`) align with
`response_ids`: every token records the policy version that produced it, which the async
loops need to bound staleness.

Padding: one rule wherever a batch is laid out (`pack`, after generation) or joined
(`concat`: replica shares, rollout rounds, a stored step read back): padded positions hold
token id `PAD_ID` (0) and mask 0. Every reader goes by the masks (attention, loss, and
decoding by span), so any valid id would do; one value means a batch has the same bytes
whichever path built it (generated whole, joined from shares, handed over in memory,
stored and read back).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ratchet.algorithms.dapo import dynamic_sampling_keep
from ratchet.algorithms.advantages import remax_baselines, response_span_lengths

from .columns import Fields, Parts, part_name
from .results import ScoreResult

if TYPE_CHECKING:
    # Only the type: the batch's save/load take the store they are given, so the trainer's
    # math (and the GPU check, on a machine without tenacity) never imports the storage layer.
    from ratchet.storage.batch_store import BatchStore

PAD_ID = 0  # the token id of every padded position (module docstring)
TENSOR_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logprobs", "policy_version", "prompt_index")


@dataclass
class SampleRow:
    """One generated sample before padding: what `RolloutBatch.pack` lays out as a row."""

    prompt: list[int]  # the prompt's token ids
    tokens: list[int]  # the response's token ids
    logprobs: list[float]  # behaviour log-probs, one per response token
    versions: list[int]  # the policy version that produced each response token
    prompt_index: int
    sample: dict  # data_source, ground_truth, extra_info, ...
    mask: list[float] | None = None  # per response token; None: all 1 (holes: multi-turn tool output)


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

    @classmethod
    def pack(cls, rows: list[SampleRow]) -> "RolloutBatch":
        """The batch of `rows`: prompts left-padded, responses right-padded (see the module docstring)."""
        b = len(rows)
        prompt_w = max(len(r.prompt) for r in rows)
        resp_w = max(1, max(len(r.tokens) for r in rows))
        prompt_ids = torch.full((b, prompt_w), PAD_ID, dtype=torch.long)
        prompt_mask = torch.zeros((b, prompt_w), dtype=torch.long)
        response_ids = torch.full((b, resp_w), PAD_ID, dtype=torch.long)
        response_mask = torch.zeros((b, resp_w), dtype=torch.float32)
        logprobs = torch.zeros((b, resp_w), dtype=torch.float32)
        versions = torch.zeros((b, resp_w), dtype=torch.long)
        for i, row in enumerate(rows):
            prompt_ids[i, prompt_w - len(row.prompt) :] = torch.tensor(row.prompt)
            prompt_mask[i, prompt_w - len(row.prompt) :] = 1
            k = len(row.tokens)
            if k:
                response_ids[i, :k] = torch.tensor(row.tokens)
                response_mask[i, :k] = 1.0 if row.mask is None else torch.tensor(row.mask)
                logprobs[i, :k] = torch.tensor(row.logprobs)
                versions[i, :k] = torch.tensor(row.versions)
        return cls(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            rollout_logprobs=logprobs,
            policy_version=versions,
            prompt_index=torch.tensor([r.prompt_index for r in rows], dtype=torch.long),
            samples=[r.sample for r in rows],
        )

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        # The response is context up to its last response token, holes included: tool output
        # inside a multi-turn response has mask 0 (no loss) but the model saw it.
        span = response_span_lengths(self.response_mask).unsqueeze(-1)
        positions = torch.arange(self.response_mask.shape[1], device=span.device)
        return torch.cat([self.prompt_mask, (positions < span).to(self.prompt_mask.dtype)], dim=1)

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
    def concat(cls, parts: list["RolloutBatch"]) -> "RolloutBatch":
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
            prompt_ids=torch.cat([left(b.prompt_ids, PAD_ID) for b in parts]),
            prompt_mask=torch.cat([left(b.prompt_mask, 0) for b in parts]),
            response_ids=torch.cat([right(b.response_ids, PAD_ID) for b in parts]),
            response_mask=torch.cat([right(b.response_mask, 0.0) for b in parts]),
            rollout_logprobs=torch.cat([right(b.rollout_logprobs, 0.0) for b in parts]),
            policy_version=torch.cat([right(b.policy_version, 0) for b in parts]),
            prompt_index=torch.cat([b.prompt_index for b in parts]),
            samples=[s for b in parts for s in b.samples],
        )


def save_scores(
    store: BatchStore, batch_index: int, rewards: torch.Tensor, extras: list[dict], name: str = Parts.SCORES,
    costs: torch.Tensor | None = None, keep: torch.Tensor | None = None,
) -> str:  # fmt: skip
    """`costs` (Safe-RLHF) and `keep` (a rollout filter's verdicts) are stored only when given."""
    tensors = {Fields.REWARD: rewards.float()}
    if costs is not None:
        tensors[Fields.COST] = costs.float()
    if keep is not None:
        tensors[Fields.KEEP] = keep.bool()
    return store.write(batch_index, name, tensors, {Fields.EXTRAS: extras})


def load_scores(store: BatchStore, batch_index: int, name: str = Parts.SCORES) -> tuple[torch.Tensor, list[dict]]:
    return read_scores(store, batch_index, name)[:2]


def read_scores(
    store: BatchStore, batch_index: int, name: str = Parts.SCORES
) -> tuple[torch.Tensor, list[dict], torch.Tensor | None, torch.Tensor | None]:
    """Rewards, extras, and the costs and filter verdicts (None where the run has none)."""
    tensors, meta = store.read(batch_index, name)
    return tensors[Fields.REWARD], meta[Fields.EXTRAS], tensors.get(Fields.COST), tensors.get(Fields.KEEP)


@dataclass
class ScoredStep:
    """Everything the trainer needs about one step: all rollout rounds, concatenated."""

    batch: RolloutBatch
    rewards: torch.Tensor  # [B]
    baseline_rewards: torch.Tensor | None  # [B] (ReMax), aligned with batch rows
    costs: torch.Tensor | None = None  # [B] Safe-RLHF costs (safety.cost_*)
    keep: torch.Tensor | None = None  # [B] bool, the rollout filter's verdicts (rollout.filter)


def load_step(store: BatchStore, batch_index: int, parts: int = 1) -> ScoredStep:
    """The stored batch `batch_index` (its `parts` rollout rounds) as one training step's input."""
    batches = [RolloutBatch.load(store, batch_index, part_name(Parts.ROLLOUT, p)) for p in range(parts)]
    rounds = [read_scores(store, batch_index, part_name(Parts.SCORES, p)) for p in range(parts)]
    rewards = torch.cat([r[0] for r in rounds])
    costs = torch.cat([r[2] for r in rounds]) if rounds[0][2] is not None else None
    keep = torch.cat([r[3] for r in rounds]) if rounds[0][3] is not None else None
    batch = RolloutBatch.concat(batches)
    baseline = None
    if store.has(batch_index, part_name(Parts.BASELINE_SCORES, 0)):
        greedy = [RolloutBatch.load(store, batch_index, part_name(Parts.BASELINE, p)).prompt_index for p in range(parts)]
        scores = [load_scores(store, batch_index, part_name(Parts.BASELINE_SCORES, p))[0] for p in range(parts)]
        baseline = remax_baselines(batch.prompt_index, torch.cat(greedy), torch.cat(scores))
    return ScoredStep(batch=batch, rewards=rewards, baseline_rewards=baseline, costs=costs, keep=keep)


# -- a batch handed from actor to actor in memory (sync mode's `step` activity) ----------


def score_summary(rewards: torch.Tensor, prompt_index: torch.Tensor, seconds: float) -> ScoreResult:
    """The numbers the workflow sees of a scored batch."""
    keep = dynamic_sampling_keep(rewards, prompt_index)
    return ScoreResult(
        reward_mean=float(rewards.mean().item()),
        reward_std=float(rewards.std().item()) if len(rewards) > 1 else 0.0,
        num_samples=len(rewards),
        informative_groups=int(torch.unique(prompt_index[keep]).numel()),
        seconds=seconds,
    )


@dataclass
class StepScores:
    """The reward worker's scores of one rollout round (and of its ReMax baseline): stored
    next to a stored batch, or handed to the trainer with a batch handed over in memory."""

    rewards: torch.Tensor  # [B]
    extras: list[dict]
    result: ScoreResult
    baseline_rewards: torch.Tensor | None = None  # [prompts], ReMax
    baseline_extras: list[dict] | None = None
    costs: torch.Tensor | None = None  # [B], Safe-RLHF
    keep: torch.Tensor | None = None  # [B] bool, the rollout filter's verdicts

    def save(self, store: BatchStore, batch_index: int, part: int = 0) -> None:
        """As round `part`'s `scores` (and `baseline-scores`) of batch `batch_index`."""
        save_scores(store, batch_index, self.rewards, self.extras, part_name(Parts.SCORES, part), self.costs, self.keep)
        if self.baseline_rewards is not None:
            save_scores(store, batch_index, self.baseline_rewards, self.baseline_extras or [], part_name(Parts.BASELINE_SCORES, part))


@dataclass(frozen=True)
class HandedSummary:
    """What the `step` activity reports of the batch a trainer rank updated on: taken from
    the batch itself, so a retried step reports the batch that was really trained on."""

    num_samples: int
    num_response_tokens: int
    response_length_mean: float
    generate_seconds: float
    policy_version: int  # the oldest version among its tokens' (the one generation started with)
    score: ScoreResult


def join_shares(shares: list) -> tuple[RolloutBatch, RolloutBatch | None]:
    """The batch (and ReMax baseline) of the rollout shares (`results.RolloutShare`, in
    order): the one join, whoever holds the shares (the reward worker scores it,
    `RolloutWorker.save_shares` stores it, `load_step` reads back the same tensors)."""
    batch = RolloutBatch.concat([s.batch for s in shares])
    baseline = RolloutBatch.concat([s.baseline for s in shares]) if shares[0].baseline is not None else None
    return batch, baseline


@dataclass
class HandedStep:
    """One training step's input (one rollout round) as the trainer got it from the rollout
    and reward workers through Ray's object store, and stored as those would have stored
    it: the parts `rollout`, `baseline`, `scores`, `baseline-scores` of the batch, which
    recovery replays (`load_step` reads them back to the same tensors)."""

    batch: RolloutBatch
    baseline: RolloutBatch | None
    scores: StepScores
    generate_seconds: float = 0.0
    policy_version: int = 0

    @classmethod
    def from_shares(cls, scores: StepScores, shares: list) -> "HandedStep":
        """The batch of the rollout shares (`results.RolloutShare`, in order) with its scores."""
        batch, baseline = join_shares(shares)
        return cls(
            batch=batch,
            baseline=baseline,
            scores=scores,
            generate_seconds=max(s.generate_seconds for s in shares),
            policy_version=min(s.policy_version for s in shares),
        )

    @classmethod
    def load(cls, store: BatchStore, batch_index: int) -> "HandedStep":
        """A stored step read back (a retried step whose trainer kept no handed batch)."""
        batch = RolloutBatch.load(store, batch_index, Parts.ROLLOUT)
        rewards, extras, costs, keep = read_scores(store, batch_index, Parts.SCORES)
        baseline, base_rewards, base_extras = None, None, None
        if store.has(batch_index, Parts.BASELINE_SCORES):
            baseline = RolloutBatch.load(store, batch_index, Parts.BASELINE)
            base_rewards, base_extras = load_scores(store, batch_index, Parts.BASELINE_SCORES)
        scores = StepScores(rewards, extras, score_summary(rewards, batch.prompt_index, 0.0), base_rewards, base_extras, costs, keep)
        version = int(batch.policy_version[batch.response_mask > 0].min().item()) if batch.response_mask.any() else 0
        return cls(batch=batch, baseline=baseline, scores=scores, policy_version=version)

    def scored_step(self) -> ScoredStep:
        baseline = None
        if self.baseline is not None:
            baseline = remax_baselines(self.batch.prompt_index, self.baseline.prompt_index, self.scores.baseline_rewards)
        s = self.scores
        return ScoredStep(batch=self.batch, rewards=s.rewards, baseline_rewards=baseline, costs=s.costs, keep=s.keep)

    def save(self, store: BatchStore, batch_index: int) -> None:
        """Store it as part 0 of batch `batch_index` (a retry overwrites the same keys);
        the scores last, as the reward worker writes them after the rollout."""
        if self.baseline is not None:
            self.baseline.save(store, batch_index, Parts.BASELINE)
        self.batch.save(store, batch_index, Parts.ROLLOUT)
        self.scores.save(store, batch_index)

    def summary(self) -> HandedSummary:
        lengths = self.batch.response_mask.sum(-1)
        return HandedSummary(
            num_samples=len(self.batch),
            num_response_tokens=int(lengths.sum().item()),
            response_length_mean=float(lengths.float().mean().item()),
            generate_seconds=self.generate_seconds,
            policy_version=self.policy_version,
            score=self.scores.result,
        )
