"""Pipeline stages without Temporal or Ray: the `stages:` config and its checks, the example,
the supervised data readers (assistant-only masks, errors naming row and column), and a
supervised chunk resumed from its checkpoint giving exactly the uninterrupted result."""

from __future__ import annotations

from pathlib import Path

import pytest

from ratchet.config import ConfigError, load_config, validate_config
from ratchet.data.conversations import (
    PreferencePair,
    SupervisedDataError,
    encode_conversation,
    encode_pair,
    read_conversations,
    read_preferences,
)
from ratchet.tasks.pipeline_data import write_pipeline_data, write_rows

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "copy_pipeline.yaml"
BASE = {"model": {"path": "/m"}, "data": {"train_files": "/d.parquet"}}


def _issues(stages: list[dict]) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config({**BASE, "stages": stages}, check_files=False)
    return str(err.value)


def test_example_loads_with_its_three_stages():
    cfg = load_config(EXAMPLE, check_files=False)
    assert [s.kind for s in cfg.stages] == ["sft", "dpo", "rl"]
    from ratchet.config.pipeline_plan import rl_stage_config

    rl = rl_stage_config(cfg, 2)
    assert rl.loop.steps == 50 and rl.stages == [] and rl.warmup.steps == 0


def test_rl_overrides_nested_or_dotted():
    from ratchet.config.pipeline_plan import rl_stage_config

    cfg = validate_config({**BASE, "stages": [{"kind": "rl", "overrides": {"loop": {"steps": 3}, "rollout.n": 4}}]}, check_files=False)
    rl = rl_stage_config(cfg, 0)
    assert (rl.loop.steps, rl.rollout.n, rl.loop.prompts_per_step) == (3, 4, cfg.loop.prompts_per_step)


def test_bad_stages_are_refused_naming_the_key():
    sft = {"kind": "sft", "steps": 2, "data": {"train_files": "s.parquet"}}
    assert "stages.0.dpo.loss: unknown preference loss 'nope'; registered: ipo, sigmoid, simpo" in _issues(
        [{"kind": "dpo", "steps": 2, "loss": "nope", "data": {"train_files": "p"}}]
    )
    assert "stages.0.sft.steps: must be >= 1" in _issues([{**sft, "steps": 0}])
    assert "stages.0: kind must be one of: sft, dpo, rl" in _issues([{"kind": "ppo"}])
    assert "stages.1.overrides.loop.steps" in _issues([sft, {"kind": "rl", "overrides": {"loop.steps": 0}}])
    assert "set warmup.steps=0" in _issues([sft, {"kind": "rl", "overrides": {"warmup.steps": 5}}])
    assert "stages.1.overrides.model.path" in _issues([sft, {"kind": "rl", "overrides": {"model.path": "/other"}}])
    assert "export_final" in _issues([{"kind": "rl", "overrides": {"checkpoint.export_final": False}}, sft])


def test_stage_data_is_checked_at_submit(tmp_path, tiny_model):
    from ratchet.platform.pipelines import stage_data_issues

    bad = write_rows(tmp_path / "bad.parquet", [{"messages": [{"role": "user", "content": "copy : 1"}]}])
    cfg = validate_config(
        {
            "model": {"path": str(tiny_model)}, "data": {"train_files": "/d.parquet"},
            "stages": [{"kind": "sft", "steps": 1, "data": {"train_files": str(bad), "eval_files": str(tmp_path / "none.parquet")}}],
        },
        check_files=False,
    )  # fmt: skip
    issues = dict(stage_data_issues(cfg))
    assert "row 0, column 'messages': has no assistant message" in issues["stages.0.data.train_files"]
    assert "file not found" in issues["stages.0.data.eval_files"]


def test_conversation_mask_covers_assistant_turns_only(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    msgs = [
        {"role": "user", "content": "copy : 1 2"},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "copy : 3"},
        {"role": "assistant", "content": "3"},
    ]
    enc = encode_conversation(tok, msgs)
    trained = [t for t, m in zip(enc.input_ids, enc.loss_mask) if m]
    # Each answer's digits and its <eos>; the prompts, '=' and <bos> are not trained (a mask with a hole).
    assert tok.convert_ids_to_tokens(trained) == ["1", "2", "<eos>", "3", "<eos>"]
    assert enc.loss_mask[0] == 0 and 0 in enc.loss_mask[enc.loss_mask.index(1) + 3 :]
    chosen, rejected = encode_pair(
        tok, PreferencePair(msgs[:1], [{"role": "assistant", "content": "12"}], [{"role": "assistant", "content": "21"}])
    )
    assert chosen.input_ids[: len(chosen.input_ids) - 3] == rejected.input_ids[: len(rejected.input_ids) - 3]
    assert sum(chosen.loss_mask) == sum(rejected.loss_mask) == 3


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    # The tiny model's template before it learnt assistant turns: the answer lands before the '='.
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}="
    with pytest.raises(SupervisedDataError, match="extends the rendering"):
        encode_conversation(tok, [{"role": "user", "content": "copy : 1"}, {"role": "assistant", "content": "1"}])


