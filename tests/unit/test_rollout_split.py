"""Splitting a batch over rollout replicas (workers/actors/rollout_pool.py) in-process: the
shares by load, and the per-prompt seeds that make a split batch sample what one engine
samples (the real HF engine on the tiny model; the Ray side is
tests/integration/test_rollout_pool.py)."""

from __future__ import annotations

import pytest
import torch

from ratchet.workers.actors.rollout_pool import Share, plan_shares, split_by_load
from ratchet.workers.batch import RolloutBatch
from ratchet.workers.engines.hf import HFEngine
from ratchet.workers.engines.base import SamplingParams
from ratchet.workers.prompts import PromptSet
from ratchet.workers.batch_seeds import prompt_seeds
from ratchet.workers.rollout_batching import generate_batch

torch.set_num_threads(1)


def test_split_by_load_fills_the_least_loaded_first():
    assert split_by_load(7, [0, 0]) == [4, 3]
    assert split_by_load(7, [4, 0]) == [2, 5]  # ends 6 and 5
    assert split_by_load(3, [0, 9, 9]) == [3, 0, 0]
    assert split_by_load(2, [0, 0, 0]) == [1, 1, 0]
    assert sum(split_by_load(100, [3, 1, 4, 1])) == 100


def test_shares_are_contiguous_whole_prompts_in_position_order():
    shares = plan_shares(10, 7, 0, [0, 1], [0, 0])
    assert shares == [Share(0, 10, 4, 0), Share(1, 14, 3, 4)]
    # A lost share redone over the healthy replicas keeps its positions (so its seeds).
    assert plan_shares(14, 3, 4, [0, 2], [0, 1]) == [Share(0, 14, 2, 4), Share(2, 16, 1, 6)]
    assert plan_shares(0, 1, 0, [0, 1, 2], [0, 0, 0]) == [Share(0, 0, 1, 0)]  # no empty shares


def test_prompt_seeds_depend_on_the_position_only():
    seeds = prompt_seeds(12345, 0, 6)
    assert len(set(seeds)) == 6 and all(0 <= s < 2**63 for s in seeds)
    assert prompt_seeds(12345, 4, 2) == seeds[4:]
    assert prompt_seeds(12346, 0, 6) != seeds


@pytest.fixture(scope="module")
def engine_and_prompts(tiny_model, tmp_path_factory):
    from ratchet.tasks.generate import write_task_parquet

    path = write_task_parquet(tmp_path_factory.mktemp("split") / "copy.parquet", "copy", 16, seed=2, min_len=1, max_len=6)
    engine = HFEngine(str(tiny_model))
    return engine, PromptSet(str(path), engine.tokenizer, prompt_key="prompt", max_prompt_length=64)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_a_split_batch_samples_what_one_engine_samples(engine_and_prompts, temperature, top_p):
    """Ragged prompts split 3 + 5 + 2, each share on its own call: the joined batch has the
    whole batch's tokens; log-probs agree up to float rounding of other batch shapes."""
    engine, prompts = engine_and_prompts
    params = SamplingParams(n=4, max_new_tokens=8, seed=77, temperature=temperature, top_p=top_p)
    indices = list(range(10))
    whole = generate_batch(engine, prompts, indices, params, policy_version=0)
    parts = [
        generate_batch(engine, prompts, indices[a:b], params, policy_version=0, first_position=a) for a, b in ((0, 3), (3, 8), (8, 10))
    ]
    joined = RolloutBatch.concat(parts)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "policy_version", "prompt_index"):
        assert torch.equal(getattr(joined, name), getattr(whole, name)), name
    torch.testing.assert_close(joined.rollout_logprobs, whole.rollout_logprobs, rtol=0, atol=1e-5)
    # Sampled, not degenerate: a group's rows differ, and another seed samples otherwise.
    assert len({tuple(r.tolist()) for r in whole.response_ids}) > len(indices)
    other = generate_batch(engine, prompts, indices, SamplingParams(n=4, max_new_tokens=8, seed=78), policy_version=0)
    assert not torch.equal(other.response_ids, whole.response_ids)


def test_a_joined_batch_has_the_same_bytes_handed_over_or_stored_and_read_back(engine_and_prompts, tmp_path, monkeypatch):
    """One pad rule (workers/batch.py, PAD_ID): shares of different widths joined in memory
    (the fused step's HandedStep) and joined by the rollout worker's store then read back
    (load_step, the per-phase path and recovery) are equal to the last byte, even where
    the engine's own pad id is another token."""
    from ratchet.storage.batch_store import BatchStore
    from ratchet.storage.object_store import ObjectStore
    from ratchet.workers.batch import PAD_ID, HandedStep, StepScores, load_step, save_scores
    from ratchet.workers.results import RolloutShare, ScoreResult

    engine, prompts = engine_and_prompts
    monkeypatch.setattr(engine, "pad_id", 7)  # a real token of the tiny vocabulary: never used to pad
    params = SamplingParams(n=2, max_new_tokens=8, seed=5)
    parts = [generate_batch(engine, prompts, list(range(a, b)), params, policy_version=0, first_position=a) for a, b in ((0, 1), (1, 4))]
    assert parts[0].prompt_ids.shape[1] != parts[1].prompt_ids.shape[1]  # re-padding happens
    shares = [RolloutShare(batch=p, baseline=None, generate_seconds=0.0, policy_version=0) for p in parts]
    rewards = torch.arange(sum(len(p) for p in parts), dtype=torch.float32)
    handed = HandedStep.from_shares(StepScores(rewards, [{}] * len(rewards), ScoreResult(0.0, 0.0, len(rewards), 0, 0.0)), shares)
    store = BatchStore(ObjectStore(str(tmp_path)))
    RolloutBatch.concat(parts).save(store, 0)
    save_scores(store, 0, rewards, [{}] * len(rewards))
    stored = load_step(store, 0).batch
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logprobs", "policy_version", "prompt_index"):
        assert torch.equal(getattr(handed.batch, name), getattr(stored, name)), name
    assert handed.batch.prompt_ids[handed.batch.prompt_mask == 0].eq(PAD_ID).all()
    assert handed.batch.response_ids[handed.batch.response_mask == 0].eq(PAD_ID).all()
