"""Safe-RLHF and rollout filters in the workers, in-process: the config and its errors,
the cost scorer, the filter's contract, the stored columns, the trainer's handling of
dropped samples, and a learning test on the copy task with the in-process loop (the
trainer code the Ray workers run): the cost goes under its budget while the reward rises."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ratchet.algorithms.advantages import AdvInputs, AdvParams, sequence_rewards_to_tokens
from ratchet.algorithms.advantages import grpo
from ratchet.config import load_config
from ratchet.config.loader import ConfigError
from ratchet.errors import NonFiniteError, RewardFunctionError
from ratchet.models.tiny import VOCAB
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.object_store import ObjectStore
from ratchet.workers.batch import HandedStep, RolloutBatch, ScoredStep, StepScores, load_step, save_scores, score_summary
from ratchet.workers.engines.hf import HFEngine
from ratchet.workers.engines.base import SamplingParams
from ratchet.workers.policy_update import PolicyTrainer
from ratchet.workers.prompts import PromptSet
from ratchet.workers.rollout_batching import generate_batch
from ratchet.workers.rollout_filter import RolloutFilter, filtered_groups
from ratchet.workers.safety import CostScorer

from ..configs import make_cfg

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "copy_safe_rlhf.yaml"
PAD, BOS, EOS, COPY, COLON = (VOCAB.index(t) for t in ("<pad>", "<bos>", "<eos>", "copy", ":"))
COST = "ratchet.tasks.costs:compute_cost"


def d(x: str) -> int:
    return VOCAB.index(x)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def hand_batch(responses: list[list[int]], group: list[int]) -> RolloutBatch:
    """Rows of `copy : 1 2` prompts; each response's mask covers its tokens."""
    b, width = len(responses), max(len(r) for r in responses)
    ids, mask = torch.full((b, width), PAD), torch.zeros(b, width)
    for r, toks in enumerate(responses):
        ids[r, : len(toks)] = torch.tensor(toks)
        mask[r, : len(toks)] = 1.0
    prompt = torch.tensor([[BOS, COPY, COLON, d("1"), d("2")]] * b)
    return RolloutBatch(
        prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), response_ids=ids, response_mask=mask,
        rollout_logprobs=torch.zeros(b, width), policy_version=torch.zeros(b, width, dtype=torch.long),
        prompt_index=torch.tensor(group), samples=[{"data_source": "digits/copy", "ground_truth": "12", "extra_info": {"i": r}} for r in range(b)],
    )  # fmt: skip


# --------------------------------------------------------------------------- config


def test_example_config_loads():
    cfg = load_config(EXAMPLE, check_files=False)
    assert cfg.uses_safety and cfg.safety.cost_function == COST and cfg.safety.budget == 0.1
    assert cfg.safety.lambda_update == "log" and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.rollout.filter is None
    from ratchet.config.loop_plan import loop_plan

    assert loop_plan(cfg).safe_lambda == 1.0
    assert loop_plan(make_cfg("m")).safe_lambda is None  # no safety section: nothing carried


def test_config_refuses_what_cannot_work(tmp_path):
    with pytest.raises(ValueError, match=r"safety \(Safe-RLHF\) with algorithm.adv_estimator='gae'.*critic"):
        make_cfg("m", safety={"cost_function": COST}, algorithm={"adv_estimator": "gae"})
    with pytest.raises(ValueError, match="greedy baseline"):
        make_cfg("m", safety={"cost_function": COST}, algorithm={"adv_estimator": "remax"})
    with pytest.raises(ValueError, match="safety.lambda_init must be > 0 with safety.lambda_update=log"):
        make_cfg("m", safety={"cost_function": COST, "lambda_init": 0.0, "lambda_update": "log"})
    with pytest.raises(ValueError, match="above safety.lambda_max"):
        make_cfg("m", safety={"cost_function": COST, "lambda_init": 5.0, "lambda_max": 1.0})
    with pytest.raises(ValueError, match="budget"):
        make_cfg("m", safety={"cost_function": COST, "budget": float("nan")})
    assert not make_cfg("m", algorithm={"adv_estimator": "gae"}).uses_safety  # gae alone is fine
    # functions that cannot be imported or called: refused at submit, naming the key
    bad = tmp_path / "bad.py"
    bad.write_text("def cost(x):\n    return 0.0\n")
    with pytest.raises(ConfigError) as info:
        missing = [f"model.path={tmp_path}/none", f"data.train_files={tmp_path}/none.parquet", "data.eval_files=null"]
        load_config(EXAMPLE, [*missing, "safety.cost_function=ratchet.tasks.costs:missing", f"rollout.filter={bad}:cost"])
    issues = dict(info.value.issues)
    assert "has no function 'missing'" in issues["safety.cost_function"]
    assert "is not a rollout filter" in issues["rollout.filter"]


