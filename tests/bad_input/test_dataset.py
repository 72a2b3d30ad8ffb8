"""Dataset rows and the tokenizer are checked when the config is validated.

Before: a plain-string prompt tokenized to an empty prompt, a missing `reward_model` gave
ground truth "", an int ground truth or a missing data_source raised inside the reward,
and a missing column, an over-long prompt, no pad token or no chat template failed inside
the rollout actor, retried five times. Now each is a ConfigError naming the file's field,
the rows (counted from 0) and the fix, before anything starts.

The model is the tiny demo model (session `assets`); the bad files are written here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ratchet.config import ConfigError, load_config
from ratchet.platform.client import RECIPE_PATH
from ratchet.tasks.generate import make_rows


def good_rows(count: int = 20) -> list[dict]:
    return make_rows("copy", count, seed=3, min_len=4, max_len=4)


def write(tmp_path: Path, rows: list[dict], name: str = "train.parquet") -> Path:
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def issues_for(assets, train: Path, *extra: str, evals: Path | None = None, model: Path | None = None) -> dict[str, list[str]]:
    overrides = [
        f"model.path={model or assets.model}", f"data.train_files={train}", f"data.eval_files={evals or 'null'}",
        "loop.prompts_per_step=4", *extra,
    ]  # fmt: skip
    with pytest.raises(ConfigError) as excinfo:
        load_config(RECIPE_PATH, overrides)
    found: dict[str, list[str]] = {}
    for field, message in excinfo.value.issues:
        found.setdefault(field, []).append(message)
    return found


def test_good_rows_pass(assets, tmp_path) -> None:
    train = write(tmp_path, good_rows())
    cfg = load_config(
        RECIPE_PATH, [f"model.path={assets.model}", f"data.train_files={train}", "data.eval_files=null", "loop.prompts_per_step=4"]
    )
    assert cfg.data.train_files == str(train)


def test_chat_prompts_with_prompt_format_raw(assets, tmp_path) -> None:
    """Plain strings are fine (TRL's standard format, tests/bad_input/test_dataset_formats.py);
    chat messages under data.prompt_format=raw are not: rendering them needs the template."""
    (message,) = issues_for(assets, write(tmp_path, good_rows()), "data.prompt_format=raw")["data.train_files"]
    assert message.startswith(
        "rows 0, 1, 2, 3, 4 and 15 more (every row): prompt is a list of chat messages {role, content}, which needs the "
        "chat template; set data.prompt_format=chat (or auto)"
    )


def test_missing_reward_model_column(assets, tmp_path) -> None:
    rows = [{k: v for k, v in r.items() if k != "reward_model"} for r in good_rows()]
    (message,) = issues_for(assets, write(tmp_path, rows))["data.train_files"]
    assert "missing columns 'reward_model'" in message and "ground_truth" in message


def test_missing_prompt_column_names_prompt_key(assets, tmp_path) -> None:
    rows = [{("question" if k == "prompt" else k): v for k, v in r.items()} for r in good_rows()]
    (message,) = issues_for(assets, write(tmp_path, rows))["data.train_files"]
    assert "missing columns 'prompt' (the prompts (data.prompt_key))" in message
    assert "question" in message and "set data.prompt_key" in message


def test_int_ground_truth(assets, tmp_path) -> None:
    rows = [{**r, "reward_model": {"style": "rule", "ground_truth": int(r["reward_model"]["ground_truth"])}} for r in good_rows()]
    (message,) = issues_for(assets, write(tmp_path, rows))["data.train_files"]
    assert "(every row): reward_model.ground_truth must be a string, got an int" in message


def test_some_rows_lack_reward_model_and_data_source(assets, tmp_path) -> None:
    rows = good_rows()
    rows[17] = {**rows[17], "reward_model": None}
    rows[3] = {**rows[3], "data_source": None}
    rows[4] = {**rows[4], "data_source": None}
    messages = issues_for(assets, write(tmp_path, rows))["data.train_files"]
    assert "row 17: reward_model must be a mapping {ground_truth: str, style?}, got nothing (null)" in messages
    assert any(m.startswith("rows 3, 4 (2 of 20 rows): data_source must be a non-empty string") for m in messages)


def test_bad_message_in_a_prompt(assets, tmp_path) -> None:
    rows = good_rows()
    rows[9] = {**rows[9], "prompt": [{"role": "user", "content": None}]}
    (message,) = issues_for(assets, write(tmp_path, rows))["data.train_files"]
    assert message.startswith(
        "row 9: prompt must be a list of chat messages {role, content}, but message 0 has nothing (null) as its content"
    )


def test_many_bad_rows_are_summarised(assets, tmp_path) -> None:
    rows = good_rows(200)
    for i in range(10, 200, 2):
        rows[i] = {**rows[i], "data_source": ""}
    (message,) = issues_for(assets, write(tmp_path, rows))["data.train_files"]
    assert message.startswith("rows 10, 12, 14, 16, 18 and 90 more (95 of 200 rows): data_source")


def test_over_long_prompt(assets, tmp_path) -> None:
    rows = good_rows()
    rows[11] = {**rows[11], "prompt": [{"role": "user", "content": "copy : " + " ".join("7" * 40)}]}
    (message,) = issues_for(assets, write(tmp_path, rows), "data.max_prompt_length=32")["data.train_files"]
    # bos + "copy" + ":" + 40 digits + "=": the chat template's tokens count too.
    assert message.startswith("row 11: prompt is longer than data.max_prompt_length=32 tokens with the chat template (the longest has 44)")


def test_eval_file_is_checked_too(assets, tmp_path) -> None:
    train = write(tmp_path, good_rows())
    evals = write(tmp_path, [{**r, "prompt": 12} for r in good_rows(3)], "eval.parquet")
    issues = issues_for(assets, train, evals=evals)
    assert list(issues) == ["data.eval_files"]
    assert issues["data.eval_files"][0].startswith(
        "rows 0, 1, 2 (every row): prompt must be a list of chat messages {role, content}, got an int"
    )


def test_not_a_parquet_file(assets, tmp_path) -> None:
    bad = tmp_path / "train.parquet"
    bad.write_text("prompt,answer\n")
    (message,) = issues_for(assets, bad)["data.train_files"]
    assert message.startswith(f"cannot read {bad} as parquet")


def _model_copy(assets, tmp_path: Path, name: str) -> Path:
    """The tiny model's config and tokenizer without its weights: validation reads no weights."""
    folder = tmp_path / name
    folder.mkdir()
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(assets.model) / file, folder)
    return folder


