"""The SGLang engine adapter (workers/engines/sglang.py).

SGLang needs CUDA and has no CPU build, so most tests here are CPU contract tests of the
adapter's OWN logic (request building, seeds, output parsing into `Generation`, weight-update
bucketing, memory release) with `sglang.Engine` STOOD IN BY A FAKE (`FakeSGLang` below,
which answers in SGLang's output format). The `gpu`-marked tests at the end run the real
engine; they are skipped without CUDA and SGLang.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ratchet.config.schema import RunConfig
from ratchet.models.tiny import VOCAB
from ratchet.workers.engines.base import SamplingParams
from ratchet.workers.engines.build import build_engine
from ratchet.workers.engines.serving import request_seed
from ratchet.workers.engines.sglang import SGLangEngine

EOS = VOCAB.index("<eos>")


class FakeSGLang:
    """A stand-in for `sglang.Engine` (FAKE, for CPU tests): draws each request's tokens
    from a generator seeded by its `sampling_seed` (uniform over the vocabulary, EOS
    included), stops at a stop token as SGLang does, and answers with SGLang's output dicts.
    Records every call."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.generate_calls: list[dict] = []
        self.updates: list[tuple[list[tuple[str, torch.Tensor]], bool]] = []
        self.memory: list[str] = []
        self.answer_update = (True, "ok")

    def generate(self, input_ids, sampling_params, return_logprob):
        assert return_logprob is True
        self.generate_calls.append({"input_ids": input_ids, "sampling_params": sampling_params})
        outputs = []
        for ids, sp in zip(input_ids, sampling_params):
            rng = np.random.default_rng(sp["sampling_seed"])
            tokens: list[int] = []
            while len(tokens) < sp["max_new_tokens"]:
                tokens.append(int(rng.integers(len(VOCAB))))
                if tokens[-1] in sp["stop_token_ids"]:
                    break
            triples = [(-math.log(len(VOCAB)) - 0.01 * i, t, None) for i, t in enumerate(tokens)]
            outputs.append({"output_ids": tokens, "meta_info": {"output_token_logprobs": triples, "finish_reason": "stop"}})
        return outputs

    def update_weights_from_tensor(self, named_tensors, flush_cache):
        self.updates.append((list(named_tensors), flush_cache))
        return self.answer_update

    def release_memory_occupation(self):
        self.memory.append("release")

    def resume_memory_occupation(self):
        self.memory.append("resume")


@pytest.fixture
def engine(tiny_model) -> SGLangEngine:
    return SGLangEngine(str(tiny_model), dtype="float32", max_model_len=96, weight_bucket_mb=1.0, engine_factory=FakeSGLang)


def test_the_engine_is_started_with_the_configured_options(tiny_model, monkeypatch):
    """build_engine passes rollout.sglang's fields; max_model_len defaults to the run's longest sequence."""
    import ratchet.workers.engines.sglang as sglang_module

    monkeypatch.setattr(sglang_module, "_sglang_engine_class", lambda: FakeSGLang)
    cfg = RunConfig.model_validate(
        {
            "model": {"path": str(tiny_model), "dtype": "bfloat16"},
            "data": {"train_files": "unused.parquet", "max_prompt_length": 40},
            "rollout": {"engine": "sglang", "max_response_length": 24, "sglang": {"mem_fraction_static": 0.3, "tensor_parallel_size": 2}},
        }
    )
    engine = build_engine(cfg, str(tiny_model))
    kwargs = engine.engine.kwargs
    assert kwargs["model_path"] == str(tiny_model) and kwargs["dtype"] == "bfloat16"
    assert kwargs["context_length"] == 64 and kwargs["mem_fraction_static"] == 0.3 and kwargs["tp_size"] == 2
    assert kwargs["skip_tokenizer_init"] is True  # token ids in and out; the HF tokenizer decodes
    assert engine.dtype == torch.bfloat16 and engine.supports_partial_rollout is False


@pytest.mark.parametrize(
    ("section", "bad", "field"),
    [
        ("vllm", {"kv_cache_byte": 1}, "rollout.vllm.kv_cache_byte"),
        ("vllm", {"gpu_memory_utilization": 1.5}, "rollout.vllm.gpu_memory_utilization"),
        ("sglang", {"tensor_parallel_size": 0}, "rollout.sglang.tensor_parallel_size"),
    ],
)
def test_engine_option_sections_refuse_unknown_keys_and_bad_values(section, bad, field):
    from pydantic import ValidationError

    raw = {"model": {"path": "m"}, "data": {"train_files": "d.parquet"}, "rollout": {section: bad}}
    with pytest.raises(ValidationError) as err:
        RunConfig.model_validate(raw)
    assert ".".join(str(p) for p in err.value.errors()[0]["loc"]) == field


