"""Bring your own data (no Ray, no Temporal): the dataset formats, the prompt formats, the
shuffled prompt order, reward functions on token ids and the timestamps of metrics.jsonl.

A `datasets.save_to_disk` folder is written here the way `datasets` writes one (Arrow
stream files named in state.json, dataset_info.json beside them); the `datasets` package
itself is not installed, which is why ratchet reads such a folder with pyarrow.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ratchet.config.schema import RunConfig
from ratchet.data.files import DatasetFileError, dataset_format, read_dataset
from ratchet.data.order import data_order_seed, epoch_order
from ratchet.data.prompt_format import encode_prompts, resolve_prompt_format
from ratchet.models.tiny import VOCAB
from ratchet.storage.metrics_log import MetricsLog
from ratchet.storage.object_store import ObjectStore
from ratchet.tasks.generate import make_rows
from ratchet.tasks.loading import RewardFunction, RewardLoadError, load_reward_fn
from ratchet.workers.batch import RolloutBatch
from ratchet.workers.prompts import PromptSet
from ratchet.workers.batch_seeds import prompt_indices
from ratchet.workers.scoring import score_batch

torch.set_num_threads(1)
BOS, EOS, PAD = VOCAB.index("<bos>"), VOCAB.index("<eos>"), VOCAB.index("<pad>")


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def rows(count: int = 12, *, raw: bool = False) -> list[dict]:
    out = make_rows("copy", count, seed=5, min_len=2, max_len=5)
    if raw:  # TRL's standard format: the prompt is the text itself
        out = [{**r, "prompt": r["prompt"][0]["content"] + " ="} for r in out]
    return out


def write_parquet(path: Path, records: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_saved_dataset(folder: Path, records: list[dict], shards: int = 1, indices: list[int] | None = None) -> Path:
    """What `Dataset.from_list(records).save_to_disk(folder, num_shards=shards)` writes."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(records)
    step = -(-len(records) // shards) if records else 0
    names = []
    for k in range(shards):
        name = f"data-{k:05d}-of-{shards:05d}.arrow"
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(k * step, step))
        names.append({"filename": name})
    state = {"_data_files": names, "_fingerprint": "0", "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
             "_output_all_columns": False, "_split": None}  # fmt: skip
    if indices is not None:  # older `datasets`: a selection kept as an indices file
        with pa.OSFile(str(folder / "indices.arrow"), "wb") as sink:
            index_table = pa.table({"indices": pa.array(indices, pa.uint64())})
            with pa.ipc.new_stream(sink, index_table.schema) as writer:
                writer.write_table(index_table)
        state["_indices_data_files"] = [{"filename": "indices.arrow"}]
    (folder / "state.json").write_text(json.dumps(state))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}, "splits": {}}))
    return folder


# --------------------------------------------------------------------------- dataset formats


def test_every_format_reads_the_same_rows(tmp_path, tokenizer):
    records = rows(12)
    paths = {
        "parquet": write_parquet(tmp_path / "d.parquet", records),
        "jsonl": write_jsonl(tmp_path / "d.jsonl", records),
        "json array": (tmp_path / "d.json"),
        "saved_dataset": write_saved_dataset(tmp_path / "saved", records),
        "saved_dataset, 3 shards": write_saved_dataset(tmp_path / "sharded", records, shards=3),
    }
    paths["json array"].write_text(json.dumps(records))
    expected = PromptSet(str(paths["parquet"]), tokenizer)
    for name, path in paths.items():
        table = read_dataset(path)
        assert table.num_rows == 12 and table.unreadable == {}, name
        assert table.rows() == records, name
        prompts = PromptSet(str(path), tokenizer)
        assert prompts.token_ids == expected.token_ids, name
        assert [prompts.sample_info(i) for i in range(12)] == [expected.sample_info(i) for i in range(12)], name
    assert [dataset_format(p).name for p in paths.values()] == ["parquet", "jsonl", "jsonl", "saved_dataset", "saved_dataset"]


def test_read_only_the_columns_asked_for(tmp_path):
    for path in (write_parquet(tmp_path / "d.parquet", rows(3)), write_jsonl(tmp_path / "d.jsonl", rows(3))):
        table = read_dataset(path, ["prompt", "data_source", "nonexistent"])
        assert list(table.columns) == ["prompt", "data_source"]
        assert set(table.column_names) == {"prompt", "data_source", "ability", "reward_model", "extra_info"}


