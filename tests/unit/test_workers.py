"""In-process worker pieces (no Ray): prompts, the HF engine, batching, scoring, the policy
update (including FSDP2 over two gloo ranks) and the supervised warm-up, on the tiny model."""

from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ratchet.config.schema import RunConfig
from ratchet.models.tiny import VOCAB
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.object_store import ObjectStore
from ratchet.tasks.generate import write_task_parquet
from ratchet.tasks.rewards import compute_score, digit_match_score
from ratchet.workers.batch import PAD_ID, RolloutBatch, ScoredStep, load_scores, save_scores
from ratchet.workers.engines.hf import HFEngine
from ratchet.workers.engines.base import SamplingParams
from ratchet.workers.policy_update import PolicyTrainer, response_logits, token_logprobs
from ratchet.workers.prompts import PromptSet
from ratchet.workers.batch_seeds import prompt_indices, prompt_seeds
from ratchet.workers.rollout_batching import generate_batch
from ratchet.workers.scoring import score_batch
from ..configs import make_cfg

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PAD, BOS, EOS = VOCAB.index("<pad>"), VOCAB.index("<bos>"), VOCAB.index("<eos>")
EQ, COLON, COPY = VOCAB.index("="), VOCAB.index(":"), VOCAB.index("copy")


def digit_id(d: str) -> int:
    return VOCAB.index(d)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def copy_data(tmp_path_factory) -> Path:
    return write_task_parquet(tmp_path_factory.mktemp("data") / "copy.parquet", "copy", 64, seed=0, min_len=4, max_len=4)


@pytest.fixture(scope="module")
def prompts(copy_data, tokenizer) -> PromptSet:
    return PromptSet(str(copy_data), tokenizer, max_prompt_length=64)


@pytest.fixture(scope="module")
def ragged_prompts(tmp_path_factory, tokenizer) -> PromptSet:
    """Prompts of different lengths, so batches have real left padding."""
    path = write_task_parquet(tmp_path_factory.mktemp("ragged") / "copy.parquet", "copy", 16, seed=1, min_len=1, max_len=6)
    return PromptSet(str(path), tokenizer, max_prompt_length=64)


@pytest.fixture(scope="module")
def engine(tiny_model) -> HFEngine:
    return HFEngine(str(tiny_model))


def train(trainer: PolicyTrainer, batch: RolloutBatch, rewards: torch.Tensor) -> dict[str, float]:
    """One update on a single-part step; the metrics."""
    return trainer.train_step(ScoredStep(batch, rewards, None), kl_coef=trainer.cfg.algorithm.kl.coef).metrics


@pytest.fixture(scope="module")
def train_batch(engine, ragged_prompts) -> RolloutBatch:
    """2 prompts x 4 samples = 8 rows (divisible by 2 ranks), prompts of different lengths."""
    lengths = [len(t) for t in ragged_prompts.token_ids]
    short, long = lengths.index(min(lengths)), lengths.index(max(lengths))
    assert lengths[short] < lengths[long]
    params = SamplingParams(n=4, max_new_tokens=6, seed=11)
    return generate_batch(engine, ragged_prompts, [short, long], params, policy_version=0)


# Rewards with spread inside each group (rows 0-3: prompt A, rows 4-7: prompt B).
TRAIN_REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.25, 0.0])


# --------------------------------------------------------------------------- PromptSet


def test_prompt_set_uses_chat_template(prompts):
    assert len(prompts) == 64
    for i in (0, 17, 63):
        ids = prompts.token_ids[i]
        info = prompts.sample_info(i)
        truth = info["ground_truth"]
        assert len(truth) == 4 and truth.isdigit()
        # "<bos>" "copy" ":" d d d d "="
        assert ids == [BOS, COPY, COLON, *[digit_id(d) for d in truth], EQ]
        assert ids[-1] == EQ
        assert info["data_source"] == "digits/copy"
        assert info["extra_info"]["index"] == i


def test_prompt_set_rejects_long_prompts(copy_data, tokenizer):
    # each prompt is 8 tokens
    PromptSet(str(copy_data), tokenizer, max_prompt_length=8)
    with pytest.raises(ValueError, match=r"data\.max_prompt_length=7") as err:
        PromptSet(str(copy_data), tokenizer, max_prompt_length=7)
    assert "8 tokens" in str(err.value)


def test_prompt_indices_wrap():
    assert prompt_indices(62, 4, 64) == [62, 63, 0, 1]
    assert prompt_indices(0, 3, 64) == [0, 1, 2]


# --------------------------------------------------------------------------- sampling seeds


