"""The rollout correction through `PolicyTrainer.train_step`: the config's is_weights and
rejection reach the update (a rejected sequence leaves the loss and its normaliser, an
on-policy IcePop weight is exactly 1) and the diagnostics reach the step metrics."""

from __future__ import annotations

import pytest
import torch

from ratchet.models.tiny import VOCAB
from ratchet.workers.batch import RolloutBatch, ScoredStep
from ratchet.workers.policy_update import PolicyTrainer, response_logits, token_logprobs

from ...configs import make_cfg

torch.set_num_threads(1)

PAD, BOS, EOS = VOCAB.index("<pad>"), VOCAB.index("<bos>"), VOCAB.index("<eos>")
COLON, EQ, COPY = VOCAB.index(":"), VOCAB.index("="), VOCAB.index("copy")
DIGITS = [VOCAB.index(str(d)) for d in range(10)]
# Multi-turn style holes (mask 0 inside the response) in rows 0 and 2.
MASKS = [[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]] * 2
REJECTED = [1, 4, 6]  # rows whose rollout log-probs are 1 nat below pi_old: k3 = e - 2 on each token


def batch_with_rollout(trainer: PolicyTrainer) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor(MASKS, dtype=torch.float32)
    ids = torch.tensor(DIGITS)[torch.randint(0, 10, mask.shape, generator=g)]
    prompt = torch.tensor([[BOS, COPY, COLON, EQ]] * len(MASKS))
    batch = RolloutBatch(
        prompt_ids=prompt,
        prompt_mask=torch.ones_like(prompt),
        response_ids=ids,
        response_mask=mask,
        rollout_logprobs=torch.zeros(mask.shape),
        policy_version=torch.zeros(mask.shape, dtype=torch.long),
        prompt_index=torch.arange(len(MASKS)) // 4,
        samples=[{"data_source": "digits/copy", "ground_truth": "1", "extra_info": {}} for _ in MASKS],
    )
    with torch.no_grad():  # the trainer's own pi_old, as it recomputes it (one micro-batch)
        old = token_logprobs(response_logits(trainer.model.eval(), batch, trainer.cfg.rollout.temperature), ids)
    shift = torch.zeros(len(MASKS), 1)
    shift[REJECTED] = 1.0
    batch.rollout_logprobs = torch.where(mask > 0, old - shift, float("-inf"))  # -inf padding, as engines leave it
    return batch


REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.25, 1.0])


def test_rejection_and_icepop_reach_the_update_and_the_metrics(tiny_model):
    corrected_cfg = make_cfg(
        tiny_model,
        trainer={"micro_batch_size": 8},
        algorithm={
            "off_policy": {
                "is_weights": {"kind": "icepop", "low": 0.5, "high": 5.0, "batch_normalize": True},
                "rejection": [
                    {"statistic": "k3", "level": "seq_mean", "high": 0.1},
                    {"statistic": "ratio", "level": "token", "low": 0.9, "high": 2.0},
                ],
            }
        },
    )
    corrected = PolicyTrainer(str(tiny_model), corrected_cfg)
    batch = batch_with_rollout(corrected)
    result = corrected.train_step(ScoredStep(batch, REWARDS, None), kl_coef=0.0)

    # The same update through the legacy rejection mode, which drops the same rows (their
    # geometric-mean ratio is e > cap 2, the others' is 1) and weights the rest 1, as
    # IcePop does on-policy: the weights after the step must be identical.
    legacy = PolicyTrainer(
        str(tiny_model),
        make_cfg(
            tiny_model, trainer={"micro_batch_size": 8}, algorithm={"off_policy": {"mode": "rejection", "cap": 2.0, "level": "geometric"}}
        ),
    )
    before = {k: v.clone() for k, v in legacy.full_state().items()}
    legacy_result = legacy.train_step(ScoredStep(batch_with_rollout(legacy), REWARDS, None), kl_coef=0.0)
    after_corrected, after_legacy = corrected.full_state(), legacy.full_state()
    assert any(not torch.equal(before[k], v) for k, v in after_legacy.items())  # the step did move the weights
    for k, v in after_legacy.items():
        torch.testing.assert_close(after_corrected[k], v, atol=0, rtol=0, msg=k)
    assert legacy_result.metrics["off_policy/frac_masked"] == result.metrics["off_policy/frac_masked"]

    m = result.metrics
    tokens = sum(map(sum, MASKS))
    rejected_tokens = sum(sum(MASKS[r]) for r in REJECTED)
    assert m["off_policy/frac_masked"] == pytest.approx(rejected_tokens / tokens)
    assert m["off_policy/rs_k3_seq_mean_frac_masked"] == pytest.approx(rejected_tokens / tokens)
    assert m["off_policy/rs_ratio_token_frac_masked"] == pytest.approx(rejected_tokens / tokens)  # rho = e > 2
    assert m["off_policy/frac_seq_masked"] == pytest.approx(len(REJECTED) / len(MASKS))
    assert m["off_policy/is_weight_mean"] == pytest.approx(1.0) and m["off_policy/ess"] == pytest.approx(1.0)
    assert m["off_policy/batch_norm_factor"] == pytest.approx(1.0) and m["off_policy/frac_zeroed"] == 0.0
    assert m["off_policy/ppo_kl"] == pytest.approx(-rejected_tokens / tokens, abs=1e-6)  # mean(log mu - log pi_old)
    assert m["off_policy/rollout_trainer_kl"] == pytest.approx((torch.e - 2) * rejected_tokens / tokens, abs=1e-5)
    assert m["off_policy/chi2_token"] == pytest.approx((torch.e**2 - 1) * rejected_tokens / tokens, abs=1e-4)
    assert m["off_policy/training_ppl"] > 0 and m["off_policy/rollout_ppl"] > m["off_policy/training_ppl"]
