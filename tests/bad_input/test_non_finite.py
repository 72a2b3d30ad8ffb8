"""Non-finite values never reach the weights: a NaN/inf reward, advantage, loss or gradient
norm stops the update before optimizer.step() with an error naming the step and sample,
and weights holding NaN are never checkpointed or synced. In-process (no Ray), on the tiny
model; the same through a real run is in tests/faults/test_worker_faults.py."""

from __future__ import annotations

import os

import pytest
import torch

from ratchet.errors import NonFiniteError, RewardFunctionError
from ratchet.models.tiny import VOCAB
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.checkpoint_store import CheckpointStore
from ratchet.storage.object_store import ObjectStore
from ratchet.workers.batch import RolloutBatch, ScoredStep, save_scores
from ratchet.workers.policy_update import PolicyTrainer
from ratchet.workers.scoring import score_batch
from ..configs import make_cfg

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled, )?unavailable or uninitialized")

PAD, BOS, EOS = VOCAB.index("<pad>"), VOCAB.index("<bos>"), VOCAB.index("<eos>")
DIGITS = [VOCAB.index(str(d)) for d in range(10)]
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.25, 0.0])


def make_batch(seed: int = 0) -> RolloutBatch:
    """8 rows (2 prompts x 4 samples) of random digits."""
    g = torch.Generator().manual_seed(seed)
    digits = torch.tensor(DIGITS)
    b, p, r = 8, 6, 6
    prompt = digits[torch.randint(0, 10, (b, p), generator=g)]
    prompt[:, 0] = BOS
    return RolloutBatch(
        prompt_ids=prompt,
        prompt_mask=torch.ones(b, p, dtype=torch.long),
        response_ids=digits[torch.randint(0, 10, (b, r), generator=g)],
        response_mask=torch.ones(b, r),
        rollout_logprobs=-2.0 - torch.rand(b, r, generator=g),
        policy_version=torch.zeros(b, r, dtype=torch.long),
        prompt_index=torch.tensor([0] * 4 + [1] * 4),
        samples=[{"data_source": "digits/copy", "ground_truth": "1", "extra_info": {}} for _ in range(b)],
    )


def weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.full_state().items()}


def assert_untouched(trainer: PolicyTrainer, before: dict[str, torch.Tensor]) -> None:
    assert trainer.version == 0
    after = trainer.full_state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in after.values())


# --------------------------------------------------------------------------- train_step


def test_nan_reward_stops_the_update_naming_the_row(tiny_model):
    trainer = PolicyTrainer(str(tiny_model), make_cfg(tiny_model))
    before = weights(trainer)
    rewards = REWARDS.clone()
    rewards[5] = float("nan")
    with pytest.raises(NonFiniteError, match=r"rewards of rows \[5\] are not finite"):
        trainer.train_step(ScoredStep(make_batch(), rewards, None), kl_coef=0.0)
    assert_untouched(trainer, before)


def test_nan_critic_values_stop_the_update(tiny_model):
    cfg = make_cfg(tiny_model, algorithm={"adv_estimator": "gae"})
    trainer = PolicyTrainer(str(tiny_model), cfg)
    before = weights(trainer)
    values = torch.zeros(8, 6)
    values[2, 3] = float("nan")
    with pytest.raises(NonFiniteError, match=r"critic values of rows \[2\] are not finite"):
        trainer.train_step(ScoredStep(make_batch(), REWARDS, None), kl_coef=0.0, values=values)
    assert_untouched(trainer, before)


def test_nan_loss_skips_the_optimizer_step(tiny_model):
    """bypass: the rollout log-probs are the old ones, so a NaN there makes the ratio and
    the loss NaN; the update stops before optimizer.step()."""
    cfg = make_cfg(tiny_model, algorithm={"off_policy": {"mode": "bypass"}})
    trainer = PolicyTrainer(str(tiny_model), cfg)
    before = weights(trainer)
    batch = make_batch()
    batch.rollout_logprobs[1, 2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"non-finite update in PPO epoch 0: loss nan, gradient norm"):
        trainer.train_step(ScoredStep(batch, REWARDS, None), kl_coef=0.0)
    assert_untouched(trainer, before)


# --------------------------------------------------------------------------- worker: step named, weights refused


def _worker(tiny_model, tmp_path, rewards: torch.Tensor):
    from ratchet.workers.trainer import TrainerWorker

    run = ObjectStore(str(tmp_path / "run"))
    store = BatchStore(run)
    batch = make_batch()
    batch.save(store, 0)
    save_scores(store, 0, rewards, [{}] * len(batch))
    worker = TrainerWorker(make_cfg(tiny_model), str(tiny_model), run.url, 0, 1)
    worker.setup(0)
    return worker, run


def test_trainer_worker_names_the_step(tiny_model, tmp_path):
    rewards = REWARDS.clone()
    rewards[0] = float("inf")
    worker, _ = _worker(tiny_model, tmp_path, rewards)
    with pytest.raises(NonFiniteError, match=r"^batch 0 \(policy v0\): rewards of rows \[0\] are not finite \(\[inf\]\)"):
        worker.train(0, 0, 0.0)
    assert worker.policy_version() == 0


def test_nan_weights_are_never_checkpointed_or_synced(tiny_model, tmp_path):
    worker, run = _worker(tiny_model, tmp_path, REWARDS)
    with torch.no_grad():
        next(worker.trainer.model.parameters())[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"policy v0 \(checkpoint step-00000001\) hold NaN/inf values"):
        worker.start_checkpoint(1, {"next_step": 1})
    assert worker.wait_checkpoint().error is None  # nothing was started
    assert CheckpointStore(run).list() == []
    with pytest.raises(NonFiniteError, match=r"\(to be synced\) hold NaN/inf values"):
        worker.send_weights("sync-1", "object_store", 1)  # refused before the first bucket leaves


# --------------------------------------------------------------------------- reward functions


def _scoring_batch() -> RolloutBatch:
    batch = make_batch()
    batch.samples = [{"data_source": f"src{i}", "ground_truth": "1", "extra_info": {}} for i in range(len(batch))]
    return batch


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), {"score": float("-inf")}])
def test_non_finite_reward_names_step_row_and_source(tokenizer, bad):
    calls = []

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        calls.append(data_source)
        return bad if data_source == "src3" else 1.0

    with pytest.raises(NonFiniteError, match=r"gave (nan|inf|-inf) at batch 7, row 3 \(data_source 'src3'\)"):
        score_batch(_scoring_batch(), tokenizer, reward, batch_index=7)
    assert calls == ["src0", "src1", "src2", "src3"]  # stopped at once


def test_reward_function_bug_is_named_with_its_line(tokenizer):
    def reward(data_source, solution_str, ground_truth, extra_info=None):
        return len(ground_truth) + None  # TypeError on every call

    with pytest.raises(RewardFunctionError) as info:
        score_batch(_scoring_batch(), tokenizer, reward, batch_index=2)
    text = str(info.value)
    assert "raised TypeError" in text and "batch 2, row 0 (data_source 'src0')" in text
    assert f"{__file__}:" in text and "(reward)" in text and "fix reward.function" in text
    with pytest.raises(RewardFunctionError, match=r"returned 'high' \(str\) at row 0"):
        score_batch(_scoring_batch(), tokenizer, lambda **kw: "high")