def test_one_seeded_request_per_sample(engine):
    prompts = [[1, 5, 6, 17], [1, 7, 17], [1, 8, 9, 10, 17]]
    params = SamplingParams(n=4, temperature=0.7, top_p=0.9, max_new_tokens=9, seed=5, prompt_seeds=(100, 200, 300))
    out = engine.generate(prompts, params, version=3)
    (call,) = engine.engine.generate_calls
    assert call["input_ids"] == [p for p in prompts for _ in range(4)]
    seeds = [sp["sampling_seed"] for sp in call["sampling_params"]]
    assert seeds == [request_seed(s, None, j) for s in (100, 200, 300) for j in range(4)] and len(set(seeds)) == 12
    sp = call["sampling_params"][0]
    assert (sp["temperature"], sp["top_p"], sp["max_new_tokens"], sp["stop_token_ids"]) == (0.7, 0.9, 9, [EOS])
    assert [len(group) for group in out] == [4, 4, 4]
    # A prompt's samples depend on its own seed alone: the same prompt with the same seed
    # in another call (alone, another position) samples the same.
    alone = engine.generate(prompts[1:2], SamplingParams(n=4, temperature=0.7, top_p=0.9, max_new_tokens=9, prompt_seeds=(200,)))
    assert [g.token_ids for g in alone[0]] == [g.token_ids for g in out[1]]
    # Without prompt seeds: from the call's seed and the prompt's position.
    engine.generate(prompts[:1], SamplingParams(n=2, seed=5))
    assert [sp["sampling_seed"] for sp in engine.engine.generate_calls[-1]["sampling_params"]] == [
        request_seed(5, 0, 0),
        request_seed(5, 0, 1),
    ]


def test_outputs_become_generations(engine):
    out = engine.generate([[1, 5, 17]] * 6, SamplingParams(n=3, max_new_tokens=12, seed=1), version=7)
    gens = [g for group in out for g in group]
    for g in gens:
        assert len(g.token_ids) == len(g.logprobs) == len(g.versions) > 0
        assert g.versions == [7] * len(g.token_ids)
        assert g.token_ids[-1] == EOS or len(g.token_ids) == 12
        assert EOS not in g.token_ids[:-1]
        assert g.logprobs == pytest.approx([-math.log(len(VOCAB)) - 0.01 * i for i in range(len(g.token_ids))])
    assert any(g.token_ids[-1] == EOS for g in gens) and any(len(g.token_ids) == 12 for g in gens)


def test_greedy_asks_once_per_prompt_and_repeats_the_answer(engine):
    out = engine.generate([[1, 5, 17], [1, 6, 17]], SamplingParams(n=3, greedy=True, max_new_tokens=5))
    (call,) = engine.engine.generate_calls
    assert len(call["input_ids"]) == 2 and all(sp["temperature"] == 0.0 for sp in call["sampling_params"])
    assert all(len(group) == 3 and group[0] is group[1] is group[2] for group in out)


def test_disagreeing_output_ids_are_an_error(engine):
    fake = engine.engine
    answer = fake.generate

    def bad_generate(**kwargs):
        outs = answer(**kwargs)
        outs[0]["output_ids"] = outs[0]["output_ids"][:-1] + [99]
        return outs

    fake.generate = bad_generate
    with pytest.raises(RuntimeError, match="output_ids and its log-prob token ids disagree"):
        engine.generate([[1, 5, 17]], SamplingParams(n=1, max_new_tokens=4))


def weights_of(tiny_model: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(tiny_model / "model.safetensors"))