class RecordingEngine(HFEngine):
    """The HF engine, recording the seed and the sampled tokens of every `generate` call."""

    calls: list[tuple[int | None, list[list[list[int]]]]] = []

    def generate(self, prompts, params, **kwargs):
        groups = super().generate(prompts, params, **kwargs)
        type(self).calls.append((params.seed, [[list(g.token_ids) for g in group] for group in groups]))
        return groups


@pytest.fixture
def recording_engine():
    from ratchet.workers.engines import ENGINES

    ENGINES.register("recording", RecordingEngine)
    RecordingEngine.calls = []
    yield "recording"
    del ENGINES.entries["recording"]


def test_local_loop_samples_what_the_rollout_worker_samples(tiny_model, copy_data, tmp_path, recording_engine):
    """One seed formula (`batch_seeds.sampling_seed`) for both: the local loop's step 3
    draws the seed, and so the samples, of the workflow's batch 3; a refill round another."""
    from ratchet.workers.local_loop import LocalLoop
    from ratchet.workers.rollout import RolloutWorker
    from ratchet.workers.batch_seeds import sampling_seed

    cfg = RunConfig.model_validate(
        {
            "seed": 7,
            "model": {"path": str(tiny_model)},
            "data": {"train_files": str(copy_data)},
            "rollout": {"n": 2, "max_response_length": 4, "engine": recording_engine},
            "loop": {"prompts_per_step": 2},
            "trainer": {"micro_batch_size": 4},
            "storage": {"root": str(tmp_path)},
        }
    )
    worker = RolloutWorker(cfg, str(tiny_model), str(tmp_path / "run"))
    worker.generate(3, prompt_start=6, prompt_count=2, policy_version=0)
    worker.generate(3, prompt_start=6, prompt_count=2, policy_version=0, part=1)
    LocalLoop(cfg).step(3)
    (rollout_seed, rollout_samples), (refill_seed, _), (local_seed, local_samples) = RecordingEngine.calls
    assert rollout_seed == local_seed == sampling_seed(7, 3, 0) == (7 * 1_000_003 + 3) * 101
    assert local_samples == rollout_samples
    assert refill_seed == sampling_seed(7, 3, 1) != rollout_seed


def test_a_prefetched_share_is_the_one_its_request_would_generate(tiny_model, copy_data, tmp_path):
    """Sync mode starts the next batch right after the weight sync (`prefetch_share`): the
    request with the same arguments gets exactly the samples it would have generated itself,
    with no second generation; other arguments or a weight load in between: generated anew."""
    from ratchet.workers.rollout import RolloutWorker

    cfg = make_cfg(
        tiny_model, data={"train_files": str(copy_data)}, rollout={"n": 2, "max_response_length": 4}, loop={"prompts_per_step": 2}
    )
    worker = RolloutWorker(cfg, str(tiny_model), str(tmp_path / "run"))
    args = (5, 10, 2, 0, 0, False, 0)  # batch, prompt start, count, version, part, exact, position
    _, fresh = worker.generate_share_and_version(*args)
    worker.prefetch_share(*args)
    generations = []
    worker.generate_share = lambda *a: generations.append(a) or RolloutWorker.generate_share(worker, *a)
    version, ahead = worker.generate_share_and_version(*args)
    assert generations == [] and version == 0
    for name in ("response_ids", "response_mask", "rollout_logprobs", "prompt_index"):
        assert torch.equal(getattr(ahead.batch, name), getattr(fresh.batch, name)), name
    worker.generate_share_and_version(*args)  # a kept share serves one request only
    assert len(generations) == 1

    worker.prefetch_share(*args)
    worker.generate_share_and_version(6, 12, 2, 0, 0, False, 0)  # another batch: generated, and the kept one dropped
    worker.generate_share_and_version(*args)
    assert len(generations) == 4  # the prefetch, the other batch, this one again

    worker.prefetch_share(*args)
    worker.load_weights({k: v.detach().numpy() for k, v in worker.engine.model.state_dict().items()}, version=0)
    worker.generate_share_and_version(*args)  # a load in between: those samples came from the old weights
    assert len(generations) == 6