# --------------------------------------------------------------------------- costs


def test_cost_scorer_function_and_model(tokenizer, tmp_path):
    from ratchet.models.tiny import build_tiny_reward_model
    from ratchet.tasks.costs import compute_cost

    batch = hand_batch([[d("1"), d("7"), EOS], [d("1"), d("2"), EOS], [d("7")]], [0, 0, 1])
    assert compute_cost("digits/copy", "17", "12") == 1.0 and compute_cost("digits/copy", "12", "12") == 0.0
    cfg = make_cfg("m", safety={"cost_function": COST})
    assert CostScorer(cfg.safety).score(batch, tokenizer).tolist() == [1.0, 0.0, 1.0]
    rm = build_tiny_reward_model(tmp_path / "cost-model")
    both = CostScorer(make_cfg("m", safety={"cost_function": COST, "cost_model_path": str(rm)}).safety)
    model_only = CostScorer(make_cfg("m", safety={"cost_model_path": str(rm)}).safety).score(batch, tokenizer)
    assert torch.isfinite(model_only).all() and model_only.std() > 0
    torch.testing.assert_close(both.score(batch, tokenizer), model_only + torch.tensor([1.0, 0.0, 1.0]))


def test_cost_function_errors_name_the_key(tokenizer, tmp_path):
    batch = hand_batch([[d("1"), EOS], [d("2"), EOS]], [0, 0])
    nan = tmp_path / "nan_cost.py"
    nan.write_text(
        "def c(data_source, solution_str, ground_truth, extra_info=None):\n    return float('nan') if '2' in solution_str else 0.0\n"
    )
    with pytest.raises(NonFiniteError, match=r"the cost function gave nan at batch 3, row 1 .*fix safety.cost_function"):
        CostScorer(make_cfg("m", safety={"cost_function": f"{nan}:c"}).safety).score(batch, tokenizer, 3)
    boom = tmp_path / "boom_cost.py"
    boom.write_text("def c(data_source, solution_str, ground_truth, extra_info=None):\n    raise KeyError('label')\n")
    with pytest.raises(RewardFunctionError, match=r"the cost function raised KeyError.*row 0.*fix safety.cost_function"):
        CostScorer(make_cfg("m", safety={"cost_function": f"{boom}:c"}).safety).score(batch, tokenizer)


# --------------------------------------------------------------------------- rollout filters


def _filter(tmp_path, body: str) -> RolloutFilter:
    path = tmp_path / f"f{abs(hash(body))}.py"
    path.write_text(f"def f(prompt, response, data_source, extra_info=None):\n{body}\n")
    return RolloutFilter(f"{path}:f")


