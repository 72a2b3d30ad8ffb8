"""Multi-turn tool rollouts through the real workflow (Temporal + Ray), with the rollout
actor killed while a conversation waits on a tool.

The data's prompts open a calculator call (`add : 3 4 + 5 8`, tasks/tool_tasks.py) that the
tiny model completes, so every conversation calls a tool in its first turn; no scripted
engine. The tool is the calculator behind a gate (a file this test controls): the first
call blocks and writes its process id, which is the rollout actor's; the test SIGKILLs that
process mid-conversation, opens the gate, and the run must go on by itself.

Then batch 0 (the one the kill interrupted) must hold each prompt's n conversations
exactly once, with the tool's answers masked out of the loss, and be the batch an
undisturbed generation makes: the same function the rollout actor runs
(rollout_batching.generate_batch with the multi-turn driver), in this process, from the
run's stored warm-up model and the batch's seed.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from ratchet.config.loader import load_config

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "copy_multi_turn_tools.yaml"
STEPS, PROMPTS, N = 2, 4, 2

GATE_TOOL = '''
import os, time
from pathlib import Path
from ratchet.tools.calculator import Calculator


class GateCalculator(Calculator):
    """The calculator; while `arm` exists and `release` does not, a call writes this
    process's id to `waiting` and waits for `release`."""

    def __init__(self, config=None, tool_schema=None):
        config = dict(config or {})
        self.gate = Path(config.pop("gate_dir"))
        super().__init__(config, tool_schema)

    def __call__(self, args):
        with open(self.gate / "callers", "a") as f:
            f.write(f"{os.getpid()}\\n")
        if (self.gate / "arm").exists() and not (self.gate / "release").exists():
            (self.gate / "waiting.tmp").write_text(str(os.getpid()))
            os.replace(self.gate / "waiting.tmp", self.gate / "waiting")  # whole, or not there
            while not (self.gate / "release").exists():
                time.sleep(0.05)
        return super().__call__(args)
'''


def write_tools(tmp_path: Path) -> Path:
    (tmp_path / "gate_tool.py").write_text(GATE_TOOL)
    gate = tmp_path / "gate"
    gate.mkdir()
    config = tmp_path / "tools.yaml"
    config.write_text(
        textwrap.dedent(f"""
        tools:
          - class_name: {tmp_path}/gate_tool.py:GateCalculator
            config: {{type: native, gate_dir: {gate}, timeout_s: 300}}
            tool_schema:
              type: function
              function:
                name: add
                parameters: {{type: object, properties: {{expression: {{type: string}}}}, required: [expression]}}
    """)
    )
    return config


def reference_batch(cfg, run_dir: Path, batch_index: int):
    """What an undisturbed rollout of batch `batch_index` makes from the warm-up policy."""
    from ratchet.data.order import data_order_seed
    from ratchet.workers.engines.hf import HFEngine
    from ratchet.workers.engines.base import SamplingParams
    from ratchet.workers.multi_turn import MultiTurnRollout
    from ratchet.workers.prompts import PromptSet
    from ratchet.workers.batch_seeds import prompt_indices, sampling_seed
    from ratchet.workers.rollout_batching import generate_batch

    engine = HFEngine(str(run_dir / "warmup" / "model"))
    prompts = PromptSet.from_config(cfg.data, cfg.data.train_files, engine.tokenizer)
    r = cfg.rollout
    params = SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_response_length,
                            seed=sampling_seed(cfg.seed, batch_index, 0))  # fmt: skip
    indices = prompt_indices(batch_index * PROMPTS, PROMPTS, len(prompts), data_order_seed(cfg))
    driver = MultiTurnRollout.from_config(cfg, engine.tokenizer)
    return generate_batch(engine, prompts, indices, params, policy_version=0, multi_turn=driver)


def test_killed_rollout_mid_conversation_loses_and_repeats_nothing(platform, tmp_path):
    from ratchet.storage.batch_store import BatchStore
    from ratchet.storage.object_store import ObjectStore
    from ratchet.tasks.tool_tasks import write_tool_add_jsonl
    from ratchet.workers.batch import RolloutBatch, load_scores

    tools = write_tools(tmp_path)
    gate = tmp_path / "gate"
    (gate / "arm").touch()  # the first tool call of the run blocks
    train = write_tool_add_jsonl(tmp_path / "train.jsonl", 16, seed=0)
    cfg = load_config(EXAMPLE, [
        f"model.path={platform.assets.model}", f"data.train_files={train}", "data.eval_files=null",
        f"storage.root={platform.runs_root}", f"rollout.multi_turn.tools_config={tools}", "warmup.steps=2",
        f"loop.steps={STEPS}", f"loop.prompts_per_step={PROMPTS}", f"rollout.n={N}", "loop.heartbeat_timeout_s=5",
        "tracking.name=multi-turn-kill",
    ])  # fmt: skip
    handle = platform.client.submit(cfg)
    deadline = time.monotonic() + float(os.environ.get("RATCHET_TEST_GATE_WAIT_S", "300"))
    while not (gate / "waiting").exists():
        if time.monotonic() > deadline:
            handle.result(timeout=1)  # the run's own error, if it failed
            raise AssertionError("no tool call blocked at the gate")
        time.sleep(0.1)
    pid = int((gate / "waiting").read_text())
    assert "RolloutWorker" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    os.kill(pid, signal.SIGKILL)  # the rollout actor, with a conversation waiting on its tool
    (gate / "release").touch()

    summary = handle.result(timeout=600)
    assert summary.steps == STEPS and summary.policy_version == STEPS
    run_dir = Path(summary.run_uri)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(STEPS))
    assert all(v == v for r in lines for v in r.values()), "NaN in metrics"

    store = BatchStore(ObjectStore(summary.run_uri))
    batch = RolloutBatch.load(store, 0)
    # Each prompt's n conversations, once.
    assert len(batch) == PROMPTS * N and set(Counter(batch.prompt_index.tolist()).values()) == {N}
    # Tool answers are in the sequence, masked out of the loss; every conversation called the tool.
    for row, sample in enumerate(batch.samples):
        assert sample["extra_info"]["tool_calls"], sample
        for span in sample["turns"]:
            want = 1.0 if span["role"] == "assistant" else 0.0
            assert batch.response_mask[row, span["start"] : span["end"]].eq(want).all()
        assert sample["turns"][-1]["role"] == "assistant"
    assert any(s["role"] == "tool" for sample in batch.samples for s in sample["turns"])
    # The conversations an undisturbed rollout makes, token for token.
    ref = reference_batch(cfg, run_dir, 0)
    assert torch.equal(batch.response_ids, ref.response_ids) and torch.equal(batch.response_mask, ref.response_mask)
    assert torch.equal(batch.prompt_index, ref.prompt_index) and batch.samples == ref.samples
    assert torch.allclose(batch.rollout_logprobs, ref.rollout_logprobs, atol=1e-5)
    rewards, extras = load_scores(store, 0)
    assert len(rewards) == PROMPTS * N and all(e["tool_calls"] >= 1 for e in extras)
    # The killed actor's calls, then a new actor's: the conversations were made again, not patched.
    callers = set((gate / "callers").read_text().split())
    assert str(pid) in callers and len(callers) >= 2
