"""Multi-turn tool rollouts in-process (src/ratchet/workers/multi_turn.py): masks with holes,
seeding, the turn and token limits, tool failures as observations, a weight swap between
turns, the example config, one training step of the local loop. No Ray.

The real HF engine and the tiny model where a property must hold for real samples (holes,
log-probs the trainer recomputes, per-prompt seeding); a scripted engine where a test
needs exact turns (the limits, the failures, the swap), since the tiny model writes
what it writes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ratchet.config.loader import ConfigError, load_config
from ratchet.tasks.tool_tasks import compute_score, write_tool_add_jsonl
from ratchet.tools.calculator import Calculator
from ratchet.tools.parsing import HermesFormat, WordsFormat
from ratchet.workers.batch import RolloutBatch
from ratchet.workers.engines.base import Generation, SamplingParams
from ratchet.workers.engines.hf import HFEngine
from ratchet.workers.multi_turn import MAX_TOKENS, MAX_TURNS, NO_CALL, MultiTurnRollout
from ratchet.workers.policy_update import response_logits, token_logprobs
from ratchet.workers.prompts import PromptSet
from ratchet.workers.rollout_batching import generate_batch
from ratchet.workers.scoring import score_batch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "copy_multi_turn_tools.yaml"
ADD_SCHEMA = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_model) -> HFEngine:
    return HFEngine(str(tiny_model))


@pytest.fixture(scope="module")
def tool_prompts(tmp_path_factory, engine) -> PromptSet:
    path = write_tool_add_jsonl(tmp_path_factory.mktemp("tool-add") / "train.jsonl", 12, seed=0)
    return PromptSet(str(path), engine.tokenizer, prompt_format="raw")


def words_driver(tokenizer, *, max_turns=3, budget=24, tools=None) -> MultiTurnRollout:
    return MultiTurnRollout(
        tools or {"add": Calculator(tool_schema=ADD_SCHEMA)}, tokenizer, fmt=WordsFormat(), max_turns=max_turns,
        max_tool_response_tokens=8, max_response_length=budget,
    )  # fmt: skip


def spans_agree_with_mask(batch: RolloutBatch) -> None:
    """Mask 0 exactly on tool spans up to the last token; log-prob 0 there; attention to the end."""
    for row, sample in enumerate(batch.samples):
        end = sample["turns"][-1]["end"]
        assert sample["turns"][-1]["role"] == "assistant"  # a conversation ends with the model
        expected = torch.zeros(batch.response_mask.shape[1])
        for span in sample["turns"]:
            if span["role"] == "assistant":
                expected[span["start"] : span["end"]] = 1.0
        assert torch.equal(batch.response_mask[row], expected)
        assert torch.all(batch.rollout_logprobs[row][expected == 0] == 0)
        assert batch.attention_mask[row, batch.prompt_ids.shape[1] :].tolist() == [1] * end + [0] * (len(expected) - end)


# -- real samples ---------------------------------------------------------------------------


def test_every_conversation_calls_the_tool_and_has_holes(engine, tiny_model, tool_prompts):
    from transformers import AutoModelForCausalLM

    driver = words_driver(engine.tokenizer)
    params = SamplingParams(n=3, max_new_tokens=24, seed=11)
    batch = generate_batch(engine, tool_prompts, list(range(6)), params, policy_version=0, multi_turn=driver)
    assert len(batch) == 18 and batch.prompt_index.tolist() == [i for i in range(6) for _ in range(3)]
    spans_agree_with_mask(batch)
    # The prompt opens the call: the first turn always completes it, so every row has a hole
    # (or stopped at the token limit before the answer could follow).
    for row, s in enumerate(batch.samples):
        calls = s["extra_info"]["tool_calls"]
        opened = engine.tokenizer.decode(batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()).split(":", 1)[1]
        assert calls and calls[0]["turn"] == 1 and calls[0]["arguments"]["expression"].startswith(opened)  # "48+94..."
        assert s["extra_info"]["stop_reason"] in (NO_CALL, MAX_TURNS, MAX_TOKENS)
        assert s["extra_info"]["tools_kwargs"] == {"add": {"create_kwargs": {}}}  # verl's per-row layout kept
    holes = [(row, span) for row, s in enumerate(batch.samples) for span in s["turns"] if span["role"] == "tool"]
    assert len(holes) >= 12
    # The trainer's forward sees the observations: its log-probs of later turns equal the engine's.
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.no_grad():
        recomputed = token_logprobs(response_logits(model, batch, 1.0), batch.response_ids)
    mask = batch.response_mask.bool()
    after_a_hole = torch.zeros_like(mask)
    for row, span in holes:
        after_a_hole[row, span["end"] :] = True
    assert (mask & after_a_hole).sum() > 20
    assert (recomputed - batch.rollout_logprobs).abs()[mask].max().item() < 1e-4
    # The reward reads the whole trajectory: the tool's answer is in the text it gets.
    row, span = next((r, sp) for r, sp in holes if not batch.samples[r]["extra_info"]["tool_calls"][0]["error"])
    answer = batch.samples[row]["extra_info"]["tool_calls"][0]["result"]
    seen = []
    score_batch(batch, engine.tokenizer, lambda data_source, solution_str, ground_truth, extra_info: seen.append(solution_str) or 0.0)
    assert answer in seen[row]
    rewards, extras = score_batch(batch, engine.tokenizer, compute_score)
    assert all(e["tool_calls"] >= 1 for e in extras) and torch.isfinite(rewards).all()


def test_conversations_are_seeded_per_prompt(engine, tool_prompts):
    """A retried rollout replays each conversation token for token, and a batch split over
    replicas (rollout_pool.py) gives the rows one engine would."""
    driver = words_driver(engine.tokenizer)
    params = SamplingParams(n=2, max_new_tokens=24, seed=3)

    def run(indices, first=0):
        return generate_batch(engine, tool_prompts, indices, params, policy_version=0, first_position=first, multi_turn=driver)

    whole = run([0, 1, 2, 3])
    again = run([0, 1, 2, 3])
    split = RolloutBatch.concat([run([0, 1]), run([2, 3], first=2)])
    for other in (again, split):
        assert torch.equal(whole.response_ids, other.response_ids) and torch.equal(whole.response_mask, other.response_mask)
        assert torch.allclose(whole.rollout_logprobs, other.rollout_logprobs, atol=1e-5)
        assert whole.samples == other.samples
    assert any(s["extra_info"]["num_turns"] > 1 for s in whole.samples)


# -- exact turns: a scripted engine ----------------------------------------------------------


class CharTokenizer:
    """Characters as token ids (a test double: any text can be written and read back)."""

    eos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i > 1)


class ScriptedEngine:
    """Answers turn k of every conversation with `turns[k]` (the last one repeated);
    offers `weight_swap` once per call, as a decode step would."""

    supports_partial_rollout = True
    tokenizer = CharTokenizer()
    pad_id = 0

    def __init__(self, turns: list[str]):
        self.turns = turns
        self.calls: list[tuple[int, SamplingParams]] = []

    def generate(self, prompts, params, *, version=0, weight_swap=None):
        self.calls.append((version, params))
        k = min(len(self.calls) - 1, len(self.turns) - 1)
        ids = [ord(c) for c in self.turns[k]][: params.max_new_tokens]
        n = 1 if params.greedy else params.n
        return [[Generation(ids, [-0.5] * len(ids), [version] * len(ids)) for _ in range(n)] for _ in prompts]


class Prompts:
    """A PromptSet stand-in over one text prompt."""

    def __init__(self, text: str, extra_info: dict | None = None):
        self.token_ids = [[ord(c) for c in text]]
        self.info = {"data_source": "t", "ground_truth": "", "extra_info": extra_info or {}}

    def __len__(self):
        return 1

    def sample_info(self, index):
        return dict(self.info)


def hermes(tool_name: str, expression: str) -> str:
    return f'<tool_call>{{"name": "{tool_name}", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def run_scripted(turns, *, max_turns=4, budget=400, tools=None, template=None, swap=None, extra_info=None):
    engine = ScriptedEngine(turns)
    driver = MultiTurnRollout(
        tools or {"calculator": Calculator()}, engine.tokenizer, fmt=HermesFormat(), max_turns=max_turns,
        max_tool_response_tokens=12, observation_template=template, max_response_length=budget,
    )  # fmt: skip
    params = SamplingParams(n=2, max_new_tokens=budget, seed=1)
    batch = generate_batch(engine, Prompts("Q?", extra_info), [0], params, policy_version=0, weight_swap=swap, multi_turn=driver)
    return batch, engine


def text_of(batch, row=0, ones=None) -> str:
    ids, mask = batch.response_ids[row].tolist(), batch.response_mask[row].tolist()
    return "".join(chr(i) for i, m in zip(ids, mask) if i > 1 and (ones is None or m == ones))


def test_a_call_then_an_answer_exact_mask():
    batch, engine = run_scripted([hermes("calculator", "6*7"), "It is 42."], template="[{result}]")
    call = hermes("calculator", "6*7")
    assert len(batch) == 2 and text_of(batch) == call + "[42]It is 42."
    assert text_of(batch, ones=1.0) == call + "It is 42." and text_of(batch, ones=0.0) == "[42]"
    assert batch.samples[0]["turns"] == [
        {"role": "assistant", "start": 0, "end": len(call)},
        {"role": "tool", "start": len(call), "end": len(call) + 4},
        {"role": "assistant", "start": len(call) + 4, "end": len(call) + 4 + 9},
    ]
    info = batch.samples[0]["extra_info"]
    assert info["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "6*7"}, "turn": 1, "result": "42", "error": False}]
    assert info["num_turns"] == 2 and info["stop_reason"] == NO_CALL
    spans_agree_with_mask(batch)
    # Turn 2 is one sample per conversation with its own seed: n=1, seeds differ by sample.
    _, params = engine.calls[1]
    assert params.n == 1 and len(set(params.prompt_seeds)) == 2


def test_turn_limit_stops_and_does_not_run_the_last_call():
    batch, _ = run_scripted([hermes("calculator", "1+1")], max_turns=2)
    info = batch.samples[0]["extra_info"]
    assert info["num_turns"] == 2 and info["stop_reason"] == MAX_TURNS
    assert [c.get("skipped", False) for c in info["tool_calls"]] == [False, True] and info["tool_calls"][1]["result"] is None
    assert [s["role"] for s in batch.samples[0]["turns"]] == ["assistant", "tool", "assistant"]  # no observation at the end
    spans_agree_with_mask(batch)


def test_token_limit_cuts_the_last_turn_and_never_ends_on_an_observation():
    call = hermes("calculator", "1+1")
    batch, _ = run_scripted([call], budget=len(call) * 2 + 20)
    info = batch.samples[0]["extra_info"]
    assert info["stop_reason"] == MAX_TOKENS and batch.response_ids.shape[1] <= len(call) * 2 + 20
    spans_agree_with_mask(batch)
    # Room for the call but not for an answer and one more token: the observation is dropped.
    batch, _ = run_scripted([call], budget=len(call) + 5)
    assert batch.samples[0]["extra_info"]["stop_reason"] == MAX_TOKENS
    assert [s["role"] for s in batch.samples[0]["turns"]] == ["assistant"]


def test_tool_response_is_cut_to_max_tool_response_tokens():
    batch, _ = run_scripted([hermes("calculator", "2**200"), "ok"], template="{result}")
    assert text_of(batch, ones=0.0) == str(2**200)[:12]


@pytest.mark.parametrize(
    "first_turn, observation",
    [
        (hermes("nope", "1"), "error: unknown tool 'nope'; tools: calculator"),
        (hermes("calculator", "__import__('os')"), "error: calling __import__ is not allowed"),
        ("<tool_call>{bad json</tool_call>", "error: malformed tool call (JSONDecodeError"),
        (hermes("slow", "1"), "error: tool slow timed out after 0.2 s"),
        (hermes("crash", "1"), "error: RuntimeError: tool bug"),
    ],
)
def test_tool_failures_become_observations(first_turn, observation):
    class Slow(Calculator):
        def __call__(self, args):
            import time

            time.sleep(3)

    class Crash(Calculator):
        def __call__(self, args):
            raise RuntimeError("tool bug")

    schema = lambda name: {"type": "function", "function": {"name": name, "parameters": Calculator().parameters}}  # noqa: E731
    tools = {"calculator": Calculator(), "slow": Slow({"timeout_s": 0.2}, schema("slow")), "crash": Crash(None, schema("crash"))}
    batch, _ = run_scripted([first_turn, "done"], tools=tools, template="{result}", budget=1000)
    assert text_of(batch, ones=0.0).startswith(observation[:12])
    assert batch.samples[0]["extra_info"]["tool_calls"][0]["result"].startswith(observation)
    assert batch.samples[0]["extra_info"]["tool_calls"][0]["error"] is True
    assert text_of(batch).endswith("done")  # the conversation went on


def test_weights_swapped_between_turns_tag_the_later_tokens():
    offered = []

    def swap():
        offered.append(1)
        return 7 if len(offered) == 1 else None

    batch, engine = run_scripted([hermes("calculator", "1"), "fine"], swap=swap)
    assert offered  # the driver offered the swap at the turn boundary
    turns = batch.samples[0]["turns"]
    versions = batch.policy_version[0]
    assert versions[: turns[0]["end"]].unique().tolist() == [0]
    assert versions[turns[1]["start"] : turns[1]["end"]].unique().tolist() == [0]  # the observation: its turn's version
    assert versions[turns[2]["start"] : turns[2]["end"]].unique().tolist() == [7]
    assert engine.calls[1][0] == 7  # the second turn was generated as v7


def test_create_kwargs_reach_a_tool_that_binds_them():
    class Checker(Calculator):
        def bind(self, create_kwargs):
            bound = Checker(None, {"type": "function", "function": {"name": "calculator", "parameters": self.parameters}})
            bound.truth = create_kwargs["ground_truth"]
            return bound

        def __call__(self, args):
            return "right" if super().__call__(args) == self.truth else "wrong"

    extra = {"tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": "42"}}}}
    batch, _ = run_scripted([hermes("calculator", "6*7"), "ok"], tools={"calculator": Checker()}, template="{result}", extra_info=extra)
    assert text_of(batch, ones=0.0) == "right"


# -- the config, the example, the local loop ---------------------------------------------------


def test_example_config_and_tool_config_load(tiny_model):
    cfg = load_config(EXAMPLE, [f"model.path={tiny_model}"])
    mt = cfg.rollout.multi_turn
    assert mt.enabled and mt.format == "words" and mt.tools_config == str(ROOT / "examples/tools/calculator_words.yaml")
    assert mt.tools == [{"class_name": "calculator", "config": {"timeout_s": 5}, "tool_schema": mt.tools[0]["tool_schema"]}]
    # The tools travel in the config (config.json): a worker elsewhere rebuilds them without the file.
    again = load_config(None, base=cfg.model_dump(mode="json") | {"rollout": cfg.rollout.model_dump(mode="json") | {
        "multi_turn": mt.model_dump(mode="json") | {"tools_config": "/nowhere.yaml"}}}, check_files=False)  # fmt: skip
    assert again.rollout.multi_turn.tools == mt.tools
    driver = MultiTurnRollout.from_config(cfg, HFEngine(str(tiny_model)).tokenizer)
    assert sorted(driver.tools) == ["add"] and driver.max_turns == 3
    other = load_config(EXAMPLE, [f"model.path={tiny_model}", f"rollout.multi_turn.tools_config={ROOT}/examples/tools/calculator_and_code.yaml",
                                  "rollout.multi_turn.tools=[]"])  # fmt: skip
    assert [t["tool_schema"]["function"]["name"] for t in other.rollout.multi_turn.tools] == ["calculator", "code_interpreter"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.multi_turn.tools_config=null", "rollout.multi_turn.tools=[]"], "rollout.multi_turn.enabled needs tools"),
        (["rollout.multi_turn.tools_config=/no/such/tools.yaml", "rollout.multi_turn.tools=[]"], "tool config file not found"),
        (["rollout.multi_turn.tools=[{class_name: Gsm8kTool}]"], "tools[0].class_name: unknown tool class 'Gsm8kTool'; known: calculator"),
        (["rollout.multi_turn.observation_template=nothing"], "observation_template must contain {result}"),
        (["rollout.multi_turn.format=xml"], "expected one of: hermes, words"),
        (["rollout.multi_turn.max_turns=0"], "rollout.multi_turn.max_turns"),
    ],
)
def test_bad_multi_turn_config_names_the_field(tiny_model, overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(EXAMPLE, [f"model.path={tiny_model}", *overrides], check_files=False)
    assert message in str(err.value) and "rollout.multi_turn" in str(err.value)


def test_local_loop_trains_on_conversations(tiny_model):
    from ratchet.workers.local_loop import LocalLoop

    cfg = load_config(EXAMPLE, [f"model.path={tiny_model}", "data.eval_files=null", "loop.prompts_per_step=4", "rollout.n=2"])
    loop = LocalLoop(cfg)
    metrics = loop.step(0)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert loop.trainer.version == 1


def test_a_tool_that_does_not_build_is_refused_at_submit(tiny_model, tmp_path):
    (tmp_path / "broken.py").write_text("raise ImportError('needs a package that is not installed')\n")
    tools = tmp_path / "tools.yaml"
    tools.write_text(f"tools:\n  - class_name: {tmp_path}/broken.py:Tool\n  - class_name: calculator\n    config: {{max_digitz: 3}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(EXAMPLE, [f"model.path={tiny_model}", f"rollout.multi_turn.tools_config={tools}"])
    ((field, message),) = [i for i in err.value.issues if i[0].startswith("rollout.multi_turn")]
    assert field == "rollout.multi_turn.tools[0].class_name"
    assert message.startswith(f"cannot import '{tmp_path}/broken.py': ImportError: needs a package that is not installed")
    # A relative file path is made absolute: the workers run in other folders.
    (tmp_path / "ok.py").write_text("from ratchet.tools.calculator import Calculator as Tool\n")
    tools.write_text("tools:\n  - class_name: ok.py:Tool\n")
    here = Path.cwd()
    try:
        import os

        os.chdir(tmp_path)
        cfg = load_config(EXAMPLE, [f"model.path={tiny_model}", f"rollout.multi_turn.tools_config={tools}",
                                    f"data.train_files={EXAMPLE.parent / 'data/tool_add_train.jsonl'}", "data.eval_files=null"])  # fmt: skip
    finally:
        os.chdir(here)
    assert cfg.rollout.multi_turn.tools[0]["class_name"] == f"{tmp_path}/ok.py:Tool"