def test_rollout_filter_contract(tokenizer, tmp_path):
    batch = hand_batch([[d("1"), d("7"), EOS], [d("1"), d("2"), EOS], [d("7"), d("7")]], [0, 0, 1])
    rewards = torch.tensor([0.5, 1.0, 0.0])
    keep, out = RolloutFilter("ratchet.tasks.filters:drop_forbidden").apply(batch, tokenizer, rewards)
    assert keep.tolist() == [False, True, False] and out.tolist() == rewards.tolist()
    keep, out = RolloutFilter("ratchet.tasks.filters:zero_reward_forbidden").apply(batch, tokenizer, rewards)
    assert keep.tolist() == [True, True, True] and out.tolist() == [0.0, 1.0, 0.0]
    assert rewards.tolist() == [0.5, 1.0, 0.0]  # the caller's tensor is not changed
    # what it is called with: the decoded prompt and response, the sample's data
    seen = _filter(
        tmp_path,
        "    import json\n    open(__file__ + '.seen', 'a').write(json.dumps([prompt, response, data_source, extra_info]) + '\\n')\n    return {'keep': response != '12', 'reward': 2.0}",
    )
    keep, out = seen.apply(batch, tokenizer, rewards)
    assert keep.tolist() == [True, False, True] and out.tolist() == [2.0, 2.0, 2.0]
    calls = Path(seen.spec.rsplit(":", 1)[0] + ".seen").read_text().splitlines()
    assert calls == [
        '["copy:12", "17", "digits/copy", {"i": 0}]',
        '["copy:12", "12", "digits/copy", {"i": 1}]',
        '["copy:12", "77", "digits/copy", {"i": 2}]',
    ]
    assert _filter(tmp_path, "    import numpy\n    return numpy.bool_(len(response) > 3)").apply(batch, tokenizer, rewards)[
        0
    ].tolist() == [False, False, False]


def test_rollout_filter_bad_answers_name_the_key_and_row(tokenizer, tmp_path):
    batch = hand_batch([[d("1"), EOS], [d("2"), EOS]], [0, 0])
    rewards = torch.zeros(2)
    cases = [
        (
            "    raise RuntimeError('classifier down')",
            RewardFunctionError,
            r"the rollout filter raised RuntimeError: classifier down at batch 4, row 0 .*fix rollout.filter",
        ),
        ("    return 1", RewardFunctionError, r"returned 1 \(int\) at batch 4, row 0.*True/False or a dict"),
        ("    return {'keep': True, 'score': 1}", RewardFunctionError, r"keys \['score'\].*'keep' and 'reward' only"),
        ("    return {'keep': True, 'reward': 'high'}", RewardFunctionError, r"reward 'high'.*must be a number"),
        (
            "    return {'reward': float('inf')} if response == '2' else True",
            NonFiniteError,
            r"reward inf at batch 4, row 1.*fix rollout.filter",
        ),
    ]
    for body, kind, message in cases:
        with pytest.raises(kind, match=message):
            _filter(tmp_path, body).apply(batch, tokenizer, rewards, 4)


def test_filtered_groups():
    group = torch.tensor([3, 3, 5, 5, 5])
    assert filtered_groups(group, None) is group
    assert filtered_groups(group, torch.ones(5, dtype=torch.bool)) is group
    out = filtered_groups(group, torch.tensor([True, False, True, False, True]))
    assert out.tolist() == [3, -2, 5, -4, 5]


# --------------------------------------------------------------------------- stored columns


def test_costs_and_verdicts_are_stored_with_the_scores(tmp_path):
    store = BatchStore(ObjectStore(str(tmp_path)))
    batch = hand_batch([[d("1"), EOS], [d("7"), EOS], [d("2")]], [0, 0, 1])
    costs, keep = torch.tensor([0.0, 1.0, 0.5]), torch.tensor([True, False, True])
    rewards = torch.tensor([1.0, 0.0, 0.5])
    scores = StepScores(rewards, [{}, {}, {}], score_summary(rewards, batch.prompt_index, 0.0), costs=costs, keep=keep)
    HandedStep(batch=batch, baseline=None, scores=scores).save(store, 7)
    step = load_step(store, 7)
    assert step.costs.tolist() == costs.tolist() and step.keep.tolist() == keep.tolist()
    again = HandedStep.load(store, 7).scored_step()
    assert again.costs.tolist() == costs.tolist() and again.keep.tolist() == keep.tolist()
    save_scores(store, 8, rewards, [{}, {}, {}])  # a run without either: nothing stored, None read
    batch.save(store, 8)
    plain = load_step(store, 8)
    assert plain.costs is None and plain.keep is None