def test_a_prefetch_queued_behind_a_load_that_brought_no_new_version_does_not_generate(tiny_model, copy_data, tmp_path):
    """The step queues each replica's prefetch of the next batch behind its
    `load_published` of the new version. When the trainer published nothing (weights in
    more than one bucket: the step streams them afterwards) the replica still holds the old
    version, and the prefetch is skipped rather than sample from stale weights; once the
    version is loaded, the prefetch generates."""
    from ratchet.workers.rollout import RolloutWorker
    from ratchet.workers.weight_sync import as_source

    cfg = make_cfg(
        tiny_model, data={"train_files": str(copy_data)}, rollout={"n": 2, "max_response_length": 4}, loop={"prompts_per_step": 2}
    )
    worker = RolloutWorker(cfg, str(tiny_model), str(tmp_path / "run"))
    generations = []
    worker.generate_share = lambda *a: generations.append(a) or RolloutWorker.generate_share(worker, *a)
    next_batch = (5, 10, 2, 1, 0, False, 0)  # batch, prompt start, count, version 1, part, exact, position
    assert worker.load_published(None) is None and worker.version == 0
    worker.prefetch_share(*next_batch)
    assert generations == [] and worker._prefetched is None

    weights = {k: v.detach().numpy() for k, v in worker.engine.model.state_dict().items()}
    report = worker.load_published(as_source(weights, 1))
    assert (report.version, worker.version) == (1, 1)
    assert report.bytes == sum(v.nbytes for v in weights.values()) and report.seconds > 0
    worker.prefetch_share(*next_batch)
    assert len(generations) == 1
    assert worker.generate_share_and_version(*next_batch)[0] == 1 and len(generations) == 1  # the request took it


# --------------------------------------------------------------------------- HFEngine


def check_generation(gen, max_new_tokens: int) -> None:
    assert len(gen.token_ids) == len(gen.logprobs) > 0
    assert gen.token_ids[-1] == EOS or len(gen.token_ids) == max_new_tokens
    assert EOS not in gen.token_ids[:-1]  # nothing after the first EOS
    assert all(lp <= 0.0 and math.isfinite(lp) for lp in gen.logprobs)


def test_engine_samples_n_per_prompt_and_is_seeded(engine, prompts):
    batch = [prompts.token_ids[i] for i in (0, 1, 2)]
    params = SamplingParams(n=4, max_new_tokens=6, seed=1234)
    out = engine.generate(batch, params)
    assert len(out) == 3 and all(len(group) == 4 for group in out)
    for group in out:
        for gen in group:
            check_generation(gen, 6)
    again = engine.generate(batch, params)
    assert [[g.token_ids for g in grp] for grp in again] == [[g.token_ids for g in grp] for grp in out]
    assert [[g.logprobs for g in grp] for grp in again] == [[g.logprobs for g in grp] for grp in out]
    other = engine.generate(batch, SamplingParams(n=4, max_new_tokens=6, seed=99))
    assert [[g.token_ids for g in grp] for grp in other] != [[g.token_ids for g in grp] for grp in out]
    # samples of one prompt differ from each other (random model, 21 tokens, 6 steps)
    assert len({tuple(g.token_ids) for g in out[0]}) > 1


def test_engine_greedy_gives_n_identical_samples(engine, prompts):
    batch = [prompts.token_ids[i] for i in (3, 4)]
    out = engine.generate(batch, SamplingParams(n=3, max_new_tokens=5, greedy=True, seed=0))
    assert len(out) == 2
    for group in out:
        assert len(group) == 3
        assert all(g.token_ids == group[0].token_ids and g.logprobs == group[0].logprobs for g in group)
        check_generation(group[0], 5)
    # greedy does not depend on the seed
    other = engine.generate(batch, SamplingParams(n=3, max_new_tokens=5, greedy=True, seed=7))
    assert [g[0].token_ids for g in other] == [g[0].token_ids for g in out]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["per-prompt seeds", "one seed", "greedy"])
