"""PPO with a critic: the example recipe loads and is the benchmark's, the critic starts
from the policy's starting weights (the warm-up model), and `critic.warmup_steps` (verl's `trainer.critic_warmup`) keeps the policy as it is for the
first updates while the critic learns, then lets it learn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ratchet.config import ConfigError, load_config
from ratchet.tasks.generate import write_task_parquet
from ratchet.workers.batch import ScoredStep
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout
from ratchet.workers.critic import CriticTrainer, CriticWorker, critic_backbone
from ratchet.workers.engines.hf import HFEngine
from ratchet.workers.engines.base import SamplingParams
from ratchet.workers.policy_update import PolicyTrainer
from ratchet.workers.prompts import PromptSet
from ratchet.workers.rollout_batching import generate_batch

from ..benchmark_scripts import load_benchmark
from ..configs import make_cfg

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "copy_ppo_gae.yaml"

torch.set_num_threads(1)


def test_example_loads_and_is_the_benchmark_recipe():
    cfg = load_config(EXAMPLE, check_files=False)
    assert cfg.uses_critic and cfg.algorithm.adv_estimator == "gae"
    bench = load_benchmark("algorithms", "algorithms_benchmark")
    # every key the benchmark's GAE recipe sets has that value in the example
    for key, value in (kv.split("=", 1) for kv in bench.RECIPES["gae (PPO + critic)"]):
        section, *rest = key.split(".")
        node = getattr(cfg, section)
        for part in rest:
            node = getattr(node, part)
        assert str(node).lower() == value.lower() or float(node) == float(value), (key, node, value)


def test_warmup_steps_needs_a_critic():
    with pytest.raises(ConfigError, match="critic.warmup_steps"):
        load_config(EXAMPLE, ["algorithm.adv_estimator=grpo", "critic.warmup_steps=5"], check_files=False)
    assert not load_config(EXAMPLE, ["algorithm.adv_estimator=grpo", "critic.warmup_steps=0"], check_files=False).uses_critic


def test_critic_warmup_freezes_the_policy_then_releases_it(tiny_model, tmp_path):
    cfg = make_cfg(tiny_model, algorithm={"adv_estimator": "gae", "lam": 0.95}, critic={"warmup_steps": 2, "lr": 1e-2})
    engine = HFEngine(str(tiny_model))
    data = write_task_parquet(tmp_path / "copy.parquet", "copy", 8, seed=0, min_len=4, max_len=4)
    prompts = PromptSet(str(data), engine.tokenizer, max_prompt_length=64)
    batch = generate_batch(engine, prompts, [0, 1], SamplingParams(n=4, max_new_tokens=6, seed=3), policy_version=0)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.25, 0.0])
    policy, critic = PolicyTrainer(str(tiny_model), cfg), CriticTrainer(cfg)
    start = {k: v.clone() for k, v in policy.full_state().items()}
    value_trace = []
    for step in range(3):
        values = critic.values(batch)
        value_trace.append(values.sum().item())
        result = policy.train_step(ScoredStep(batch, rewards, None), kl_coef=0.0, values=values)
        critic.update(batch, values, result.returns)
        assert policy.version == step + 1  # a frozen update still counts: versions stay the step count
        same = all(torch.equal(start[k], v) for k, v in policy.full_state().items())
        if step < 2:
            assert same, f"the policy moved during critic warm-up (update {step})"
            assert result.metrics["grad_norm"] == 0.0 and "pg_loss" not in result.metrics
            # the critic's targets are there all the same: returns = raw GAE advantages + V
            assert result.returns.abs().sum() > 0
        else:
            assert not same, "the policy did not move after the critic warm-up"
            assert result.metrics["grad_norm"] > 0
    # the critic learned meanwhile: its values moved off the zero-initialised head's 0
    assert value_trace[0] == 0.0 and value_trace[1] != 0.0


def test_the_critic_starts_from_the_warmed_up_policy(tiny_model, tmp_path):
    """In a run with a warm-up, the Ray critic's backbone is the warm-up model, not
    `model.path` (the model before the warm-up), as in the in-process loop and verl."""
    from transformers import AutoModelForCausalLM

    run_uri = ObjectStore(str(tmp_path / "run")).url
    warm_uri = ObjectStore(run_uri).uri(RunLayout.WARMUP_MODEL)
    warm = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        warm.get_decoder().embed_tokens.weight.add_(1.0)  # unlike the base model's anywhere
    warm.save_pretrained(ObjectStore(warm_uri).root)
    cfg = make_cfg(tiny_model, algorithm={"adv_estimator": "gae"}, warmup={"steps": 2})
    assert critic_backbone(cfg, run_uri) == warm_uri
    worker = CriticWorker(cfg, run_uri)
    embed = worker.trainer.model.backbone.embed_tokens.weight
    assert torch.equal(embed, warm.get_decoder().embed_tokens.weight)
    # without a warm-up the policy starts from model.path, and so does the critic; an
    # explicit critic.model_path wins over both
    assert critic_backbone(make_cfg(tiny_model, algorithm={"adv_estimator": "gae"}), run_uri) == str(tiny_model)
    other = make_cfg(tiny_model, algorithm={"adv_estimator": "gae"}, warmup={"steps": 2}, critic={"model_path": "/elsewhere"})
    assert critic_backbone(other, run_uri) == "/elsewhere"