# --------------------------------------------------------------------------- the trainer


@pytest.fixture(scope="module")
def sampled(tiny_model, tmp_path_factory, tokenizer):
    from ratchet.tasks.generate import write_task_parquet

    path = write_task_parquet(tmp_path_factory.mktemp("copy") / "copy.parquet", "copy", 8, seed=0, min_len=4, max_len=4)
    prompts = PromptSet(str(path), tokenizer, max_prompt_length=64)
    return generate_batch(HFEngine(str(tiny_model)), prompts, [0, 1], SamplingParams(n=4, max_new_tokens=6, seed=3), policy_version=0)


def test_dropped_samples_leave_the_loss_and_their_group(tiny_model, sampled):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.75, 0.0])
    keep = torch.tensor([True, False, True, True, True, True, False, True])
    trainer = PolicyTrainer(str(tiny_model), make_cfg(tiny_model))
    result = trainer.train_step(ScoredStep(sampled, rewards, None, keep=keep), kl_coef=0.0)
    assert result.metrics["rollout_filter/dropped"] == 2.0
    assert result.metrics["kept_fraction"] == pytest.approx(6 / 8)
    adv = result.advantages
    assert adv[1].abs().sum() == 0 and adv[6].abs().sum() == 0
    # the kept rows' advantages are GRPO's over the kept rows of each group alone
    kept = torch.nonzero(keep).flatten()
    sub = sampled.select(kept)
    expected = grpo(
        AdvInputs(sequence_rewards_to_tokens(rewards[kept], sub.response_mask), sub.response_mask, sub.prompt_index), AdvParams()
    )
    torch.testing.assert_close(adv[kept][:, : expected.advantages.shape[1]], expected.advantages)
    # everything dropped: no gradient, nothing NaN
    nothing = PolicyTrainer(str(tiny_model), make_cfg(tiny_model))
    out = nothing.train_step(ScoredStep(sampled, rewards, None, keep=torch.zeros(8, dtype=torch.bool)), kl_coef=0.0)
    assert out.metrics["grad_norm"] == 0.0 and out.metrics["rollout_filter/dropped"] == 8.0
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_trainer_carries_the_multiplier(tiny_model, sampled):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.75, 0.0])
    costs = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])  # mean 0.5
    cfg = make_cfg(tiny_model, safety={"cost_function": COST, "budget": 0.2, "lambda_lr": 2.0, "lambda_init": 0.5})
    trainer = PolicyTrainer(str(tiny_model), cfg)
    first = trainer.train_step(ScoredStep(sampled, rewards, None, costs=costs), kl_coef=0.0)
    assert first.safe_lambda == pytest.approx(0.5 + 2.0 * 0.3)  # None in: lambda_init, stepped once
    m = first.metrics
    assert m["safe/lambda"] == pytest.approx(1.1) and m["safe/cost_mean"] == pytest.approx(0.5)
    assert m["safe/cost_budget_violation"] == pytest.approx(0.3)
    second = trainer.train_step(ScoredStep(sampled, rewards, None, costs=torch.zeros(8)), kl_coef=0.0, safe_lambda=first.safe_lambda)
    assert second.safe_lambda == pytest.approx(1.1 - 2.0 * 0.2)  # under budget: down
    assert second.metrics["safe/cost_budget_violation"] == 0.0
    with pytest.raises(ValueError, match="no costs"):
        trainer.train_step(ScoredStep(sampled, rewards, None), kl_coef=0.0)
    plain = PolicyTrainer(str(tiny_model), make_cfg(tiny_model)).train_step(ScoredStep(sampled, rewards, None), kl_coef=0.0)
    assert plain.safe_lambda is None and not any(k.startswith("safe/") for k in plain.metrics)