def test_tokenizer_without_pad_token(assets, tmp_path) -> None:
    model = _model_copy(assets, tmp_path, "nopad")
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["pad_token"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (message,) = issues_for(assets, write(tmp_path, good_rows()), model=model)["model.path"]
    assert "has no pad token" in message and "set pad_token" in message


def test_tokenizer_without_chat_template(assets, tmp_path) -> None:
    """A base model without a template used to pass submit and fail inside the rollout actor."""
    model = _model_copy(assets, tmp_path, "base")
    (model / "chat_template.jinja").unlink()
    (message,) = issues_for(assets, write(tmp_path, good_rows()), model=model)["model.path"]
    assert "has no chat template" in message


def test_model_folder_without_tokenizer(assets, tmp_path) -> None:
    model = tmp_path / "weights-only"
    model.mkdir()
    shutil.copy(Path(assets.model) / "config.json", model)
    (message,) = issues_for(assets, write(tmp_path, good_rows()), model=model)["model.path"]
    assert "has no tokenizer" in message


@pytest.mark.integration
def test_submit_with_bad_rows_starts_nothing(platform, tmp_path) -> None:
    """Through the real platform: Client.submit refuses before a workflow or a run folder exists."""
    from temporalio.service import RPCError, RPCStatusCode

    from ratchet.platform.client import RunHandle

    rows = good_rows()
    rows[17] = {**rows[17], "reward_model": None}  # used to score every sample of this prompt against ""
    train = write(tmp_path, rows)
    run_id = "bad-rows-submit"
    overrides = platform.overrides(f"data.train_files={train}", "loop.prompts_per_step=4", "loop.steps=2")
    with pytest.raises(ConfigError) as excinfo:
        platform.client.submit(RECIPE_PATH, overrides, run_id=run_id)
    assert (
        "data.train_files",
        "row 17: reward_model must be a mapping {ground_truth: str, style?}, got nothing (null)",
    ) in excinfo.value.issues
    with pytest.raises(RPCError) as missing:
        RunHandle(platform.client, run_id).status()
    assert missing.value.status == RPCStatusCode.NOT_FOUND
    assert not (Path(platform.runs_root) / run_id).exists()