def test_weights_go_in_bounded_buckets_cast_and_consumed_lazily(tiny_model):
    engine = SGLangEngine(str(tiny_model), dtype="bfloat16", weight_bucket_mb=0.25, engine_factory=FakeSGLang)
    weights = weights_of(tiny_model)
    taken: list[str] = []

    def stream():
        for name, array in weights.items():
            taken.append(name)
            yield name, array

    fake = engine.engine
    sizes_when_sent = []
    send = fake.update_weights_from_tensor

    def recording_update(named_tensors, flush_cache):
        sizes_when_sent.append(len(taken))
        return send(named_tensors=named_tensors, flush_cache=flush_cache)

    fake.update_weights_from_tensor = recording_update
    engine.load_weights(stream())
    limit = int(0.25 * (1 << 20))
    assert len(fake.updates) > 2
    for bucket, _ in fake.updates:
        assert sum(t.nbytes for _, t in bucket) <= limit or len(bucket) == 1
        assert all(t.dtype == torch.bfloat16 for _, t in bucket)
    assert [flush for _, flush in fake.updates] == [False] * (len(fake.updates) - 1) + [True]  # flushed once, at the end
    assert sizes_when_sent[0] < len(weights)  # the first bucket left before the stream was read whole
    sent = {name: t for bucket, _ in fake.updates for name, t in bucket}
    # The model folder omits its tied head; the embedding goes on under the head's name too.
    assert "lm_head.weight" not in weights and set(sent) == set(weights) | {"lm_head.weight"}
    assert torch.equal(sent["lm_head.weight"], sent["model.embed_tokens.weight"])
    name = "model.norm.weight"
    assert torch.equal(sent[name], torch.from_numpy(weights[name]).to(torch.bfloat16))


def test_weight_names_must_match_and_a_refused_update_raises(tiny_model, engine):
    weights = weights_of(tiny_model)
    with pytest.raises(ValueError, match=r"missing=\['model.norm.weight'\]"):
        engine.load_weights((k, v) for k, v in weights.items() if k != "model.norm.weight")
    with pytest.raises(ValueError, match=r"unexpected=\['extra.weight'\]"):
        engine.load_weights([*weights.items(), ("extra.weight", weights["model.norm.weight"])])
    engine.engine.answer_update = (False, "shape mismatch for model.norm.weight")
    with pytest.raises(RuntimeError, match="SGLang refused the weight update: shape mismatch"):
        engine.load_weights(weights.items())


def test_sleep_and_wake_up_release_and_resume_memory(engine):
    engine.sleep()
    engine.wake_up()
    assert engine.engine.memory == ["release", "resume"]


def test_without_sglang_or_cuda_the_error_names_the_fix(tiny_model):
    import importlib.util

    if importlib.util.find_spec("sglang") is not None and torch.cuda.is_available():
        pytest.skip("SGLang and CUDA are both here")
    with pytest.raises((ImportError, RuntimeError), match=r"rollout.engine=sglang needs SGLang and a CUDA GPU: `pip install"):
        SGLangEngine(str(tiny_model))


# --------------------------------------------------------------------------- real SGLang (GPU)


@pytest.fixture(scope="module")
def real_engine(tiny_model):
    pytest.importorskip("sglang", reason="SGLang is not installed")
    engine = SGLangEngine(str(tiny_model), dtype="float32", max_model_len=128, mem_fraction_static=0.2)
    yield engine
    engine.engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="SGLang needs a CUDA device")
def test_real_sglang_samples_seeded_with_the_trainers_logprobs(real_engine, tiny_model):
    from transformers import AutoModelForCausalLM

    prompts = [[1, 5, 6, 7, 17], [1, 8, 9, 17]]
    params = SamplingParams(n=4, temperature=0.8, max_new_tokens=12, seed=3)
    out = real_engine.generate(prompts, params)
    again = real_engine.generate(prompts, params)
    assert [[g.token_ids for g in grp] for grp in out] == [[g.token_ids for g in grp] for grp in again]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    worst = 0.0
    for prompt, group in zip(prompts, out):
        for g in group:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1 : -1].float() / 0.8
            ref = logits.log_softmax(-1).gather(-1, torch.tensor(g.token_ids).unsqueeze(-1)).squeeze(-1)
            worst = max(worst, float((torch.tensor(g.logprobs) - ref).abs().max()))
    assert worst < 1e-3, worst  # GPU kernels: looser than the CPU engines' 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="SGLang needs a CUDA device")
def test_real_sglang_serves_updated_weights(real_engine, tiny_model):
    weights = weights_of(tiny_model)
    prompts = [[1, 5, 6, 7, 17]]
    params = SamplingParams(n=1, greedy=True, max_new_tokens=8)
    before = real_engine.generate(prompts, params)[0][0]
    rng = np.random.default_rng(0)
    real_engine.load_weights((k, v + 0.05 * rng.standard_normal(v.shape).astype(np.float32)) for k, v in weights.items())
    changed = real_engine.generate(prompts, params)[0][0]
    real_engine.load_weights(weights.items())
    restored = real_engine.generate(prompts, params)[0][0]
    assert changed.logprobs != before.logprobs
    assert restored.token_ids == before.token_ids
    assert max(abs(a - b) for a, b in zip(restored.logprobs, before.logprobs)) < 1e-4
