"""Config loading: every mistake a user can make is reported with its field path and a way out."""

from __future__ import annotations

import functools
import pickle
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from ratchet.config import ConfigError, RunConfig, config_to_yaml, load_config, validate_config
from ratchet.tasks.generate import write_task_parquet


@dataclass
class Setup:
    root: Path
    model: Path
    train: Path
    yaml: Path

    def write_yaml(self, text: str) -> Path:
        self.yaml.write_text(textwrap.dedent(text))
        return self.yaml


@functools.cache
def _tokenizer():
    from ratchet.models.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    """A model folder with a tokenizer but no weights: validation reads no weights."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 128}')
    _tokenizer().save_pretrained(model)
    train = write_task_parquet(tmp_path / "data" / "train.parquet", "copy", 16, seed=0)
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(
        textwrap.dedent(
            f"""\
            model:
              path: {model}
            data:
              train_files: {train}
            """
        )
    )
    return Setup(root=tmp_path, model=model, train=train, yaml=yaml_path)


def issues_of(excinfo: pytest.ExceptionInfo[ConfigError]) -> dict[str, str]:
    return dict(excinfo.value.issues)


def test_valid_load_applies_overrides_and_coerces_types(setup: Setup) -> None:
    cfg = load_config(setup.yaml, ["trainer.lr=3e-4", "trainer.world_size=2", "rollout.temperature=1", "tracking.tags=[a,b]"])
    assert isinstance(cfg, RunConfig)
    assert cfg.trainer.lr == 3e-4
    assert cfg.trainer.world_size == 2 and isinstance(cfg.trainer.world_size, int)
    assert isinstance(cfg.rollout.temperature, float)
    assert cfg.tracking.tags == ["a", "b"]
    assert cfg.model.path == str(setup.model.resolve())
    assert cfg.algorithm.adv_estimator == "grpo"  # defaults fill the rest


def test_later_override_wins(setup: Setup) -> None:
    assert load_config(setup.yaml, ["seed=1", "seed=2"]).seed == 2


def test_unknown_key_in_yaml(setup: Setup) -> None:
    setup.write_yaml(
        f"""\
        model:
          path: {setup.model}
        data:
          train_files: {setup.train}
        trainer:
          learning_rate: 0.1
        """
    )
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml)
    message = issues_of(excinfo)["trainer.learning_rate"]
    assert "unknown key 'trainer.learning_rate'" in message
    assert "valid keys of trainer: activation_checkpointing, betas, device, grad_clip, lora, lr," in message


def test_unknown_key_override_suggests_close_match(setup: Setup) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, ["trainer.lrr=0.1"])
    message = issues_of(excinfo)["trainer.lrr"]
    assert "unknown key 'trainer.lrr'" in message
    assert "(did you mean 'lr'?)" in message
    assert "trainer.lrr: unknown key" in str(excinfo.value)
    assert str(excinfo.value).startswith("invalid run configuration:\n")


def test_unknown_key_inside_an_optional_section_or_a_list_of_sections(setup: Setup) -> None:
    """Optional sections (`X | None`) and lists of sections list their own keys and suggest
    the close one, like any other section (config/sections.py)."""
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, ["algorithm.off_policy.is_weights={hihg: 2.0}"])
    message = issues_of(excinfo)["algorithm.off_policy.is_weights.hihg"]
    assert "valid keys of algorithm.off_policy.is_weights: batch_normalize, high, kind, level, low (did you mean 'high'?)" in message
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, ["algorithm.off_policy.rejection=[{statistic: k3, level: token, hgh: 1.0}]"])
    message = issues_of(excinfo)["algorithm.off_policy.rejection.0.hgh"]
    assert "valid keys of algorithm.off_policy.rejection.0: high, level, low, statistic (did you mean 'high'?)" in message


def test_schema_rows_and_sweep_keys_reach_into_optional_sections() -> None:
    from ratchet.config.sweep_spec import _config_key_problem
    from ratchet.platform.cli import _fields

    keys = [row[0] for row in _fields(RunConfig)]
    assert {"algorithm.off_policy.is_weights.high", "algorithm.off_policy.rejection[].statistic"} <= set(keys)
    assert _config_key_problem("algorithm.off_policy.is_weights.high") is None
    assert _config_key_problem("algorithm.off_policy.is_weights").startswith("is a section")


def test_unknown_top_level_section_lists_sections(setup: Setup) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, ["trainr.lr=0.1"])
    message = issues_of(excinfo)["trainr"]
    assert "unknown key 'trainr'" in message
    assert "valid keys at the top level: algorithm, checkpoint, critic, data," in message
    assert "(did you mean 'trainer'?)" in message


def test_wrong_type_says_expected_and_given(setup: Setup) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, ["trainer.lr=abc", "trainer.ppo_epochs=1.5", "checkpoint.export_final=maybe"])
    issues = issues_of(excinfo)
    assert issues["trainer.lr"] == "expected a number, got 'abc'"
    assert issues["trainer.ppo_epochs"] == "expected an integer, got 1.5"
    assert issues["checkpoint.export_final"] == "expected true/false, got 'maybe'"
    assert "trainer.lr: expected a number, got 'abc'" in str(excinfo.value)


def test_list_index_in_path(setup: Setup) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, ["tracking.tags=[ok,[1]]"])
    assert "expected a string" in issues_of(excinfo)["tracking.tags.1"]


def test_out_of_range_value(setup: Setup) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, ["trainer.lr=-1"])
    assert issues_of(excinfo)["trainer.lr"] == "must be > 0.0, got -1"


def test_wrong_literal_lists_allowed_values(setup: Setup) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, ["loop.mode=bogus", "model.dtype=float16"])
    issues = issues_of(excinfo)
    assert issues["loop.mode"] == "expected one of: sync, one_step_off, fully_async; got 'bogus'"
    assert issues["model.dtype"] == "expected one of: float32, bfloat16; got 'float16'"


def test_unknown_adv_estimator_lists_registered(setup: Setup) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, ["algorithm.adv_estimator=grp"])
    message = issues_of(excinfo)["algorithm.adv_estimator"]
    assert "'grp'" in message and "grpo" in message
    assert "Value error" not in message


def test_unknown_kl_type_lists_registered(setup: Setup) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, ["algorithm.kl.type=kl9"])
    message = issues_of(excinfo)["algorithm.kl.type"]
    assert "'kl9'" in message and "low_var_kl" in message


def test_run_level_validator_blames_the_field(setup: Setup) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, ["rollout.n=1"])
    message = issues_of(excinfo)["rollout.n"]
    assert "rollout.n must be >= 2" in message and "grpo" in message


def test_missing_required_section(setup: Setup) -> None:
    setup.write_yaml(f"data:\n  train_files: {setup.train}\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml)
    message = issues_of(excinfo)["model"]
    assert message.startswith("required field missing")
    assert "'model' section" in message and "required: path" in message


def test_missing_required_field(setup: Setup) -> None:
    setup.write_yaml(f"model:\n  dtype: float32\ndata:\n  train_files: {setup.train}\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml)
    message = issues_of(excinfo)["model.path"]
    assert message.startswith("required field missing: set model.path")
    assert "Hugging Face" in message


def test_missing_dataset_file(setup: Setup) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, [f"data.eval_files={setup.root / 'nope.parquet'}"])
    message = issues_of(excinfo)["data.eval_files"]
    assert f"file not found: {(setup.root / 'nope.parquet').resolve()}" in message
    assert "ratchet prepare" in message


def test_missing_model_folder(setup: Setup) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, [f"model.path={setup.root / 'no-model'}"])
    message = issues_of(excinfo)["model.path"]
    assert str((setup.root / "no-model").resolve()) in message
    assert "ratchet prepare" in message


def test_model_folder_without_config_json(setup: Setup) -> None:
    empty = setup.root / "empty-model"
    empty.mkdir()
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, [f"model.path={empty}"])
    message = issues_of(excinfo)["model.path"]
    assert "config.json" in message and "ratchet prepare" in message


def test_check_files_false_skips_file_checks(setup: Setup) -> None:
    cfg = load_config(setup.yaml, ["model.path=/nowhere", "reward.function=no_such_module:f"], check_files=False)
    assert cfg.model.path == str(Path("/nowhere").resolve())


def _reward_error(setup: Setup, spec: str) -> str:
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, [f"reward.function={spec}"])
    return issues_of(excinfo)["reward.function"]


def test_reward_file_that_raises_on_import(setup: Setup) -> None:
    bad = setup.root / "bad_reward.py"
    bad.write_text("raise RuntimeError('boom at import')\n")
    message = _reward_error(setup, f"{bad}:compute_score")
    assert "cannot import" in message and "RuntimeError: boom at import" in message


def test_reward_module_that_does_not_exist(setup: Setup) -> None:
    message = _reward_error(setup, "no_such_reward_module:compute_score")
    assert "cannot import 'no_such_reward_module'" in message


def test_reward_function_that_does_not_exist(setup: Setup) -> None:
    message = _reward_error(setup, "ratchet.tasks.rewards:no_such_fn")
    assert "has no function 'no_such_fn'" in message and "compute_score" in message


def test_reward_file_that_does_not_exist(setup: Setup) -> None:
    message = _reward_error(setup, f"{setup.root / 'missing.py'}:compute_score")
    assert f"file not found: {(setup.root / 'missing.py').resolve()}" in message


def test_reward_function_with_wrong_signature(setup: Setup) -> None:
    wrong = setup.root / "wrong_sig.py"
    wrong.write_text("def compute_score(text):\n    return 0.0\n")
    message = _reward_error(setup, f"{wrong}:compute_score")
    assert "lacks parameters data_source, solution_str, ground_truth" in message


def test_world_size_must_divide_batch(setup: Setup) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, ["trainer.world_size=3"])  # 16 prompts x 8 samples = 128
    message = issues_of(excinfo)["trainer.world_size"]
    assert "128 samples" in message and "same number of samples" in message


def test_malformed_override(setup: Setup) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, ["trainer.lr", "seed=1", "=3"])
    messages = [m for p, m in excinfo.value.issues if p == "(overrides)"]
    assert len(messages) == 2
    assert "'trainer.lr'" in messages[0] and "key=value" in messages[0]
    assert "'=3'" in messages[1]


def test_missing_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(tmp_path / "nope.yaml")
    assert issues_of(excinfo)[str(tmp_path.resolve() / "nope.yaml")] == "config file not found"


def test_bad_yaml_syntax_names_the_file(setup: Setup) -> None:
    setup.yaml.write_text("model:\n  path: [unclosed\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml)
    ((path, message),) = excinfo.value.issues
    assert path == str(setup.yaml.resolve())
    assert message.startswith("invalid YAML at line")
    assert str(setup.yaml.resolve()) in str(excinfo.value)


def test_yaml_that_is_not_a_mapping(setup: Setup) -> None:
    setup.yaml.write_text("- model\n- data\n")
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load_config(setup.yaml)


def test_unresolvable_interpolation(setup: Setup) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, ["tracking.name=${nope}"])
    assert "nope" in issues_of(excinfo)["tracking.name"]


def test_several_errors_reported_at_once(setup: Setup) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(setup.yaml, ["trainer.lr=abc", "trainer.lrr=1", "loop.mode=bogus", "algorithm.adv_estimator=grp"])
    assert set(issues_of(excinfo)) == {"trainer.lr", "trainer.lrr", "loop.mode", "algorithm.adv_estimator"}
    text = str(excinfo.value)
    assert len(text.splitlines()) == 5  # header plus one line per issue


def test_several_semantic_errors_reported_at_once(setup: Setup) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(
            setup.yaml,
            ["model.path=/no/model", "data.train_files=/no/train.parquet", "reward.function=nope:f", "trainer.world_size=3"],
        )
    assert set(issues_of(excinfo)) == {"model.path", "data.train_files", "reward.function", "trainer.world_size"}


def test_relative_paths_resolve_against_cwd(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    (setup.root / "my_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    monkeypatch.chdir(setup.root)
    setup.write_yaml(
        """\
        model:
          path: model
        data:
          train_files: data/train.parquet
          eval_files: ./data/train.parquet
        reward:
          function: my_reward.py:compute_score
        storage:
          root: runs
        """
    )
    cfg = load_config("run.yaml")
    root = setup.root.resolve()
    assert cfg.model.path == str(root / "model")
    assert cfg.data.train_files == str(root / "data" / "train.parquet")
    assert cfg.data.eval_files == str(root / "data" / "train.parquet")
    assert cfg.reward.function == f"{root / 'my_reward.py'}:compute_score"
    assert cfg.storage.root == str(root / "runs")


def test_storage_url_and_module_reward_are_left_alone(setup: Setup) -> None:
    cfg = load_config(setup.yaml, ["storage.root=s3://bucket/runs"])
    assert cfg.storage.root == "s3://bucket/runs"
    assert cfg.reward.function == "ratchet.tasks.rewards:compute_score"


def test_validate_config_takes_a_plain_dict(setup: Setup) -> None:
    data = {"model": {"path": str(setup.model)}, "data": {"train_files": str(setup.train)}, "trainer": {"lr": "0.5"}}
    assert validate_config(data).trainer.lr == 0.5
    with pytest.raises(ConfigError) as excinfo:
        validate_config({**data, "trainer": {"lr": "abc"}})
    assert issues_of(excinfo)["trainer.lr"] == "expected a number, got 'abc'"


def test_yaml_round_trip(setup: Setup) -> None:
    cfg = load_config(setup.yaml, ["trainer.lr=3e-4", "tracking.tags=[x]"])
    again = setup.root / "again.yaml"
    again.write_text(config_to_yaml(cfg))
    assert load_config(again) == cfg


def test_config_error_survives_pickling() -> None:
    err = ConfigError([("trainer.lr", "expected a number, got 'abc'")])
    clone = pickle.loads(pickle.dumps(err))
    assert clone.issues == err.issues and str(clone) == str(err)
    assert isinstance(clone, ValueError)


def test_importing_config_does_not_import_torch() -> None:
    """Nor does validating one: the client and CLI check algorithm names and flags, engine
    names, storage schemes and loop modes against torch-free catalogs
    (src/ratchet/catalog/: algorithms.py, engines.py, storage_schemes.py, loop_modes.py),
    and load none of the heavy libraries behind them."""
    example = Path(__file__).resolve().parents[2] / "examples" / "copy_grpo.yaml"
    heavy = ("torch", "numpy", "transformers", "safetensors", "fsspec", "s3fs", "minio", "ray", "temporalio")
    code = textwrap.dedent(
        f"""\
        import sys
        import ratchet.config
        loaded = [name for name in {heavy!r} if name in sys.modules]
        if loaded:
            sys.exit(f"importing ratchet.config imported {{loaded}}")
        from ratchet.config import ConfigError, load_config
        assert not load_config({str(example)!r}, check_files=False).uses_critic
        overrides = ["algorithm.adv_estimator=gae", "algorithm.kl.type=k3+", "algorithm.off_policy.mode=tis",
                     "algorithm.policy_loss=gspo", "algorithm.loss_agg_mode=seq-mean-token-sum-norm"]
        assert load_config({str(example)!r}, overrides, check_files=False).uses_critic
        try:
            load_config({str(example)!r}, ["rollout.n=1"], check_files=False)
        except ConfigError as err:
            assert "rollout.n must be >= 2" in str(err)
        else:
            raise AssertionError("rollout.n=1 with grpo was accepted")
        named = ["rollout.engine=hf", "storage.root=minio://bucket/runs", "loop.mode=fully_async"]
        assert load_config({str(example)!r}, named, check_files=False).rollout.engine == "hf"
        for override, fragment in [("rollout.engine=nope", "registered: hf"), ("storage.root=gs://b", "supported: a local folder")]:
            try:
                load_config({str(example)!r}, [override], check_files=False)
            except ConfigError as err:
                assert fragment in str(err), str(err)
            else:
                raise AssertionError(f"{{override}} was accepted")
        loaded = [name for name in {heavy!r} if name in sys.modules]
        if loaded:
            sys.exit(f"validating a config imported {{loaded}}")
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