def test_bad_rows_name_file_row_and_column(tmp_path):
    p = write_rows(
        tmp_path / "p.parquet",
        [{"prompt": "copy : 1", "chosen": "1", "rejected": "2"}, {"prompt": "copy : 2", "chosen": "2", "rejected": None}],
    )
    with pytest.raises(SupervisedDataError, match=r"p.parquet: row 1, column 'rejected'"):
        read_preferences(str(p))
    pairs = read_preferences(str(p).replace("p.parquet", "p.parquet"), rejected_key="chosen")
    assert pairs[0].prompt == [{"role": "user", "content": "copy : 1"}] and pairs[0].chosen == [{"role": "assistant", "content": "1"}]
    with pytest.raises(SupervisedDataError, match="no column 'messages'"):
        read_conversations(str(p))
    m = write_rows(tmp_path / "m.parquet", [{"messages": [{"role": "robot", "content": "x"}]}])
    with pytest.raises(SupervisedDataError, match=r"row 0, column 'messages': message 0 has role 'robot'"):
        read_conversations(str(m))


def test_a_resumed_stage_equals_an_uninterrupted_one(tmp_path, tiny_model):
    """Chunks [0, 1) + [1, 2) (the second from the first's checkpoint: model and AdamW state)
    end with the weights of one chunk [0, 2): what a retried or resumed chunk relies on."""
    from safetensors.torch import load_file

    from ratchet.storage.object_store import ObjectStore
    from ratchet.workers.supervised import ChunkRequest, run_chunk

    data = write_pipeline_data(tmp_path / "data", train=32, held_out=8)
    stage = {
        "kind": "dpo", "steps": 2, "batch_size": 4, "lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.999], "grad_clip": 1.0,
        "max_length": 32, "eval_size": 8, "chunk_steps": 1, "loss": "sigmoid", "beta": 0.1, "label_smoothing": 0.0, "simpo_gamma": 0.5,
        "data": {"train_files": str(data["prefs"]), "eval_files": str(data["prefs_eval"]), "prompt_key": "prompt", "chosen_key": "chosen", "rejected_key": "rejected"},
    }  # fmt: skip
    root = ObjectStore(str(tmp_path / "runs"))
    split, whole = root.child("split").url, root.child("whole").url
    first = run_chunk(ChunkRequest(split, stage, 1, str(tiny_model), 0, 1))
    assert first.eval_before["reward_margin"] == 0.0 and first.model_uri == ""
    last = run_chunk(ChunkRequest(split, stage, 1, str(tiny_model), 1, 2))
    once = run_chunk(ChunkRequest(whole, stage, 1, str(tiny_model), 0, 2))
    assert last.model_uri and once.model_uri
    a, b = load_file(f"{last.model_uri}/model.safetensors"), load_file(f"{once.model_uri}/model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert last.eval_after == once.eval_after


def test_follow_pipeline_prints_each_stage_and_its_metric():
    """What `ratchet train` shows for a pipeline (a stand-in for the Temporal handle)."""
    from rich.console import Console

    from ratchet.pipeline_types import PipelineProgress, PipelineSummary, StageResult
    from ratchet.platform.pipelines import follow_pipeline

    sft = StageResult(0, "sft", "p-stage-0-sft", "/r/0", "/r/0/final/model", 40, {"eval/loss": 3.1}, {"eval/loss": 0.14})
    dpo = StageResult(
        1, "dpo", "p-stage-1-dpo", "/r/1", "/r/1/final/model", 20, {"eval/reward_accuracy": 0.0}, {"eval/reward_accuracy": 0.77}
    )

    class Handle:
        def follow(self, every):
            yield PipelineProgress("p", 0, 2, "sft", "p-stage-0-sft")
            yield PipelineProgress("p", 1, 2, "dpo", "p-stage-1-dpo", [sft])

        def result(self):
            return PipelineSummary("p", [sft, dpo], dpo.model_uri)

    console = Console(record=True, width=200)
    assert follow_pipeline(Handle(), console).final_model_uri == "/r/1/final/model"
    text = console.export_text()
    assert "stage 0/1 (sft): run p-stage-0-sft" in text and "stage 1/1 (dpo): run p-stage-1-dpo" in text
    assert "stage 0 (sft) done: eval/loss 3.100 -> 0.140" in text
    assert "eval/reward_accuracy 0.000 -> 0.770" in text  # in the table
