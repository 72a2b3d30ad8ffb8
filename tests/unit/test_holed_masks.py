"""Masks with holes outside the estimators: a multi-turn response's tool output (mask 0) is
context for the model, part of the text the reward function scores and of the length the
overlong penalty sees; and the optimal token baseline's inputs reach it through the trainer."""

from __future__ import annotations

import torch

from ratchet.algorithms import ADV_ESTIMATORS
from ratchet.algorithms.advantages import AdvInputs, AdvParams, sequence_rewards_to_tokens
from ratchet.algorithms.advantages_outcome import sum_pi_squared
from ratchet.models.tiny import VOCAB
from ratchet.workers.batch import RolloutBatch, ScoredStep
from ratchet.workers.policy_update import PolicyTrainer, response_logits, token_logprobs
from ratchet.workers.scoring import score_batch

from ..configs import make_cfg

torch.set_num_threads(1)

PAD, BOS, EOS = VOCAB.index("<pad>"), VOCAB.index("<bos>"), VOCAB.index("<eos>")
COLON, EQ, COPY = VOCAB.index(":"), VOCAB.index("="), VOCAB.index("copy")
DIGITS = [VOCAB.index(str(d)) for d in range(10)]

# Row 0: two model tokens, a 2-token tool output (mask 0), two model tokens, padding.
# Row 1: no hole. Rows 2-3 repeat them with other tokens (2 prompts x 2 samples... x 2).
MASKS = [
    [1, 1, 0, 0, 1, 1, 0, 0],
    [1, 1, 1, 0, 0, 0, 0, 0],
    [1, 0, 0, 1, 1, 1, 1, 0],
    [1, 1, 1, 1, 1, 1, 1, 1],
]


def holed_batch(rows: int = 8) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([MASKS[i % 4] for i in range(rows)], dtype=torch.float32)
    ids = torch.tensor(DIGITS)[torch.randint(0, 10, mask.shape, generator=g)]
    span = torch.tensor([max(i for i, v in enumerate(m) if v) + 1 for m in mask.tolist()])
    ids = torch.where(torch.arange(mask.shape[1]) < span.unsqueeze(-1), ids, PAD)
    prompt = torch.tensor([[BOS, COPY, COLON, EQ]] * rows)
    return RolloutBatch(
        prompt_ids=prompt,
        prompt_mask=torch.ones_like(prompt),
        response_ids=ids,
        response_mask=mask,
        rollout_logprobs=torch.zeros(mask.shape),
        policy_version=torch.zeros(mask.shape, dtype=torch.long),
        prompt_index=torch.arange(rows) // 4,
        samples=[{"data_source": "digits/copy", "ground_truth": "1", "extra_info": {}} for _ in range(rows)],
    )


def test_attention_covers_the_tool_output_up_to_the_last_response_token():
    batch = holed_batch(4)
    attn = batch.attention_mask[:, 4:]  # the response part
    assert attn.tolist() == [
        [1, 1, 1, 1, 1, 1, 0, 0],  # the hole is context; the padding is not
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 1, 1],
    ]
    assert batch.attention_mask[:, :4].sum() == 16


def test_trainer_logits_see_the_tool_output(tiny_model):
    """The logits that score a token after a tool output are those of the unpadded sequence
    with the tool output in it, as the rollout engine saw it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    batch = holed_batch(4)
    with torch.no_grad():
        padded = response_logits(model, batch, 1.0)[0, :6]
        whole = model(input_ids=torch.cat([batch.prompt_ids[0], batch.response_ids[0, :6]]).unsqueeze(0)).logits[0, 3:9]
    torch.testing.assert_close(padded, whole, atol=1e-4, rtol=0)


class SpaceTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def test_reward_function_sees_the_whole_trajectory():
    batch = holed_batch(4)
    rewards, _ = score_batch(batch, SpaceTokenizer(), lambda data_source, solution_str, ground_truth, extra_info: len(solution_str.split()))
    assert rewards.tolist() == [6.0, 3.0, 7.0, 8.0]  # mask.sum() would cut row 0 at 4 and row 2 at 5 tokens


def test_optimal_token_baseline_through_the_trainer_with_holes(tiny_model):
    """The trainer hands OTB the policy's log-probs and sum pi^2 of the whole batch, and the
    response length it reports (the overlong penalty's) counts the holes."""
    cfg = make_cfg(tiny_model, algorithm={"adv_estimator": "optimal_token_baseline"}, rollout={"max_response_length": 8})
    trainer = PolicyTrainer(str(tiny_model), cfg)
    batch = holed_batch(8)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.25, 1.0])
    with torch.no_grad():
        logits = response_logits(trainer.model.eval(), batch, cfg.rollout.temperature)
    expected = ADV_ESTIMATORS.get("optimal_token_baseline").fn(
        AdvInputs(
            sequence_rewards_to_tokens(rewards, batch.response_mask), batch.response_mask, batch.prompt_index,
            old_logprob=token_logprobs(logits, batch.response_ids), sum_pi_squared=sum_pi_squared(logits),
        ),
        AdvParams(),
    )  # fmt: skip
    before = {k: v.clone() for k, v in trainer.full_state().items()}
    result = trainer.train_step(ScoredStep(batch, rewards, None), kl_coef=0.0)
    torch.testing.assert_close(result.advantages, expected.advantages, atol=1e-5, rtol=0)
    assert result.advantages[batch.response_mask == 0].abs().sum() == 0 and result.advantages.abs().sum() > 0
    assert result.metrics["response_length"] == (6 + 3 + 7 + 8) / 4  # spans, not mask sums (5.0)
    assert any(not torch.equal(before[k], v) for k, v in trainer.full_state().items())