def test_saved_dataset_with_an_indices_file(tmp_path):
    records = rows(6)
    table = read_dataset(write_saved_dataset(tmp_path / "sel", records, indices=[4, 1, 1]))
    assert table.rows() == [records[4], records[1], records[1]]


def test_jsonl_bad_lines_are_rows_named_by_number(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    good = [json.dumps(r) for r in rows(4)]
    path.write_text("\n".join([good[0], "", good[1], "{not json", "[1, 2]", good[2]]) + "\n")
    table = read_dataset(path)
    assert table.num_rows == 5  # the blank line is no row
    assert table.unreadable == {2: table.unreadable[2], 3: "line 5 is not a JSON object but a list"}
    assert table.unreadable[2].startswith("line 4 is not valid JSON")
    with pytest.raises(ValueError, match=r"row 2: line 4 is not valid JSON"):
        PromptSet(str(path), tokenizer)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: (p / "d.csv").write_text("prompt\n") and p / "d.csv", "unknown dataset format '.csv'"),
        (lambda p: p, "folder without state.json"),
        (
            lambda p: (p / "dataset_dict.json").write_text('{"splits": ["train", "test"]}') and p,
            "a DatasetDict (splits: train, test); point at one split's folder",
        ),
        (lambda p: write_parquet(p / "a.parquet", rows(2)) and p, "a folder of parquet files; point at one file"),
        (lambda p: p / "missing.parquet", "not found"),
    ],
    ids=["csv", "plain-folder", "dataset-dict", "parquet-folder", "missing"],
)
def test_unknown_formats_are_named(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(DatasetFileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_dataset(path)


def test_unreadable_arrow_file(tmp_path):
    folder = write_saved_dataset(tmp_path / "saved", rows(3))
    (folder / "data-00000-of-00001.arrow").write_bytes(b"not arrow")
    with pytest.raises(DatasetFileError, match="cannot read the Arrow files of"):
        read_dataset(folder)


# --------------------------------------------------------------------------- prompt formats


def test_raw_prompts_are_the_text_itself(tmp_path, tokenizer):
    """TRL's standard format: strings are tokenized as they are, no chat template (auto)."""
    records = rows(5, raw=True)
    prompts = PromptSet(str(write_jsonl(tmp_path / "raw.jsonl", records)), tokenizer)
    assert prompts.prompt_format == "raw"
    assert prompts.token_ids == [tokenizer(r["prompt"])["input_ids"] for r in records]
    assert all(ids[0] != BOS for ids in prompts.token_ids)  # the tiny tokenizer adds no BOS; its template does


def test_chat_format_makes_a_string_one_user_message(tmp_path, tokenizer):
    chat = rows(5)
    strings = [{**r, "prompt": r["prompt"][0]["content"]} for r in chat]
    as_chat = PromptSet(str(write_jsonl(tmp_path / "s.jsonl", strings)), tokenizer, prompt_format="chat")
    reference = PromptSet(str(write_jsonl(tmp_path / "c.jsonl", chat)), tokenizer)
    assert as_chat.prompt_format == reference.prompt_format == "chat"
    assert as_chat.token_ids == reference.token_ids
    assert as_chat.token_ids[0][0] == BOS and as_chat.token_ids[0][-1] == VOCAB.index("=")


def test_prompt_format_resolution():
    messages = [{"role": "user", "content": "x"}]
    assert resolve_prompt_format("auto", [None, "text", messages]) == "raw"
    assert resolve_prompt_format("auto", [7, messages, "text"]) == "chat"
    assert resolve_prompt_format("raw", [messages]) == "raw" and resolve_prompt_format("chat", ["x"]) == "chat"


def test_raw_format_refuses_messages(tmp_path, tokenizer):
    path = str(write_jsonl(tmp_path / "c.jsonl", rows(3)))
    with pytest.raises(ValueError, match=r"row 0: prompt is a list of chat messages .* needs the chat template"):
        PromptSet(path, tokenizer, prompt_format="raw")


def test_encode_matches_between_check_and_rollout(tokenizer):
    """The submit-time check and PromptSet encode with one function; raw and chat differ by the template."""
    raw, chat = encode_prompts(tokenizer, ["copy : 1 2 ="], "raw"), encode_prompts(tokenizer, ["copy : 1 2"], "chat")
    assert chat == [[BOS, *raw[0]]]


# --------------------------------------------------------------------------- prompt order


def test_each_epoch_is_a_fresh_permutation():
    total, seed = 10, 3
    drawn = prompt_indices(0, 3 * total, total, seed)
    epochs = [drawn[k * total : (k + 1) * total] for k in range(3)]
    assert all(sorted(e) == list(range(total)) for e in epochs)  # every row once per epoch
    assert len({tuple(e) for e in epochs}) == 3 and epochs[0] != list(range(total))
    assert prompt_indices(0, 3 * total, total, seed + 1) != drawn  # another data seed, another order


def test_order_is_a_function_of_the_position_only():
    """A resume from any frontier, a retried batch and the local loop all see the same rows."""
    whole = prompt_indices(0, 47, 13, 9)
    pieces = [i for start in range(0, 47, 5) for i in prompt_indices(start, min(5, 47 - start), 13, 9)]
    assert pieces == whole
    epoch_order.cache_clear()  # a fresh process derives the same order
    assert prompt_indices(0, 47, 13, 9) == whole


def test_order_is_pinned():
    """The permutation must not change between versions of ratchet or Python: a run resumed
    after an upgrade continues the same order. These numbers were computed once."""
    assert list(epoch_order(0, 0, 10)) == PINNED_EPOCH_0
    assert list(epoch_order(0, 1, 10)) == PINNED_EPOCH_1


PINNED_EPOCH_0 = [4, 7, 3, 8, 6, 1, 9, 5, 2, 0]
PINNED_EPOCH_1 = [2, 7, 5, 9, 0, 3, 8, 4, 6, 1]


def test_file_order_without_shuffle():
    assert prompt_indices(62, 4, 64) == [62, 63, 0, 1]
    assert prompt_indices(8, 4, 10, None) == [8, 9, 0, 1]


def _cfg(**data) -> RunConfig:
    return RunConfig.model_validate({"seed": 11, "model": {"path": "m"}, "data": {"train_files": "t.parquet", **data}})


def test_data_order_seed_from_config():
    assert _cfg().data.shuffle is True and data_order_seed(_cfg()) == 11  # data.seed defaults to the run's seed
    assert data_order_seed(_cfg(seed=5)) == 5
    assert data_order_seed(_cfg(shuffle=False, seed=5)) is None


def test_workflow_and_local_loop_draw_the_same_shuffled_prompts(tiny_model, tmp_path, tokenizer):
    """The rollout worker's batch 3 (prompt start 6) and the local loop's step 3 get the rows
    `prompt_indices(6, 2, rows, seed)`, not rows 6 and 7 of the file."""
    from ratchet.workers.engines import ENGINES
    from ratchet.workers.engines.hf import HFEngine
    from ratchet.workers.local_loop import LocalLoop
    from ratchet.workers.rollout import RolloutWorker

    seen: list[list[list[int]]] = []

    class Recording(HFEngine):
        def generate(self, prompts, params, **kwargs):
            seen.append([list(p) for p in prompts])
            return super().generate(prompts, params, **kwargs)

    ENGINES.register("recording-prompts", Recording)
    try:
        data = write_parquet(tmp_path / "train.parquet", rows(16))
        cfg = RunConfig.model_validate(
            {
                "seed": 7,
                "model": {"path": str(tiny_model)},
                "data": {"train_files": str(data)},
                "rollout": {"n": 2, "max_response_length": 3, "engine": "recording-prompts"},
                "loop": {"prompts_per_step": 2},
                "trainer": {"micro_batch_size": 4},
                "storage": {"root": str(tmp_path)},
            }
        )
        RolloutWorker(cfg, str(tiny_model), str(tmp_path / "run")).generate(3, prompt_start=6, prompt_count=2, policy_version=0)
        LocalLoop(cfg).step(3)
    finally:
        del ENGINES.entries["recording-prompts"]
    file_prompts = PromptSet(str(data), tokenizer)
    expected = [file_prompts.token_ids[i] for i in prompt_indices(6, 2, 16, 7)]
    assert seen == [expected, expected]
    assert expected != [file_prompts.token_ids[6], file_prompts.token_ids[7]]


# --------------------------------------------------------------------------- rewards on token ids


def token_batch() -> RolloutBatch:
    """Two samples: response [5, 6, EOS] and [7] (one token masked off), prompts of 2 and 3 tokens."""
    prompt_ids = torch.tensor([[PAD, BOS, 14], [BOS, 14, 20]])
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=(prompt_ids != PAD).long(),
        response_ids=torch.tensor([[5, 6, EOS], [7, 8, PAD]]),
        response_mask=torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]),
        rollout_logprobs=torch.zeros(2, 3),
        policy_version=torch.zeros(2, 3, dtype=torch.long),
        prompt_index=torch.tensor([0, 1]),
        samples=[{"data_source": "tok", "ground_truth": "", "extra_info": {}}] * 2,
    )