def test_engine_never_holds_more_than_a_steps_logits(tmp_path, mode):
    """Every sampling mode records one log-prob per row and step as it draws: its largest
    allocation is about one step's float32 logits, whatever the number of steps. Keeping
    HF's `output_scores` to the end (as the engine once did outside the per-prompt path)
    allocates all steps' logits at once: 64x here, 80 GB at 256 rows x 152k x 512 steps
    (torch's profiler counts the bytes of each allocation: no timing involved)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ratchet.models.tiny import build_tokenizer

    vocab, rows, steps = 32768, 16, 64
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    build_tokenizer().save_pretrained(tmp_path / "m")
    engine = HFEngine(str(tmp_path / "m"))
    prompts = [[1, 3 + i, 17] for i in range(rows // 4)]
    params = {
        "per-prompt seeds": SamplingParams(n=4, max_new_tokens=steps, seed=0, prompt_seeds=tuple(range(len(prompts)))),
        "one seed": SamplingParams(n=4, max_new_tokens=steps, seed=0),
        "greedy": SamplingParams(n=1, max_new_tokens=steps, greedy=True),
    }[mode]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = engine.generate(prompts * (4 if mode == "greedy" else 1), params)
    assert sum(len(g.token_ids) for grp in out for g in grp) > rows * steps // 2  # a random model rarely ends early
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest <= 2 * rows * vocab * 4, largest / (rows * vocab * 4)


# --------------------------------------------------------------------------- generate_batch


def test_generate_batch_shapes_masks_and_versions(engine, ragged_prompts):
    by_length = {len(t): i for i, t in enumerate(ragged_prompts.token_ids)}
    assert len(by_length) >= 3
    indices = [by_length[n] for n in sorted(by_length)[:3]]  # three different prompt lengths
    params = SamplingParams(n=4, max_new_tokens=6, seed=3)
    batch = generate_batch(engine, ragged_prompts, indices, params, policy_version=3)
    # generate_batch seeds each prompt by its position in the batch (batch_seeds.prompt_seeds).
    seeded = replace(params, prompt_seeds=prompt_seeds(params.seed, 0, len(indices)))
    groups = engine.generate([ragged_prompts.token_ids[i] for i in indices], seeded)
    gens = [g for grp in groups for g in grp]
    b = 12
    prompt_w = max(len(ragged_prompts.token_ids[i]) for i in indices)
    resp_w = max(len(g.token_ids) for g in gens)
    assert len(batch) == b
    assert batch.prompt_ids.shape == batch.prompt_mask.shape == (b, prompt_w)
    for t in (batch.response_ids, batch.response_mask, batch.rollout_logprobs, batch.policy_version):
        assert t.shape == (b, resp_w)
    assert batch.input_ids.shape == batch.attention_mask.shape == (b, prompt_w + resp_w)
    assert batch.prompt_index.tolist() == [indices[0]] * 4 + [indices[1]] * 4 + [indices[2]] * 4
    assert batch.response_mask.dtype == torch.float32 and batch.policy_version.dtype == torch.long
    for r in range(b):
        p = ragged_prompts.token_ids[indices[r // 4]]
        k = len(gens[r].token_ids)
        # prompts left-padded
        assert batch.prompt_ids[r, prompt_w - len(p) :].tolist() == p
        assert batch.prompt_ids[r, : prompt_w - len(p)].eq(PAD_ID).all()
        assert batch.prompt_mask[r].tolist() == [0] * (prompt_w - len(p)) + [1] * len(p)
        # responses right-padded
        assert batch.response_ids[r, :k].tolist() == gens[r].token_ids
        assert batch.response_ids[r, k:].eq(PAD_ID).all()
        assert batch.response_mask[r].tolist() == [1.0] * k + [0.0] * (resp_w - k)
        torch.testing.assert_close(batch.rollout_logprobs[r, :k], torch.tensor(gens[r].logprobs))
        assert batch.rollout_logprobs[r, k:].eq(0).all()
        assert batch.policy_version[r].tolist() == [3] * k + [0] * (resp_w - k)
        assert batch.samples[r] == ragged_prompts.sample_info(indices[r // 4])


def test_rollout_batch_select_and_store_round_trip(train_batch, tmp_path):
    sub = train_batch.select(torch.tensor([6, 1]))
    assert len(sub) == 2 and torch.equal(sub.response_ids[0], train_batch.response_ids[6])
    assert sub.samples == [train_batch.samples[6], train_batch.samples[1]]
    store = BatchStore(ObjectStore(str(tmp_path)))
    train_batch.save(store, 4)
    save_scores(store, 4, TRAIN_REWARDS, [{"exact": 0.0}] * 8)
    back = RolloutBatch.load(store, 4)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logprobs", "policy_version", "prompt_index"):
        assert torch.equal(getattr(back, name), getattr(train_batch, name)), name
    assert back.samples == train_batch.samples
    rewards, extras = load_scores(store, 4)
    assert torch.equal(rewards, TRAIN_REWARDS) and extras == [{"exact": 0.0}] * 8


@pytest.mark.parametrize("ragged", [False, True])
def test_engine_logprobs_match_trainer_recompute(engine, tiny_model, prompts, ragged_prompts, ragged):
    from transformers import AutoModelForCausalLM

    source = ragged_prompts if ragged else prompts
    indices = list(range(6))
    batch = generate_batch(engine, source, indices, SamplingParams(n=3, max_new_tokens=8, seed=5), policy_version=0)
    if ragged:
        assert batch.prompt_mask.sum(-1).unique().numel() > 1  # real left padding
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.no_grad():
        recomputed = token_logprobs(response_logits(model, batch, 1.0), batch.response_ids)
    mask = batch.response_mask.bool()
    assert mask.sum() > 20
    diff = (recomputed - batch.rollout_logprobs).abs()[mask]
    assert diff.max().item() < 1e-4, diff.max().item()


# --------------------------------------------------------------------------- scoring


def test_digit_match_score_cases():
    assert digit_match_score("1234", "1234") == 1.0  # exact
    assert digit_match_score("1244", "1234") == 3 / 4  # one wrong position
    assert digit_match_score("12", "1234") == 2 / 4  # too short
    assert digit_match_score("12345678", "1234") == 4 / 8  # longer response penalised
    assert digit_match_score("4321", "1234") == 0.0
    assert digit_match_score(" 1 2-3x4 = ", "1234") == 1.0  # non-digits ignored
    assert digit_match_score("abc", "1234") == 0.0
    assert digit_match_score("", "1234") == 0.0
    assert digit_match_score("", "") == 1.0  # empty ground truth: only an empty answer is right
    assert digit_match_score("no digits", "") == 1.0
    assert digit_match_score("7", "") == 0.0


def test_compute_score_dict_and_unknown_source():
    assert compute_score("digits/copy", "1234", "1234") == {"score": 1.0, "exact": 1.0}
    assert compute_score("digits/sort", "12 3 5", "1234") == {"score": 3 / 4, "exact": 0.0}
    with pytest.raises(ValueError, match="reward.function"):
        compute_score("gsm8k", "1", "1")


def hand_batch(responses: list[list[int]], lengths: list[int], truths: list[str]) -> RolloutBatch:
    b, width = len(responses), max(len(r) for r in responses)
    response_ids = torch.full((b, width), PAD, dtype=torch.long)
    response_mask = torch.zeros(b, width)
    for r, (ids, n) in enumerate(zip(responses, lengths)):
        response_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        response_mask[r, :n] = 1.0
    prompt = torch.tensor([[BOS, COPY, COLON, EQ]] * b)
    return RolloutBatch(
        prompt_ids=prompt,
        prompt_mask=torch.ones_like(prompt),
        response_ids=response_ids,
        response_mask=response_mask,
        rollout_logprobs=torch.zeros(b, width),
        policy_version=response_mask.long(),
        prompt_index=torch.arange(b),
        samples=[{"data_source": "digits/copy", "ground_truth": t, "extra_info": {}} for t in truths],
    )


def test_score_batch_by_hand(tokenizer):
    d = {str(i): digit_id(str(i)) for i in range(10)}
    batch = hand_batch(
        responses=[
            [d["1"], d["2"], d["3"], d["4"], EOS],  # exact; EOS is a special token, skipped
            [d["1"], d["2"], d["9"], d["9"], EOS, d["3"], d["4"]],  # tokens past the mask ignored
            [d["1"], d["2"], d["3"], d["4"], d["5"], d["6"]],  # cut at max length, too long
            [d["7"]],  # empty response (mask 0)
            [COPY, d["5"], COLON, d["6"], EOS],  # words ignored: "56"
        ],
        lengths=[5, 5, 6, 0, 5],
        truths=["1234", "1234", "1234", "12", "56"],
    )
    rewards, extras = score_batch(batch, tokenizer, compute_score)
    assert rewards.dtype == torch.float32
    # "1234" vs "1234": 4/4;  "1299" vs "1234": 2 hits / 4;  "123456": 4 hits / max(4, 6)
    # "" vs "12": 0 / 2;  "copy5:6" -> digits "56" vs "56": 1
    torch.testing.assert_close(rewards, torch.tensor([1.0, 0.5, 4 / 6, 0.0, 1.0]))
    assert extras == [{"exact": 1.0}, {"exact": 0.0}, {"exact": 0.0}, {"exact": 0.0}, {"exact": 1.0}]


def test_score_batch_float_and_bad_dict(tokenizer):
    batch = hand_batch([[digit_id("3"), EOS]], [2], ["3"])
    seen = {}

    def plain(data_source, solution_str, ground_truth, extra_info=None):
        seen.update(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info)
        return 0.25

    rewards, extras = score_batch(batch, tokenizer, plain)
    assert rewards.tolist() == [0.25] and extras == [{}]
    assert seen == {"data_source": "digits/copy", "solution_str": "3", "ground_truth": "3", "extra_info": {}}
    with pytest.raises(ValueError, match="without 'score'"):
        score_batch(batch, tokenizer, lambda **kw: {"reward": 1.0})


# --------------------------------------------------------------------------- PolicyTrainer


def finite_metrics(metrics: dict) -> None:
    # "kl" is reported only when there is a reference model (algorithm.kl.coef > 0).
    for key in ("pg_loss", "entropy", "clip_frac", "grad_norm", "logprob_diff", "adv_abs_mean", "response_length"):
        assert key in metrics, key
        assert math.isfinite(metrics[key]), (key, metrics[key])


def test_train_step_updates_weights(tiny_model, train_batch):
    trainer = PolicyTrainer(str(tiny_model), make_cfg(tiny_model))
    assert trainer.reference is None  # kl.coef = 0: no reference model, so no KL metric either
    before = {k: v.clone() for k, v in trainer.full_state().items()}
    assert trainer.version == 0
    metrics = train(trainer, train_batch, TRAIN_REWARDS)
    assert trainer.version == 1
    finite_metrics(metrics)
    assert metrics["grad_norm"] > 0
    assert metrics["entropy"] > 0
    assert "kl" not in metrics
    # one epoch: the policy that computes the loss is the old policy, ratio 1, nothing clipped
    assert metrics["clip_frac"] == 0.0
    # the engine sampled with the same weights: behaviour and old log-probs agree
    assert metrics["logprob_diff"] < 1e-4
    assert metrics["response_length"] == pytest.approx(train_batch.response_mask.sum(-1).mean().item())
    # mean |A| over masked tokens; Dr. GRPO off, so the advantage is normalised and non-zero
    assert metrics["adv_abs_mean"] > 0.1
    after = trainer.full_state()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2
    assert "model.layers.0.self_attn.q_proj.weight" in changed
    train(trainer, train_batch, TRAIN_REWARDS)
    assert trainer.version == 2
    np_state = trainer.state_numpy()
    assert set(np_state) == set(after) and trainer.num_parameters() > 500_000


@pytest.mark.slow
@pytest.mark.parametrize("ppo_epochs", [1, 2])
def test_old_logprobs_from_the_update_match_a_forward_pass_of_their_own(tiny_model, train_batch, monkeypatch, ppo_epochs):
    """One pass with nothing reading the old log-probs before it: they are the update's own
    forward pass, and the weights and metrics (the off-policy diagnostics included) are the
    ones a separate no-gradient forward pass gives, with one forward pass fewer per
    micro-batch. Two passes need them before the first optimizer step: no shortcut then."""
    cfg = make_cfg(tiny_model, algorithm={"kl": {"coef": 0.1, "type": "low_var_kl"}}, trainer={"ppo_epochs": ppo_epochs})

    def run(shortcut: bool):
        trainer = PolicyTrainer(str(tiny_model), cfg)
        if not shortcut:
            monkeypatch.setattr(trainer, "old_logprobs_from_the_update", lambda *a: False)
        forwards = []
        trainer.model.register_forward_hook(lambda *a: forwards.append(1))
        metrics = train(trainer, train_batch, TRAIN_REWARDS)
        return trainer.full_state(), metrics, len(forwards)

    weights, metrics, forwards = run(shortcut=True)
    weights_2, metrics_2, forwards_2 = run(shortcut=False)
    # (the reference is a model of its own, without the hook)
    assert forwards_2 == (2 * forwards if ppo_epochs == 1 else forwards), (forwards, forwards_2)
    assert metrics.keys() == metrics_2.keys() and "off_policy/ppo_kl" in metrics
    for name in metrics:
        assert metrics[name] == pytest.approx(metrics_2[name], rel=1e-5, abs=1e-7), name
    for name in weights:
        torch.testing.assert_close(weights[name], weights_2[name], rtol=0, atol=1e-7, msg=name)


def test_train_step_several_ppo_epochs(tiny_model, train_batch):
    trainer = PolicyTrainer(str(tiny_model), make_cfg(tiny_model, trainer={"ppo_epochs": 3, "lr": 1e-2}))
    metrics = train(trainer, train_batch, TRAIN_REWARDS)
    finite_metrics(metrics)
    assert trainer.version == 1  # one version per train_step, whatever the epochs
    # later epochs see a moved policy: ratios leave the clip range and log-probs drift
    assert 0.0 < metrics["clip_frac"] <= 1.0
    assert metrics["logprob_diff"] > 1e-3


def test_zero_advantage_batch_leaves_policy_gradient_zero(tiny_model, train_batch):
    trainer = PolicyTrainer(str(tiny_model), make_cfg(tiny_model))
    metrics = train(trainer, train_batch, torch.ones(8))  # every group's rewards equal
    finite_metrics(metrics)
    assert metrics["adv_abs_mean"] == 0.0
    assert metrics["grad_norm"] == 0.0
    assert trainer.version == 1


def test_kl_to_reference(tiny_model, train_batch):
    cfg = make_cfg(tiny_model, algorithm={"kl": {"coef": 0.1, "type": "low_var_kl"}})
    trainer = PolicyTrainer(str(tiny_model), cfg)
    assert trainer.reference is not None
    assert all(not p.requires_grad for p in trainer.reference.parameters())
    first = train(trainer, train_batch, TRAIN_REWARDS)
    finite_metrics(first)
    assert abs(first["kl"]) < 1e-7  # policy == reference before the first update
    kls = [train(trainer, train_batch, TRAIN_REWARDS)["kl"] for _ in range(3)]
    assert all(math.isfinite(k) for k in kls)
    assert kls[-1] > 1e-6
    # the reference stays frozen at the initial weights
    from safetensors.torch import load_file

    initial = load_file(str(tiny_model / "model.safetensors"))
    ref_state = trainer.reference.state_dict()
    for name, tensor in initial.items():
        assert torch.equal(ref_state[name], tensor), name


# --------------------------------------------------------------------------- warm-up


def test_supervised_warmup_lowers_loss(tiny_model, tokenizer, prompts):
    from transformers import AutoModelForCausalLM

    from ratchet.workers.warmup import supervised_warmup

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    losses = supervised_warmup(model, tokenizer, prompts, steps=30, lr=3e-3, batch_size=16, seed=0)
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert not model.training


# --------------------------------------------------------------------------- FSDP2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_rank(rank: int, world_size: int, port: int, model_path: str, cfg_json: str, run_dir: str, out_dir: str) -> None:
    """One trainer rank (runs in a spawned process)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        cfg = RunConfig.model_validate_json(cfg_json)
        store = BatchStore(ObjectStore(run_dir))
        batch = RolloutBatch.load(store, 0)
        rewards, _ = load_scores(store, 0)
        trainer = PolicyTrainer(model_path, cfg, rank=rank, world_size=world_size)
        metrics = train(trainer, batch, rewards)
        state = trainer.full_state()  # a collective: every rank calls it
        if rank == 0:
            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "weights.safetensors"))
            Path(out_dir, "metrics.json").write_text(json.dumps(metrics))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_two_ranks_match_single_rank(tiny_model, train_batch, tmp_path):
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    assert len(train_batch) % 2 == 0
    # micro_batch_size 2: one rank runs 2 micro-batches of its 4 rows, the single rank 4 of 8
    cfg = make_cfg(tiny_model, trainer={"micro_batch_size": 2, "lr": 1e-3}, algorithm={"kl": {"coef": 0.05}})
    # End some responses early so the ranks hold different token counts (rank 0 takes rows
    # 0, 2, 4, 6; rank 1 rows 1, 3, 5, 7): only a global normaliser gives equal results.
    batch = train_batch.select(slice(None))
    for row, length in {2: 2, 4: 1, 6: 3, 3: 5}.items():
        batch.response_ids[row, length - 1] = EOS
        batch.response_ids[row, length:] = PAD
        batch.response_mask[row, length:] = 0.0
        batch.policy_version[row, length:] = 0
    tokens = batch.response_mask.sum(-1)
    assert tokens[0::2].sum() != tokens[1::2].sum()
    store = BatchStore(ObjectStore(str(tmp_path / "run")))
    batch.save(store, 0)
    save_scores(store, 0, TRAIN_REWARDS, [{}] * len(batch))

    single = PolicyTrainer(str(tiny_model), cfg)
    single_metrics = train(single, batch, TRAIN_REWARDS)
    expected = single.full_state()

    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(
        _fsdp_rank,
        args=(2, free_port(), str(tiny_model), cfg.model_dump_json(), str(tmp_path / "run"), str(out)),
        nprocs=2,
        join=True,
    )
    sharded = load_file(str(out / "weights.safetensors"))
    sharded_metrics = json.loads((out / "metrics.json").read_text())
    assert set(sharded) == set(expected)
    worst = max((sharded[k] - expected[k]).abs().max().item() for k in expected)
    assert worst < 1e-5, worst
    for key in ("pg_loss", "kl", "entropy", "clip_frac", "grad_norm"):
        assert sharded_metrics[key] == pytest.approx(single_metrics[key], abs=1e-5), key


