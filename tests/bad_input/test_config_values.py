"""Bad config values are refused at submit, each with an issue naming the field.

Before: nan/inf passed (a nan lr poisons every weight; `loop.heartbeat_timeout_s=.inf`
made `timedelta` raise inside workflow code, which retried forever), `loop.steps=true`
ran one step, betas of 1 or more, seeds that overflow the per-step seed and unknown
storage schemes were accepted, and a batch larger than the dataset or prompts plus
responses longer than the model's context failed only inside the workers.
"""

from __future__ import annotations

import pytest

from ratchet.config import ConfigError, load_config
from ratchet.config.schema import MAX_SAMPLING_ROUNDS, MAX_SEED, MAX_STEPS
from ratchet.platform.client import RECIPE_PATH

BASE = {"model": {"path": "/nowhere"}, "data": {"train_files": "/nowhere.parquet"}}


def issues_for(overrides: list[str], *, check_files: bool = False, base: dict | None = None, path=None) -> dict[str, str]:
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, overrides, base=None if path else (base or BASE), check_files=check_files)
    return dict(excinfo.value.issues)


@pytest.mark.parametrize(
    ("override", "field", "fragment"),
    [
        ("trainer.lr=nan", "trainer.lr", "must be a finite number, got 'nan'"),
        ("trainer.lr=.nan", "trainer.lr", "must be a finite number"),
        ("rollout.temperature=inf", "rollout.temperature", "must be a finite number"),
        ("algorithm.kl.target=-.inf", "algorithm.kl.target", "must be a finite number"),
        ("reward.function_weight=.nan", "reward.function_weight", "must be a finite number"),
        ("loop.heartbeat_timeout_s=.inf", "loop.heartbeat_timeout_s", "must be a finite number, got inf"),
        ("loop.heartbeat_timeout_s=86400", "loop.heartbeat_timeout_s", "must be <= 600"),
        ("reward.timeout_s=.inf", "reward.timeout_s", "must be a finite number"),
        ("reward.timeout_s=0", "reward.timeout_s", "must be > 0"),
        ("reward.timeout_s=100000", "reward.timeout_s", "must be <= 1800"),
        ("trainer.betas=[0.9,1.0]", "trainer.betas.1", "must be < 1"),
        ("trainer.betas=[-0.1,0.99]", "trainer.betas.0", "must be >= 0"),
        ("trainer.betas=[0.9,.nan]", "trainer.betas.1", "must be a finite number"),
        ("loop.steps=true", "loop.steps", "expected an integer, got true"),
        ("rollout.n=false", "rollout.n", "expected an integer, got false"),
        ("trainer.lr=true", "trainer.lr", "expected a number, got true"),
        ("trainer.betas=[true,0.9]", "trainer.betas", "expected a number"),
        ("seed=-1", "seed", "must be >= 0"),
        (f"seed={MAX_SEED + 1}", "seed", f"must be <= {MAX_SEED}"),
        (f"loop.steps={MAX_STEPS + 1}", "loop.steps", f"must be <= {MAX_STEPS}"),
        (f"algorithm.max_sampling_rounds={MAX_SAMPLING_ROUNDS + 1}", "algorithm.max_sampling_rounds", "must be <="),
        ("storage.root=gs://bucket/runs", "storage.root", "unknown storage scheme 'gs://'"),
        ("storage.root=http://host/runs", "storage.root", "supported: a local folder, file://, s3://"),
        ("storage.root=s3:/bucket/runs", "storage.root", "is not a URL ratchet supports"),
        ("storage.root=simplecache::s3://bucket", "storage.root", "is not a URL ratchet supports"),
        ("storage.root=s3://", "storage.root", "names no bucket"),
        ("storage.root=minio:///", "storage.root", "names no bucket"),
        # The run id is '<name>-<timestamp>-<random>': a name must not make it escape a folder.
        ("tracking.name=.x", "tracking.name", "must match the pattern"),
        ("tracking.name=..", "tracking.name", "must match the pattern"),
        (f"tracking.name={'a' * 101}", "tracking.name", "must match the pattern"),
    ],
)
def test_bad_value_is_refused_naming_the_field(override: str, field: str, fragment: str) -> None:
    issues = issues_for([override])
    assert field in issues, issues
    assert fragment in issues[field]


def test_worst_case_seed_fits_the_per_step_seed() -> None:
    """The bounds keep the rollout's per-step seed (workers/rollout.py) under torch's int64 limit."""
    worst = (MAX_SEED * 1_000_003 + MAX_STEPS) * 101 + (MAX_SAMPLING_ROUNDS - 1)
    assert worst < 2**63
    assert MAX_SAMPLING_ROUNDS <= 101  # parts stay distinct under the `* 101 + part` of the formula


@pytest.mark.parametrize(
    "override",
    ["trainer.lr=1", "seed=4294967295", "storage.root=s3://bucket/runs", "storage.root=minio://bucket", "storage.root=memory://runs",
     "storage.root=file:///tmp/runs", "storage.root=relative/runs", "loop.heartbeat_timeout_s=600", "trainer.betas=[0,0.999]"],
)  # fmt: skip
def test_good_values_still_pass(override: str) -> None:
    cfg = load_config(None, [override], base=BASE, check_files=False)
    assert cfg.trainer.lr > 0 and isinstance(cfg.trainer.lr, float)


def test_demo_recipe_still_validates(assets) -> None:
    train, evals = assets.data["copy"]
    cfg = load_config(RECIPE_PATH, [f"model.path={assets.model}", f"data.train_files={train}", f"data.eval_files={evals}"])
    assert cfg.loop.prompts_per_step == 16 and cfg.reward.timeout_s == 300


def _demo(assets, *extra: str) -> list[str]:
    train, _ = assets.data["copy"]
    return [f"model.path={assets.model}", f"data.train_files={train}", "data.eval_files=null", *extra]


def test_prompts_per_step_larger_than_the_dataset(assets, tmp_path) -> None:
    import pyarrow.parquet as pq

    train, _ = assets.data["copy"]
    small = tmp_path / "small.parquet"
    pq.write_table(pq.read_table(train).slice(0, 10), small)
    issues = issues_for(_demo(assets, f"data.train_files={small}"), check_files=True, path=RECIPE_PATH)
    assert "only 10 rows" in issues["loop.prompts_per_step"]
    assert "at most 10" in issues["loop.prompts_per_step"]


def test_prompt_plus_response_longer_than_the_context(assets) -> None:
    """The tiny model's config.json says max_position_embeddings=128."""
    issues = issues_for(_demo(assets, "data.max_prompt_length=100", "rollout.max_response_length=29"), check_files=True, path=RECIPE_PATH)
    message = issues["rollout.max_response_length"]
    assert "= 129 tokens exceed the context of model.path (128 tokens" in message
