"""The names inside the batch store, in one place (as RLlib's `Columns`).

A step's parts are files `<kind>/step-NNNNNN/<part>[-k].safetensors` (`k`: the DAPO
refill round, `part_name`); each holds named tensors and a JSON header.
"""

from __future__ import annotations


class Parts:
    """The parts of a stored step, and who writes them."""

    ROLLOUT = "rollout"  # RolloutWorker: the sampled responses (RolloutBatch)
    BASELINE = "baseline"  # RolloutWorker, ReMax: one greedy response per prompt
    SCORES = "scores"  # RewardWorker: rewards of ROLLOUT
    BASELINE_SCORES = "baseline-scores"  # RewardWorker, ReMax: rewards of BASELINE
    VALUES = "values"  # CriticWorker: value estimates of the response tokens
    ADVANTAGES = "advantages"  # TrainerWorker rank 0: advantages and returns


class Fields:
    """Tensor and header names inside the parts."""

    REWARD = "reward"  # in SCORES, BASELINE_SCORES: [B]
    EXTRAS = "extras"  # their header: per sample, the extra numbers a reward function gave
    VALUES = "values"  # in VALUES: [B, R]
    ADVANTAGES = "advantages"  # in ADVANTAGES: [B, R]
    RETURNS = "returns"  # in ADVANTAGES: [B, R], the critic's targets
    COST = "cost"  # in SCORES, Safe-RLHF only (safety.cost_*): [B], the cost of each sample
    KEEP = "keep"  # in SCORES, with a rollout filter only (rollout.filter): [B] bool, False: dropped from the loss
    SAMPLES = "samples"  # ROLLOUT's header: per row, data_source, ground_truth, extra_info


def part_name(base: str, part: int) -> str:
    """File names of a step's rollout rounds: `rollout`, `rollout-1`, ... (DAPO refills add rounds)."""
    return base if part == 0 else f"{base}-{part}"