def test_retried_train_call_does_not_update_twice(tiny_model, train_batch, tmp_path):
    """An activity retried after its first attempt already trained gets that result back."""
    from ratchet.workers.trainer import TrainerWorker

    run = ObjectStore(str(tmp_path / "run"))
    store = BatchStore(run)
    train_batch.save(store, 0)
    save_scores(store, 0, TRAIN_REWARDS, [{}] * len(train_batch))
    worker = TrainerWorker(make_cfg(tiny_model), str(tiny_model), run.url, 0, 1)
    worker.setup(0)
    first = worker.train(0, 0, 0.0)
    after_first = {k: v.clone() for k, v in worker.trainer.full_state().items()}
    again = worker.train(0, 0, 0.0)
    assert again.policy_version == first.policy_version == 1
    assert again.metrics["pg_loss"] == first.metrics["pg_loss"]
    assert all(torch.equal(after_first[k], v) for k, v in worker.trainer.full_state().items())
    with pytest.raises(RuntimeError, match="holds policy v1, asked to train v0"):
        worker.train(1, 0, 0.0)


@pytest.mark.slow
def test_the_submit_check_and_the_reward_worker_leave_scikit_learn_scipy_and_the_model_registry_unimported(tiny_model, copy_data, tmp_path):
    """transformers imports scikit-learn and SciPy (1.5-2 s of CPU) whenever installed, and
    AutoTokenizer its whole auto-model registry (about 2 s more); the config check at submit
    and the reward worker only need a tokenizer, so they import neither (hf_imports.py).
    Each in a fresh process, as a Ray actor's is; scikit-learn stays importable for a user's
    reward function."""
    import subprocess
    import sys

    head = "import importlib.util, sys\nfrom ratchet.platform.client import RECIPE_PATH\n"
    tail = 'assert "transformers.tokenization_utils_tokenizers" in sys.modules, "no tokenizer loaded: nothing shown"\n' + (
        'print("sklearn" in sys.modules or "scipy" in sys.modules, importlib.util.find_spec("sklearn") is not None,'
        ' "transformers.models.auto.modeling_auto" in sys.modules or "transformers.generation.utils" in sys.modules)'
    )
    overrides = [f"model.path={tiny_model}", f"data.train_files={copy_data}", "data.eval_files=null", f"storage.root={tmp_path}"]
    checks = {
        "submit check": f"from ratchet.config import load_config\nload_config(RECIPE_PATH, {overrides!r})\n",
        "reward worker": (
            "from ratchet.config import load_config\nfrom ratchet.workers.reward import RewardWorker\n"
            f"cfg = load_config(RECIPE_PATH, {overrides!r}, check_files=False)\n"
            'assert "transformers" not in sys.modules, "the reward worker must be the first to load transformers"\n'
            f"RewardWorker(cfg, {str(tiny_model)!r}, {str(tmp_path / 'run')!r})\n"
        ),
    }
    procs = {
        k: subprocess.Popen([sys.executable, "-c", head + c + tail], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for k, c in checks.items()
    }
    for what, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (what, err[-2000:])
        assert out.split() == ["False", "True", "False"], (what, out)


def test_load_tokenizer_gives_what_auto_tokenizer_gives(tiny_model, tmp_path):
    """The generic tokenizer is built directly (the same class AutoTokenizer picks, the same
    ids and text); a folder naming another class goes through AutoTokenizer and gets it."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from ratchet.hf_imports import load_tokenizer

    text = "1 2 3 4 -> 4 3 2 1"
    direct, auto = load_tokenizer(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    assert type(direct) is type(auto) and type(direct).__name__ == "TokenizersBackend"
    ids = direct(text).input_ids
    assert ids == auto(text).input_ids and len(ids) > 3
    assert direct.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    assert (direct.pad_token_id, direct.eos_token_id) == (auto.pad_token_id, auto.eos_token_id)

    other = tmp_path / "llama-tokenizer"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert type(load_tokenizer(other)) is type(AutoTokenizer.from_pretrained(other))
    assert type(load_tokenizer(other)).__name__ != "TokenizersBackend"


@pytest.mark.slow
def test_an_actor_generation_after_the_first_page_faults_nothing_back(tiny_model, copy_data, tmp_path):
    """glibc's malloc gives freed memory back to the kernel between two phases of a step,
    and the next phase faults it in again (thousands of page faults per generation of the
    tiny model: +10-15% of its CPU generation time). A worker process sets the thresholds
    of `runtime.MALLOC_THRESHOLDS` as it starts (mallopt, in `configure_worker_process`), after
    which the generations after the first fault almost nothing in. A fresh process without
    the MALLOC_ variables in its environment, as a Ray actor's is started."""
    import subprocess
    import sys

    from ratchet.workers.runtime import MALLOC_THRESHOLDS

    overrides = [f"model.path={tiny_model}", f"data.train_files={copy_data}", "data.eval_files=null", f"storage.root={tmp_path}"]
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_THRESHOLDS}
    script = (
        "import resource\nfrom ratchet.config import load_config\nfrom ratchet.platform.client import RECIPE_PATH\n"
        "from ratchet.workers.rollout import RolloutWorker\n"
        f"w = RolloutWorker(load_config(RECIPE_PATH, {overrides!r}, check_files=False), {str(tiny_model)!r}, {str(tmp_path / 'run')!r})\n"
        "for i in range(4):\n"
        "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    w.generate_share(0, 0, 16, 0)\n"  # one batch, the same each time: the same memory
        "    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    faults = [int(x) for x in out.stdout.split()]
    assert faults[0] > 1000, f"the first generation faults its memory in: {faults}"  # else this measures nothing
    # Measured over many runs: the three later generations fault 7,900-20,000 pages back in
    # with glibc's defaults, 0-1,500 with the settings (Python's own arenas, 128 pages at a time).
    assert sum(faults[1:]) < 3000, f"page faults per generation after the first: {faults}"