def test_reward_on_token_ids(tokenizer):
    """A reward no text can express: 1 for ending on the EOS token (decoding skips it), minus
    0.1 per prompt token."""
    seen = []

    def ends_on_eos(data_source, solution_str, ground_truth, extra_info=None, response_ids=None, prompt_ids=None):
        seen.append((solution_str, response_ids, prompt_ids))
        return float(response_ids[-1:] == [EOS]) - 0.1 * len(prompt_ids)

    fn = RewardFunction.wrap(ends_on_eos)
    assert fn.token_params == ("response_ids", "prompt_ids")
    rewards, _ = score_batch(token_batch(), tokenizer, fn)
    torch.testing.assert_close(rewards, torch.tensor([1.0 - 0.2, 0.0 - 0.3]))
    assert [s[1:] for s in seen] == [([5, 6, EOS], [BOS, 14]), ([7], [BOS, 14, 20])]
    assert seen[0][0] == tokenizer.decode([5, 6], skip_special_tokens=True)  # the text has no EOS


def test_verl_and_trl_signatures(tokenizer):
    calls = {}

    def verl(data_source, solution_str, ground_truth, extra_info=None):
        calls["verl"] = (data_source, solution_str)
        return 0.5

    def trl_style(data_source, solution_str, ground_truth, **kwargs):
        calls.setdefault("trl", []).append(sorted(kwargs))
        return len(kwargs["completion_ids"])

    assert RewardFunction.wrap(verl).token_params == ()
    assert score_batch(token_batch(), tokenizer, verl)[0].tolist() == [0.5, 0.5]
    assert score_batch(token_batch(), tokenizer, trl_style)[0].tolist() == [3.0, 1.0]
    assert calls["trl"][0] == ["completion_ids", "extra_info", "prompt_ids", "response_ids"]


