"""Every dataset format and prompt format is checked at submit, with the same messages.

JSON Lines, a `datasets.save_to_disk` folder and parquet all go through the one check
(config/dataset_check.py): a missing column, an empty file, a bad row named by its row
number (and its line, in JSON Lines), an unknown format, a DatasetDict folder; chat
messages with a tokenizer that has no chat template are refused naming the fix, while
plain-string prompts (TRL's standard format) pass on that model. The model is the tiny
demo model (session `assets`); the files are written here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ratchet.config import ConfigError, load_config
from ratchet.platform.client import RECIPE_PATH

from ..unit.test_datasets import rows, write_jsonl, write_parquet, write_saved_dataset


def overrides(assets, train: Path, *extra: str, model: Path | None = None) -> list[str]:
    return [f"model.path={model or assets.model}", f"data.train_files={train}", "data.eval_files=null", "loop.prompts_per_step=4", *extra]


def issues_for(assets, train: Path, *extra: str, model: Path | None = None) -> dict[str, list[str]]:
    with pytest.raises(ConfigError) as excinfo:
        load_config(RECIPE_PATH, overrides(assets, train, *extra, model=model))
    found: dict[str, list[str]] = {}
    for field, message in excinfo.value.issues:
        found.setdefault(field, []).append(message)
    return found


def base_model(assets, tmp_path: Path) -> Path:
    """The tiny model's config and tokenizer without its chat template (and without weights:
    validation reads none)."""
    folder = tmp_path / "base-model"
    folder.mkdir()
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(assets.model) / file, folder)
    return folder


@pytest.mark.parametrize("fmt", ["jsonl", "saved", "parquet"])
@pytest.mark.parametrize("raw", [False, True], ids=["chat", "raw"])
def test_good_files_pass(assets, tmp_path, fmt, raw) -> None:
    records = rows(8, raw=raw)
    path = {
        "jsonl": lambda: write_jsonl(tmp_path / "t.jsonl", records),
        "saved": lambda: write_saved_dataset(tmp_path / "saved", records),
        "parquet": lambda: write_parquet(tmp_path / "t.parquet", records),
    }[fmt]()
    cfg = load_config(RECIPE_PATH, overrides(assets, path))
    assert cfg.data.train_files == str(path)


def test_jsonl_bad_row_named_by_row_and_line(assets, tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [json.dumps(r) for r in rows(8)]
    lines[5] = lines[5][:-3]  # truncated
    lines[6] = json.dumps({**rows(8)[6], "reward_model": {"ground_truth": 42}})
    path.write_text("\n".join(lines) + "\n")
    messages = issues_for(assets, path)["data.train_files"]
    assert any(m.startswith("row 5: line 6 is not valid JSON") for m in messages), messages
    assert "row 6: reward_model.ground_truth must be a string, got an int; store answers as text (e.g. '42', not 42)" in messages


def test_jsonl_row_without_a_key(assets, tmp_path) -> None:
    records = rows(8)
    records[3] = {k: v for k, v in records[3].items() if k != "reward_model"}
    (message,) = issues_for(assets, write_jsonl(tmp_path / "t.jsonl", records))["data.train_files"]
    assert message == "row 3: reward_model must be a mapping {ground_truth: str, style?}, got nothing (null)"


@pytest.mark.parametrize("fmt", ["jsonl", "saved"])
def test_missing_column(assets, tmp_path, fmt) -> None:
    records = [{("question" if k == "prompt" else k): v for k, v in r.items()} for r in rows(8)]
    path = write_jsonl(tmp_path / "t.jsonl", records) if fmt == "jsonl" else write_saved_dataset(tmp_path / "saved", records)
    (message,) = issues_for(assets, path)["data.train_files"]
    assert message.startswith(
        "missing columns 'prompt' (the prompts (data.prompt_key)); its columns: ability, data_source, extra_info, question"
    )
    assert message.endswith("set data.prompt_key to the column that holds the prompts")


@pytest.mark.parametrize("fmt", ["jsonl", "saved", "parquet"])
def test_empty_file(assets, tmp_path, fmt) -> None:
    if fmt == "jsonl":
        path = tmp_path / "t.jsonl"
        path.write_text("\n")
    elif fmt == "saved":
        path = write_saved_dataset(tmp_path / "saved", rows(2)[:0] or [])
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "t.parquet"
        pq.write_table(pa.Table.from_pylist(rows(2)).slice(0, 0), path)
    (message,) = issues_for(assets, path)["data.train_files"]
    assert message == f"{path} has no rows"


def test_unknown_format_and_dataset_dict(assets, tmp_path) -> None:
    csv = tmp_path / "t.csv"
    csv.write_text("prompt\nhello\n")
    (message,) = issues_for(assets, csv)["data.train_files"]
    assert message.startswith(f"unknown dataset format '.csv' of {csv}; give a .parquet file")
    splits = tmp_path / "dd"
    write_saved_dataset(splits / "train", rows(8))
    (splits / "dataset_dict.json").write_text('{"splits": ["train"]}')
    (message,) = issues_for(assets, splits)["data.train_files"]
    assert message == f"{splits} is a DatasetDict (splits: train); point at one split's folder, e.g. {splits / 'train'}"
    # ... and the split's folder passes.
    assert load_config(RECIPE_PATH, overrides(assets, splits / "train")).data.train_files == str(splits / "train")


def test_chat_messages_need_a_chat_template(assets, tmp_path) -> None:
    """TRL's conversational format on a base model: refused at submit, naming the fix."""
    model = base_model(assets, tmp_path)
    (message,) = issues_for(assets, write_jsonl(tmp_path / "t.jsonl", rows(8)), model=model)["model.path"]
    assert message.startswith(f"the tokenizer in {model} has no chat template, which data.train_files needs for its chat-message prompts")
    assert "data.prompt_format=raw or auto" in message and "add a chat_template" in message
    # data.prompt_format=chat names the setting instead.
    records = rows(8, raw=True)
    (message,) = issues_for(assets, write_jsonl(tmp_path / "s.jsonl", records), "data.prompt_format=chat", model=model)["model.path"]
    assert "needs with data.prompt_format=chat;" in message


