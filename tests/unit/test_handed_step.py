"""Sync mode's `step` activity hands the batch from actor to actor in memory; the reward
worker stores it while trainer rank 0 updates on it (workers/batch.py `HandedStep`,
`RewardWorker.store_handed`, `TrainerWorker.train_handed`). What durability needs of it,
checked in-process (the real trainer and reward worker, no Ray):

- the stored batch reads back (`load_step`, what recovery replays) to exactly the tensors
  trained on, so a replay makes the same update bit for bit;
- a first try leaves the storing to the reward worker (a trainer thread serialising it
  would hold the trainer's GIL during the update);
- a retried call whose first try updated makes no second update, and reports and stores
  the batch the update used, also when the retry hands over nothing or a different batch.
"""

from __future__ import annotations

import torch

from ratchet.models.tiny import VOCAB
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout
from ratchet.workers.batch import HandedStep, RolloutBatch, StepScores, load_step, score_summary
from ratchet.workers.results import RolloutShare

from ..configs import make_cfg

DIGITS = [VOCAB.index(str(d)) for d in range(10)]
BOS, EOS, PAD = VOCAB.index("<bos>"), VOCAB.index("<eos>"), VOCAB.index("<pad>")


def share(seed: int, prompts: list[int], n: int = 4, prompt_len: int = 5, response_len: int = 6) -> RolloutShare:
    g = torch.Generator().manual_seed(seed)
    digits = torch.tensor(DIGITS)
    rows = len(prompts) * n
    prompt = digits[torch.randint(0, 10, (rows, prompt_len), generator=g)]
    prompt[:, 0] = BOS
    response = digits[torch.randint(0, 10, (rows, response_len), generator=g)]
    mask = torch.ones(rows, response_len)
    response[1, 2], response[1, 3:], mask[1, 3:] = EOS, PAD, 0.0  # one shorter answer
    batch = RolloutBatch(
        prompt_ids=prompt,
        prompt_mask=torch.ones(rows, prompt_len, dtype=torch.long),
        response_ids=response,
        response_mask=mask,
        rollout_logprobs=-2.0 - torch.rand(rows, response_len, generator=g),
        policy_version=torch.zeros(rows, response_len, dtype=torch.long),
        prompt_index=torch.tensor([p for p in prompts for _ in range(n)]),
        samples=[{"ground_truth": str(p)} for p in prompts for _ in range(n)],
    )
    return RolloutShare(batch=batch, baseline=None, generate_seconds=0.5, policy_version=0)


def scores_for(shares: list[RolloutShare], seed: int) -> StepScores:
    index = torch.cat([s.batch.prompt_index for s in shares])
    rewards = torch.rand(len(index), generator=torch.Generator().manual_seed(seed))
    return StepScores(rewards=rewards, extras=[{"rule_score": float(r)} for r in rewards], result=score_summary(rewards, index, 0.1))


def test_stored_handed_step_reads_back_to_the_tensors_trained_on(tmp_path):
    shares = [share(0, [0, 1], response_len=6), share(1, [2, 3], response_len=4)]  # two replicas, ragged
    handed = HandedStep.from_shares(scores_for(shares, 0), shares)
    store = BatchStore(ObjectStore(str(tmp_path)))
    handed.save(store, 7)

    stored, trained_on = load_step(store, 7), handed.scored_step()
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logprobs", "policy_version", "prompt_index"):
        assert torch.equal(getattr(stored.batch, name), getattr(trained_on.batch, name)), name
        assert getattr(stored.batch, name).dtype == getattr(trained_on.batch, name).dtype, name
    assert torch.equal(stored.rewards, trained_on.rewards) and stored.baseline_rewards is None
    assert stored.batch.samples == trained_on.batch.samples
    summary = handed.summary()
    assert (summary.num_samples, summary.generate_seconds, summary.policy_version) == (16, 0.5, 0)
    assert summary.num_response_tokens == int(trained_on.batch.response_mask.sum())
    again = HandedStep.load(store, 7).summary()  # what a retry that kept nothing reports
    assert (again.num_samples, again.num_response_tokens, again.score.reward_mean) == (
        16,
        summary.num_response_tokens,
        summary.score.reward_mean,
    )


def test_retried_train_handed_updates_once_and_stores_the_batch_it_used(tiny_model, tmp_path):
    from ratchet.workers.trainer import TrainerWorker

    run = ObjectStore(str(tmp_path / "run"))
    worker = TrainerWorker(make_cfg(tiny_model), str(tiny_model), run.url, 0, 1)
    worker.setup(0)
    from ratchet.workers.reward import RewardWorker

    shares = [share(0, [0, 1])]
    first, summary, published = worker.train_handed(0, 0, 0.0, scores_for(shares, 0), *shares, publish=True)
    assert first.policy_version == 1
    assert published is None  # no Ray here: nothing to put the weights into
    weights = {k: v.clone() for k, v in worker.trainer.full_state().items()}
    store = BatchStore(run)
    assert run.get_json(RunLayout.train_log(0))["batch"] == 0  # the update's log is written before it reports
    assert store.has(0, "advantages")
    assert not store.has(0, "rollout"), "a first try's batch is the reward worker's to store"
    RewardWorker(make_cfg(tiny_model), str(tiny_model), run.url).store_handed(0, scores_for(shares, 0), *shares)
    assert torch.equal(load_step(store, 0).batch.response_ids, shares[0].batch.response_ids)

    # The batch store lost the batch, and the retry regenerated another one (or none).
    run.delete(store.key(0, "rollout"))
    other = [share(9, [0, 1])]
    for retry in ((scores_for(other, 9), *other), ()):
        again, again_summary, _ = worker.train_handed(0, 0, 0.0, *retry)
        assert again.policy_version == 1 and again.metrics["pg_loss"] == first.metrics["pg_loss"]
        assert again_summary == summary
        assert all(torch.equal(weights[k], v) for k, v in worker.trainer.full_state().items()), "no second update"
        assert torch.equal(load_step(store, 0).batch.response_ids, shares[0].batch.response_ids), "the batch trained on"

    # A replay of the logged update on the stored batch (what recovery does) makes the same weights.
    fresh = TrainerWorker(make_cfg(tiny_model), str(tiny_model), run.url, 0, 1)
    fresh.setup(0)
    entry = run.get_json(RunLayout.train_log(0))
    fresh.train(entry["batch"], 0, entry["kl_coef"], entry["parts"], entry["optimizer"])
    assert all(torch.equal(weights[k], v) for k, v in fresh.trainer.full_state().items())