def test_load_reward_fn_detects_token_params_once(tmp_path):
    source = tmp_path / "tok_reward.py"
    source.write_text(
        "def by_tokens(data_source, solution_str, ground_truth, extra_info=None, *, completion_ids):\n"
        "    return float(len(completion_ids))\n"
        "def needs_more(data_source, solution_str, ground_truth, tokenizer):\n"
        "    return 0.0\n"
    )
    fn = load_reward_fn(f"{source}:by_tokens")
    assert isinstance(fn, RewardFunction) and fn.token_params == ("completion_ids",)
    assert load_reward_fn("ratchet.tasks.rewards:compute_score").token_params == ()
    with pytest.raises(RewardLoadError, match="requires parameters ratchet does not pass: tokenizer"):
        load_reward_fn(f"{source}:needs_more")


# --------------------------------------------------------------------------- metrics.jsonl timestamps


def test_metrics_lines_carry_wall_clock_time(tmp_path):
    before = time.time()
    log = MetricsLog(ObjectStore(str(tmp_path)))
    log.write(0, {"reward_mean": 0.5})
    after = time.time()
    (line,) = log.read()
    assert before - 0.001 <= line["time_unix"] <= after + 0.001
    assert datetime.fromisoformat(line["time_utc"]).timestamp() == pytest.approx(line["time_unix"], abs=1e-6)
    assert line["time_utc"].endswith("+00:00")


def test_timestamp_fields_agree_to_the_millisecond(tmp_path):
    log = MetricsLog(ObjectStore(str(tmp_path)), clock=lambda: 1796156430.3375)
    log.write(4, {"x": 1.0})
    assert log.read() == [{"step": 4, "x": 1.0, "time_unix": 1796156430.338, "time_utc": "2026-12-01T20:20:30.338+00:00"}]
    log.write(5, {"x": 2.0, "time_unix": 1.0})  # a record's own value wins
    assert log.read()[1]["time_unix"] == 1.0