def test_raw_prompts_on_a_model_without_a_chat_template(assets, tmp_path) -> None:
    """TRL's standard format on a base model: accepted; its length check counts raw tokens."""
    model = base_model(assets, tmp_path)
    records = rows(8, raw=True)
    path = write_jsonl(tmp_path / "t.jsonl", records)
    cfg = load_config(RECIPE_PATH, overrides(assets, path, model=model))
    assert cfg.data.prompt_format == "auto"
    records[2] = {**records[2], "prompt": "copy : " + " ".join("7" * 40) + " ="}
    (message,) = issues_for(assets, write_jsonl(tmp_path / "long.jsonl", records), "data.max_prompt_length=32", model=model)[
        "data.train_files"
    ]
    assert message.startswith(
        "row 2: prompt is longer than data.max_prompt_length=32 tokens as raw text (data.prompt_format) (the longest has 43)"
    )


def test_mixed_prompt_kinds_are_bad_rows(assets, tmp_path) -> None:
    records = rows(8)
    records[4] = {**records[4], "prompt": "copy : 1 2 ="}
    (message,) = issues_for(assets, write_jsonl(tmp_path / "t.jsonl", records))["data.train_files"]
    assert message.startswith(
        "row 4: prompt must be a list of chat messages {role, content} (the dataset's first prompt is one), got a str"
    )


def test_bad_prompt_format_value(assets, tmp_path) -> None:
    issues = issues_for(assets, write_jsonl(tmp_path / "t.jsonl", rows(8)), "data.prompt_format=template")
    assert issues["data.prompt_format"] == ["expected one of: auto, chat, raw; got 'template'"]
