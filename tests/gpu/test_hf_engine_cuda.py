"""The HF engine on a GPU: sampling as runs sample (a seed per prompt, drawn on the GPU),
the log-probs it reports against the trainer's, and its memory: the draw records one
log-prob per row and step, not the step's whole logits (which at 256 rows x a 152k
vocabulary x 512 steps would be 80 GB)."""

from __future__ import annotations

import pytest
import torch

from ratchet.workers.engines.base import SamplingParams
from ratchet.workers.engines.hf import HFEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[1, 5, 6, 7, 17], [1, 8, 9, 17], [1, 3, 4, 5, 6, 17]]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return HFEngine(str(tiny_model))  # float32: its log-probs compare with the trainer's tightly


def test_it_generates_on_the_gpu_and_a_prompts_samples_do_not_depend_on_its_neighbours(engine):
    assert engine.model.device.type == "cuda"
    params = SamplingParams(n=4, temperature=0.8, max_new_tokens=10, seed=0, prompt_seeds=(11, 12, 13))
    together = engine.generate(PROMPTS, params)
    alone = engine.generate(PROMPTS[1:2], SamplingParams(n=4, temperature=0.8, max_new_tokens=10, seed=0, prompt_seeds=(12,)))
    assert [g.token_ids for g in together[1]] == [g.token_ids for g in alone[0]]
    again = engine.generate(PROMPTS, params)
    assert [[g.token_ids for g in grp] for grp in together] == [[g.token_ids for g in grp] for grp in again]


def test_the_reported_logprobs_are_the_models(engine, tiny_model):
    from transformers import AutoModelForCausalLM

    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.8, max_new_tokens=10, seed=3, prompt_seeds=(1, 2, 3)))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    worst = 0.0
    for prompt, group in zip(PROMPTS, out):
        for g in group:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1 : -1].float() / 0.8
            ref = logits.log_softmax(-1).gather(-1, torch.tensor(g.token_ids).unsqueeze(-1)).squeeze(-1)
            worst = max(worst, float((torch.tensor(g.logprobs) - ref).abs().max()))
    assert worst < 1e-3, worst  # GPU kernels against the CPU's


def test_generation_memory_does_not_grow_with_the_steps_times_the_vocabulary(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ratchet.models.tiny import build_tokenizer

    vocab, rows, steps = 65536, 64, 128  # one step's float32 logits: 16 MiB; every step's: 2 GiB
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    build_tokenizer().save_pretrained(tmp_path / "m")
    engine = HFEngine(str(tmp_path / "m"), dtype="bfloat16")
    params = SamplingParams(n=4, max_new_tokens=steps, seed=0, prompt_seeds=tuple(range(rows // 4)))
    prompts = [[1, 3 + i % 10, 17] for i in range(rows // 4)]
    engine.generate(prompts[:1], SamplingParams(n=1, max_new_tokens=2, seed=0, prompt_seeds=(0,)))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = engine.generate(prompts, params)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    step_logits = rows * vocab * 4
    assert sum(len(g.token_ids) for grp in out for g in grp) > rows * steps // 2
    assert extra < 12 * step_logits, f"{extra / 2**20:.0f} MiB over the model for {steps} steps"
