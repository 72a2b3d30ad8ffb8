"""The run configuration: typed, documented, strict.

Every section forbids unknown keys, so a typo fails at submit time instead of being
silently ignored for a whole run. Each field's description is its documentation;
`ratchet schema` prints them all.

One module, past 500 lines, on purpose: it is the config's single reference, one section
class per YAML section, read top to bottom as the documentation of every key.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic import Discriminator, Tag

# The catalogs (names and estimator flags, engines, storage schemes, loop modes) import no
# torch, so validating a config does not either (tests/unit/test_config.py checks it).
from ratchet.catalog.algorithms import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, OFF_POLICY, POLICY_LOSSES
from ratchet.algorithms.off_policy_settings import as_is_weights, as_rejection, criterion_problems, is_weights_problems, mode_problems
from ratchet.algorithms.off_policy_settings import rejection_problems
from ratchet.config.pool_roles import POOL_ROLES
from ratchet.catalog import storage_schemes as schemes
from ratchet.storage.layout import RunLayout
from ratchet.catalog.engines import ENGINE_OPTIONS, ENGINES
from ratchet.catalog.loop_modes import LOOP_MODES

# The per-batch sampling seed is `(seed * 1_000_003 + batch) * 101 + part`
# (workers/batch_seeds.sampling_seed; `part` < algorithm.max_sampling_rounds). With
# these bounds it stays below 4.4e17, far under the 2**63 that torch.manual_seed and int64
# tensors accept, and distinct per (batch, part).
MAX_SEED = 2**32 - 1  # numpy's seed range too (workers/runtime.enable_determinism)
MAX_STEPS = 10**9
MAX_SAMPLING_ROUNDS = 100  # < 101, the multiplier that keeps per-part seeds distinct

# Upper bounds of the other numbers: none is ever needed by a real run, and each keeps a
# typo (`trainer.ppo_epochs=10**9`, `trainer.lr=1e300`) from passing the checks at submit
# and for live changes (config/live_keys.py validates through these same fields) to hang
# a run in one update or turn its weights to inf. Each field's description says why.
MAX_TOKENS = 2**21  # twice the longest context open models serve (about 1M tokens)
MAX_SEQUENCES = 2**20  # prompts, samples or sequences in one batch: more than any cluster holds in one step
MAX_LR = 1.0  # an Adam step of lr per parameter: above 1 the first step destroys any model
MAX_EPOCHS = 100  # passes over one batch (PPO uses 1-4); more only overfits it
MAX_WEIGHT = 1e6  # loss weights, reward weights, budgets, caps and thresholds: far above any useful one
MAX_CPUS = 65536.0  # Ray CPUs of one actor or node: more than any machine has
MAX_GPUS = 64  # GPUs of one engine (tensor parallel) or one node
MAX_RANKS = 4096  # trainer ranks: more GPUs than one model has been trained on
MAX_BUCKET_MB = 65536.0  # megabytes in one weight-sync bucket: more than any GPU's memory

UnitInterval = Annotated[float, Field(ge=0, lt=1)]


class Section(BaseModel):
    # allow_inf_nan=False: a nan learning rate or an infinite timeout is refused at submit
    # instead of poisoning the weights or making `timedelta` raise inside workflow code.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic turns `true` into 1 for a number field (`loop.steps=true` ran one step)."""
        field = cls.model_fields.get(info.field_name or "")
        if field is None or not _numeric(field.annotation):
            return value
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(item, bool) for item in items):
            kind = "an integer" if _numeric(field.annotation) is int else "a number"
            raise ValueError(f"expected {kind}, got {_bool_text(value)}; write the number itself, e.g. 1, not true")
        return value


def _numeric(annotation: Any) -> type | None:
    """int or float when the annotation holds numbers (also inside Optional, tuples, Annotated)."""
    if annotation in (int, float):
        return annotation
    if typing.get_origin(annotation) is Annotated:
        return _numeric(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (tuple, typing.Union, types.UnionType):
        found = [_numeric(arg) for arg in typing.get_args(annotation) if arg is not type(None)]
        return next((kind for kind in found if kind is not None), None)
    return None


def _bool_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_bool_text(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else repr(value)


class ModelConfig(Section):
    path: str = Field(description="Folder of a Hugging Face causal LM (config, weights, tokenizer).")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype of the policy.")


class DataConfig(Section):
    train_files: str = Field(
        description="Training prompts in verl's layout (prompt, data_source, reward_model.ground_truth, extra_info): a "
        ".parquet file, a .jsonl/.json file, or a folder saved with datasets' save_to_disk (docs/data.md)."
    )
    eval_files: str | None = Field(None, description="Held-out prompts for greedy evaluation, in any format of train_files.")
    prompt_key: str = Field("prompt", description="Column holding each prompt: chat messages or a plain string.")
    max_prompt_length: int = Field(
        64,
        gt=0,
        le=MAX_TOKENS,
        description="Prompts longer than this (in tokens) are an error; at most 2**21, twice the longest context models serve.",
    )
    eval_size: int = Field(
        64, gt=0, le=MAX_SEQUENCES,
        description="How many eval prompts to score at each evaluation (the first ones, in file order); at most 2**20.",
    )  # fmt: skip
    prompt_format: Literal["auto", "chat", "raw"] = Field(
        "auto",
        description="How prompts become tokens: chat renders them with the tokenizer's chat template (a plain string is "
        "one user message); raw tokenizes plain strings as they are (no template needed); auto decides per dataset, "
        "chat for message lists (TRL's conversational format), raw for strings (TRL's standard format).",
    )
    shuffle: bool = Field(
        True, description="Draw training prompts in a fresh random order each epoch (from data.seed and the epoch); false: file order."
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Seed of the training prompts' order; null uses the run's seed.")


class VLLMOptions(Section):
    """rollout.vllm: how the vLLM engine is started (rollout.engine=vllm; workers/engines/vllm.py)."""

    max_model_len: int | None = Field(
        None, gt=0, le=MAX_TOKENS,
        description="Longest prompt plus response vLLM serves (at most 2**21); null: data.max_prompt_length + rollout.max_response_length.",
    )  # fmt: skip
    kv_cache_bytes: int | None = Field(
        None,
        gt=0,
        le=2**46,
        description="Bytes of KV cache, at most 2**46 (64 TiB, more than 64 GPUs hold); null: 64 MiB on a CPU, and on a GPU "
        "what gpu_memory_utilization leaves after the weights.",
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="Fraction of the GPU's memory vLLM may take (weights and KV cache) when kv_cache_bytes is null."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=MAX_GPUS, description="GPUs one engine shards the model over (tensor parallel), at most 64."
    )
    enable_prefix_caching: bool = Field(True, description="Compute a prompt shared by a group's n samples once.")
    sleep_mode: bool = Field(True, description="On a GPU, let a colocated engine free its memory while the trainer runs (vLLM sleep mode).")


class SGLangOptions(Section):
    """rollout.sglang: how the SGLang engine is started (rollout.engine=sglang; CUDA only; workers/engines/sglang.py)."""

    max_model_len: int | None = Field(
        None,
        gt=0,
        le=MAX_TOKENS,
        description="SGLang's context_length (at most 2**21); null: data.max_prompt_length + rollout.max_response_length.",
    )
    mem_fraction_static: float = Field(0.5, gt=0, lt=1, description="Fraction of the GPU's memory for weights and KV cache.")
    tensor_parallel_size: int = Field(
        1, ge=1, le=MAX_GPUS, description="GPUs one engine shards the model over (SGLang's tp_size), at most 64."
    )
    weight_bucket_mb: float = Field(
        256.0, gt=0, le=MAX_BUCKET_MB,
        description="Weight updates go to the engine in calls of at most this many megabytes (one tensor may exceed it); at "
        "most 65536, more than a GPU's memory.",
    )  # fmt: skip


class MultiTurnConfig(Section):
    """rollout.multi_turn: conversations in which the model calls tools (docs/multi_turn.md,
    workers/multi_turn.py); verl's tool config layout (tools: class_name, config, tool_schema)."""

    enabled: bool = Field(False, description="Roll out conversations with tool calls instead of single responses.")
    max_turns: int = Field(4, ge=1, le=64, description="Most model turns per conversation (a call in the last one is not run).")
    max_tool_response_tokens: int = Field(
        64, gt=0, le=MAX_TOKENS, description="A tool's answer is cut to this many tokens before it joins the conversation (at most 2**21)."
    )
    format: Literal["hermes", "words"] = Field(
        "hermes",
        description='How the model writes a call: hermes <tool_call>{"name": ..., "arguments": {...}}</tool_call> '
        "(verl, Qwen); words NAME : ARGS = for vocabularies without tags (the tiny digit model).",
    )
    observation_template: str | None = Field(
        None,
        description="Text around a tool's answer, with {result} where it goes; null: the format's "
        "(hermes: <tool_response>\\n{result}\\n</tool_response>\\n, words: {result}).",
    )
    tools_config: str | None = Field(
        None,
        description="A tool config YAML in verl's layout (tools: [{class_name, config, tool_schema}]); read when the "
        "config is loaded and kept in `tools`, so the run does not need the file again.",
    )
    tools: list[dict[str, Any]] = Field(
        default_factory=list, description="The tools, in the layout of the tool config's tools: list (filled from tools_config)."
    )

    @field_validator("observation_template")
    @classmethod
    def _has_result(cls, template: str | None) -> str | None:
        if template is not None and "{result}" not in template:
            raise ValueError("rollout.multi_turn.observation_template must contain {result}, where the tool's answer goes")
        return template

    @model_validator(mode="after")
    def _tools_from_file(self) -> "MultiTurnConfig":
        from pathlib import Path

        from ratchet.tools.config import absolute_class_paths, load_tools_file, parse_tools

        if self.tools:
            specs = parse_tools({"tools": self.tools}, "rollout.multi_turn.tools")
        elif self.tools_config is not None:
            specs = load_tools_file(self.tools_config)
            object.__setattr__(self, "tools_config", str(Path(self.tools_config).expanduser().resolve()))
        elif self.enabled:
            raise ValueError("rollout.multi_turn.enabled needs tools: set rollout.multi_turn.tools_config to a tool config YAML")
        else:
            return self
        object.__setattr__(self, "tools", [spec.as_dict() for spec in absolute_class_paths(specs)])
        return self


class RolloutConfig(Section):
    engine: str = Field("hf", description=f"Generation engine, by registered name: {', '.join(ENGINES.names())}.")
    vllm: VLLMOptions = Field(default_factory=VLLMOptions, description="Options of the vLLM engine.")
    sglang: SGLangOptions = Field(default_factory=SGLangOptions, description="Options of the SGLang engine.")
    n: int = Field(8, ge=1, le=1024, description="Samples per prompt (the GRPO group size; 4-64 in practice, at most 1024).")
    replicas: int = Field(
        1,
        ge=1,
        le=1024,
        description="Engine replicas (data parallel): a batch's prompts are spread over them by load, a "
        "prompt's n samples on one replica; the batch is the same as one engine's (workers/actors/rollout_group.py).",
    )
    temperature: float = Field(
        1.0, gt=0, le=100, description="Sampling temperature; at most 100 (above ~10 sampling is already uniform noise)."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    max_response_length: int = Field(16, gt=0, le=MAX_TOKENS, description="Maximum new tokens per sample (at most 2**21).")
    partial_rollout: bool = Field(
        True,
        description="fully_async only: a weight sync lands between two decode steps of a generation in flight, which "
        "goes on with the new weights (each token records its version) instead of the sync waiting for it to finish. "
        "Off in a deterministic run, where the decode step a sync lands on would depend on timing.",
    )
    filter: str | None = Field(
        None,
        description="Rollout filter: a function 'module:function' or 'path/to/file.py:function' called on each generated "
        "sample as fn(prompt, response, data_source, extra_info) -> bool | dict; False (or {'keep': False}) drops the "
        "sample from the loss and its normaliser, {'keep': True, 'reward': x} keeps it with reward x (docs/algorithms.md, "
        "Rollout filters); null: every sample is kept.",
    )
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig, description="Multi-turn tool rollouts.")

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        return ENGINES.check(name)

    def engine_options(self) -> dict[str, Any]:
        """The keyword options of the configured engine: the section the engine catalog names
        for it (`ENGINE_OPTIONS`: rollout.vllm, rollout.sglang), none for the others."""
        section = ENGINE_OPTIONS.get(self.engine)
        return {} if section is None else getattr(self, section).model_dump()


class RewardConfig(Section):
    function: str | None = Field(
        "ratchet.tasks.rewards:compute_score",
        description="Rule-based reward as 'module:function' or 'path/to/file.py:function', with verl's signature "
        "compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict; null for none.",
    )
    function_weight: float = Field(
        1.0,
        ge=-MAX_WEIGHT,
        le=MAX_WEIGHT,
        description="Weight of the rule-based reward in the mix (within +-1e6: larger overflows the advantages).",
    )
    model_path: str | None = Field(
        None, description="Folder of a reward model (AutoModelForSequenceClassification, one label); null for none."
    )
    model_weight: float = Field(
        1.0, ge=-MAX_WEIGHT, le=MAX_WEIGHT, description="Weight of the reward model's score in the mix (within +-1e6)."
    )
    timeout_s: float = Field(
        300.0,
        gt=0,
        le=1800,  # the score activity's own time limit (workflows/phases.py PHASES)
        description="Time limit in seconds of one reward call (one batch), at most 1800: a call that runs longer fails "
        "its attempt and the reward worker is replaced.",
    )

    @model_validator(mode="after")
    def _some_reward(self) -> "RewardConfig":
        if self.function is None and self.model_path is None:
            raise ValueError("reward: set reward.function, reward.model_path, or both")
        return self


class KLConfig(Section):
    type: str = Field("low_var_kl", description="KL estimator: k1, abs, mse|k2, low_var_kl|k3, and '+' straight-through variants.")
    coef: float = Field(
        0.0,
        ge=0,
        le=100,
        description="KL weight (initial weight when adaptive); 0 disables the reference model. At most 100 "
        "(0.001-0.1 in practice): beyond it the policy cannot move.",
    )
    in_reward: bool = Field(False, description="Subtract coef * KL from the token rewards instead of adding a loss term.")
    target: float | None = Field(
        None, gt=0, le=100, description="Target KL per token for the adaptive controller (at most 100 nats); null keeps coef fixed."
    )
    horizon: int = Field(10000, gt=0, le=10**12, description="Adaptive controller horizon in samples (Ziegler et al., 2019); at most 1e12.")

    @field_validator("type")
    @classmethod
    def _known_kl(cls, name: str) -> str:
        return KL_ESTIMATORS.check(name)


def _off_policy_problems(problems: list[tuple[str, str]]) -> None:
    if problems:
        raise ValueError("; ".join(f"{name}: {message}" for name, message in problems))


class ISWeightsConfig(Section):
    """algorithm.off_policy.is_weights: importance weights pi_old / mu multiplied into the policy loss (verl's rollout_is)."""

    level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="Weight per token, per sequence (product of the ratios), or per sequence (their geometric mean)."
    )
    kind: Literal["truncate", "icepop"] = Field(
        "truncate", description="truncate: clamp into [low, high] (TIS); icepop: weight 0 outside [low, high] (IcePop, Ring-1T)."
    )
    low: float | None = Field(
        None, gt=0, le=MAX_WEIGHT, description="Lower bound on the weight; null: none (truncate only; icepop needs it, e.g. 0.5)."
    )
    high: float | None = Field(
        2.0, gt=0, le=MAX_WEIGHT, description="Upper bound on the weight (TIS e.g. 2.0; IcePop's paper 5.0); at most 1e6."
    )
    batch_normalize: bool = Field(
        False, description="Divide the weights by their batch mean (over kept tokens, or sequences at sequence levels)."
    )

    @model_validator(mode="after")
    def _bounds(self) -> "ISWeightsConfig":
        spec = as_is_weights(self)
        assert spec is not None  # made from this section itself
        _off_policy_problems(is_weights_problems(spec))
        return self


class RejectionCriterionConfig(Section):
    """One item of algorithm.off_policy.rejection: drop what has its statistic outside [low, high]."""

    statistic: Literal["ratio", "k2", "k3"] = Field(
        description="ratio: pi_old / mu; k2: (log ratio)^2 / 2; k3: ratio - 1 - log ratio (both >= 0, 0 when on-policy)."
    )
    level: Literal["token", "seq_sum", "seq_mean", "seq_max"] = Field(
        "token",
        description="token drops tokens; seq_sum/seq_mean/seq_max aggregate over the sequence and drop it whole (ratio: product, geometric mean).",
    )
    low: float | None = Field(None, ge=0, le=MAX_WEIGHT, description="Keep only what is >= low (at most 1e6); null: no lower bound.")
    high: float | None = Field(None, ge=0, le=MAX_WEIGHT, description="Keep only what is <= high (at most 1e6); null: no upper bound.")

    @model_validator(mode="after")
    def _bounds(self) -> "RejectionCriterionConfig":
        _off_policy_problems(criterion_problems(as_rejection([self])[0]))
        return self


class OffPolicyConfig(Section):
    mode: str = Field("none", description="Correction for samples from an older policy: none, tis, decoupled, bypass, rejection.")
    cap: float = Field(
        2.0, gt=1, le=MAX_WEIGHT, description="Importance-weight cap (truncation, masking or rejection threshold); at most 1e6."
    )
    level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="Importance weights per token, per sequence (product), or per sequence (geometric mean)."
    )
    is_weights: ISWeightsConfig | None = Field(
        None, description="IS weights pi_old / mu (truncated or IcePop) on top of mode none or rejection; null: none."
    )
    rejection: list[RejectionCriterionConfig] = Field(
        default_factory=list, description="Rejection criteria, all of which a token or sequence must pass to be trained on."
    )

    @model_validator(mode="after")
    def _combinations(self) -> "OffPolicyConfig":
        criteria = as_rejection(self.rejection)
        repeats = [(f"rejection.{name}", message) for name, message in rejection_problems(criteria)]
        _off_policy_problems(mode_problems(self.mode, as_is_weights(self.is_weights), criteria) + repeats)
        return self

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, name: str) -> str:
        return OFF_POLICY.check(name)


class OverlongConfig(Section):
    buffer_len: int = Field(
        0, ge=0, le=MAX_TOKENS, description="DAPO soft overlong penalty: the last buffer_len tokens before the limit; 0 disables."
    )
    penalty_factor: float = Field(1.0, ge=0, le=MAX_WEIGHT, description="Penalty at the length limit (at most 1e6, rewards are about 1).")


class AlgorithmConfig(Section):
    adv_estimator: str = Field("grpo", description="Advantage estimator, by registered name (docs/algorithms.md).")
    norm_adv_by_std: bool = Field(True, description="GRPO: divide by the group's reward std (False gives Dr. GRPO).")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount (GAE, REINFORCE++).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    policy_loss: str = Field("ppo_clip", description="Policy loss, by registered name.")
    clip_ratio_low: float = Field(
        0.2, ge=0, le=1, description="PPO clip: lower bound is 1 - clip_ratio_low; at most 1 (a ratio is never below 0)."
    )
    clip_ratio_high: float = Field(
        0.2, ge=0, le=MAX_WEIGHT, description="PPO clip: upper bound is 1 + clip_ratio_high (DAPO clip-higher); at most 1e6."
    )
    clip_ratio_c: float = Field(
        3.0, gt=1, le=MAX_WEIGHT, description="Dual-clip constant for negative advantages (dual_clip loss); at most 1e6."
    )
    # The rest of verl's catalogue (docs/algorithms.md); defaults are verl's.
    # Loss weights, temperatures and caps: at most 1e6 (MAX_WEIGHT), far above any useful value.
    sapo_tau_pos: float = Field(
        1.0, gt=0, le=MAX_WEIGHT, description="sapo loss: gate temperature for tokens with A > 0 (verl actor.tau_pos)."
    )
    sapo_tau_neg: float = Field(
        1.05, gt=0, le=MAX_WEIGHT, description="sapo loss: gate temperature for tokens with A <= 0 (verl actor.tau_neg)."
    )
    dro_beta: float = Field(
        0.1, gt=0, le=MAX_WEIGHT, description="dro loss: weight beta of the quadratic penalty (beta/2)(log pi - log pi_old)^2."
    )
    dppo_is_cap: float = Field(
        20.0, gt=0, le=MAX_WEIGHT,
        description="dppo_tv / dppo_kl losses: truncation cap of the IS weight (verl reads clip_ratio_c, falling back to 20).",
    )  # fmt: skip
    clip_cov_ratio: float = Field(
        2e-4, gt=0, le=1, description="clip_cov loss: fraction of the micro-batch's tokens whose gradient is cut."
    )
    clip_cov_lb: float = Field(
        1.0, ge=-MAX_WEIGHT, le=MAX_WEIGHT, description="clip_cov loss: a token is a candidate when its covariance is above this..."
    )
    clip_cov_ub: float = Field(5.0, ge=-MAX_WEIGHT, le=MAX_WEIGHT, description="clip_cov loss: ...and below this (both within +-1e6).")
    kl_cov_ratio: float = Field(2e-4, gt=0, le=1, description="kl_cov loss: fraction of the micro-batch's tokens given the KL penalty.")
    kl_cov_coef: float = Field(
        0.1, ge=0, le=MAX_WEIGHT, description="kl_cov loss: weight of the |log r| penalty (verl policy_loss.ppo_kl_coef)."
    )
    reinforce_is_cap: float = Field(
        2.0, gt=0, le=MAX_WEIGHT, description="reinforce_is loss: truncation cap of the IS weight (verl rollout_is_threshold)."
    )
    reinforce_is_level: Literal["token", "sequence"] = Field(
        "token", description="reinforce_is loss: IS weight per token, or one per sequence (product of the token ratios)."
    )
    loss_agg_mode: str = Field("token-mean", description="How token losses become one number, by registered name.")
    entropy_coeff: float = Field(
        0.0, ge=0, le=100, description="Weight of the entropy bonus; at most 100 (1e-3 in practice: beyond it the bonus is all the loss)."
    )
    kl: KLConfig = Field(default_factory=KLConfig)
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig)
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards all agree and refill with new prompts.")
    max_sampling_rounds: int = Field(
        3, ge=1, le=MAX_SAMPLING_ROUNDS, description="Dynamic sampling: most rollout rounds per step before training on what is kept."
    )
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)

    @field_validator("adv_estimator")
    @classmethod
    def _known_estimator(cls, name: str) -> str:
        return ADV_ESTIMATORS.check(name)

    @field_validator("policy_loss")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        return POLICY_LOSSES.check(name)

    @field_validator("loss_agg_mode")
    @classmethod
    def _known_agg(cls, name: str) -> str:
        return LOSS_AGGREGATIONS.check(name)

    @model_validator(mode="after")
    def _clip_cov_bounds(self) -> "AlgorithmConfig":
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(
                f"algorithm.clip_cov_lb ({self.clip_cov_lb}) must be below algorithm.clip_cov_ub ({self.clip_cov_ub}): "
                "Clip-Cov selects tokens whose covariance lies between them"
            )
        return self


class CriticConfig(Section):
    model_path: str | None = Field(None, description="Backbone of the critic (a causal LM folder); null uses model.path.")
    lr: float = Field(1e-3, gt=0, le=MAX_LR, description="Critic learning rate; at most 1 (an Adam step of lr per weight).")
    cliprange_value: float = Field(0.5, gt=0, le=MAX_WEIGHT, description="Value clipping range around the old values; at most 1e6.")
    ppo_epochs: int = Field(1, ge=1, le=MAX_EPOCHS, description="Critic passes over each batch; at most 100.")
    warmup_steps: int = Field(
        0, ge=0, le=MAX_STEPS,
        description="verl's critic_warmup: the first warmup_steps updates train the critic only (the policy stays as it is).",
    )  # fmt: skip


class SafetyConfig(Section):
    """safety: Safe-RLHF (Dai et al. 2023): a cost kept under a budget by a Lagrange
    multiplier (docs/algorithms.md, Safe-RLHF). On when a cost function or model is set."""

    cost_function: str | None = Field(
        None,
        description="Rule-based cost as 'module:function' or 'path/to/file.py:function', with the reward function's "
        "signature compute_cost(data_source, solution_str, ground_truth, extra_info=None) -> float | dict; null for none.",
    )
    cost_model_path: str | None = Field(
        None, description="Folder of a cost model (AutoModelForSequenceClassification, one label; higher is less safe); null for none."
    )
    # Within +-1e6 (MAX_WEIGHT): costs and multipliers are of the order of the rewards.
    budget: float = Field(
        0.0, ge=-MAX_WEIGHT, le=MAX_WEIGHT, description="The cost limit d: the multiplier rises while the batch's mean cost exceeds it."
    )
    lambda_init: float = Field(1.0, ge=0, le=MAX_WEIGHT, description="Initial Lagrange multiplier (> 0 with lambda_update=log).")
    lambda_lr: float = Field(0.1, ge=0, le=MAX_WEIGHT, description="Step size of the multiplier's update (0 keeps it fixed).")
    lambda_max: float | None = Field(None, gt=0, le=MAX_WEIGHT, description="Upper bound of the multiplier; null: none (1e6 at most).")
    lambda_update: Literal["projected", "log"] = Field(
        "projected",
        description="projected: lambda <- max(0, lambda + lambda_lr (mean cost - budget)); log: a gradient step on "
        "log lambda, as PKU-Alignment/safe-rlhf does (stays > 0, moves multiplicatively).",
    )

    @property
    def enabled(self) -> bool:
        return self.cost_function is not None or self.cost_model_path is not None


class LoraConfig(Section):
    """trainer.lora: train low-rank adapters (peft) on a frozen base instead of the whole policy (docs/lora.md)."""

    rank: int = Field(
        0, ge=0, le=65536, description="Adapter rank r; 0 trains the whole policy (no LoRA). At most 65536, above any model's width."
    )
    alpha: float = Field(
        16.0, gt=0, le=MAX_WEIGHT, description="Adapter scale numerator: an adapted weight is W + (alpha / rank) * B @ A (at most 1e6)."
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Linear layers that get adapters, by module name (e.g. [q_proj, v_proj]), or all-linear: every "
        "linear layer but the output head.",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input while training (0 to 1).")
    quantize: Literal["4bit"] | None = Field(
        None,
        description="QLoRA: load the frozen base in 4-bit NF4 with bitsandbytes (CUDA only; one trainer rank); null: "
        "the base in model.dtype.",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError('trainer.lora.target_modules is empty; name some linear layers (e.g. [q_proj, v_proj]) or use "all-linear"')
        return value

    @model_validator(mode="after")
    def _quantize_needs_adapters(self) -> "LoraConfig":
        if self.quantize is not None and self.rank == 0:
            raise ValueError("trainer.lora.quantize needs adapters to train: set trainer.lora.rank > 0 (e.g. 16), or quantize=null")
        return self


class TrainerConfig(Section):
    lr: float = Field(1e-4, gt=0, le=MAX_LR, description="AdamW learning rate; at most 1 (an Adam step moves each weight by about lr).")
    weight_decay: float = Field(
        0.0, ge=0, le=1, description="AdamW weight decay; at most 1 (each step shrinks the weights by lr * weight_decay)."
    )
    betas: tuple[UnitInterval, UnitInterval] = Field((0.9, 0.99), description="AdamW betas, each in [0, 1).")
    grad_clip: float = Field(1.0, gt=0, le=MAX_WEIGHT, description="Max global gradient norm; at most 1e6 (a bound that never clips).")
    ppo_epochs: int = Field(1, ge=1, le=MAX_EPOCHS, description="Passes over each rollout batch; at most 100 (PPO uses 1-4).")
    micro_batch_size: int = Field(
        64, ge=1, le=MAX_SEQUENCES,
        description="Sequences per forward/backward; gradients accumulate across micro-batches. At most 2**20.",
    )  # fmt: skip
    sync_bucket_mb: float = Field(
        128.0, gt=0, le=MAX_BUCKET_MB,
        description="Weight sync: most megabytes of weights gathered and sent in one bucket (the sync's extra memory is "
        "about one or two buckets); a larger tensor goes alone. At most 65536, more than a GPU's memory.",
    )  # fmt: skip
    sync_transport: Literal["auto", "object_store", "cuda_ipc", "nccl"] = Field(
        "auto",
        description="How a weight sync moves the buckets (docs/weight_sync.md): object_store (Ray's, always works), "
        "cuda_ipc (trainer and rollout colocated on one GPU pool), nccl (separate GPU pools), or auto: chosen from "
        "resources.pools. A forced one the placement cannot carry is refused at submit.",
    )
    world_size: int = Field(
        1, ge=1, le=MAX_RANKS, description="Trainer ranks; above 1 the policy is sharded with FSDP2 (gloo on CPU). At most 4096."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where the trainer runs: cuda (NCCL between ranks; the policy is sharded with FSDP2 even on one rank), "
        "cpu (gloo), or auto: cuda when the trainer's process sees a GPU, else cpu.",
    )
    mixed_precision: Literal["auto", "bf16", "none"] = Field(
        "auto",
        description="FSDP2 mixed precision: bf16 computes in bfloat16 and reduces gradients in float32 (weights and "
        "optimizer state stay in model.dtype); none computes in model.dtype; auto is bf16 on cuda, none on cpu.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass instead of keeping them: less "
        "memory for about one more forward pass.",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters instead of full training (rank 0: off).")

    @model_validator(mode="after")
    def _qlora_placement(self) -> "TrainerConfig":
        """QLoRA's 4-bit kernels (bitsandbytes) are CUDA-only, and 4-bit weights cannot be
        sharded with FSDP2 here: refused at submit, not when the trainer starts."""
        if self.lora.quantize is None:
            return self
        if self.device == "cpu":
            raise ValueError(
                'trainer.lora.quantize="4bit" (QLoRA) needs CUDA (bitsandbytes has no CPU 4-bit kernels) but trainer.device '
                "is cpu; set trainer.device=cuda (or auto on a GPU machine), or trainer.lora.quantize=null"
            )
        if self.world_size > 1:
            raise ValueError(
                'trainer.lora.quantize="4bit" (QLoRA) runs on one trainer rank: 4-bit weights are not sharded with FSDP2 here; '
                "set trainer.world_size=1 or trainer.lora.quantize=null"
            )
        return self


class WarmupConfig(Section):
    steps: int = Field(0, ge=0, le=MAX_STEPS, description="Supervised warm-up steps on the training answers before RL; 0 skips it.")
    lr: float = Field(3e-3, gt=0, le=MAX_LR, description="Warm-up learning rate; at most 1.")
    batch_size: int = Field(64, ge=1, le=MAX_SEQUENCES, description="Warm-up batch size (prompt-answer pairs); at most 2**20.")


# A Literal built from the table: its error lists the modes, and `ratchet schema` shows them.
LoopModeName = Literal[tuple(LOOP_MODES)]  # type: ignore[valid-type]  # a Literal of the table's names, built at import


class LoopConfig(Section):
    mode: LoopModeName = Field(  # type: ignore[valid-type]
        "sync", description=" ".join(f"{name}: {LOOP_MODES.get(name).description}" for name in LOOP_MODES)
    )
    # fully_async's pipeline depth: at most 1024 each, far past any useful lag (1-8), and the
    # ready batches travel in the run state (Temporal's 2 MB payload limit).
    max_staleness: int = Field(
        1, ge=0, le=1024,
        description="fully_async: most policy versions a sample may lag when trained on; staler batches are dropped and "
        "their prompts redone.",
    )  # fmt: skip
    queue_limit: int = Field(2, ge=1, le=1024, description="fully_async: most batches generated ahead of the trainer (in flight + ready).")
    sync_every: int = Field(1, ge=1, le=1024, description="fully_async: sync weights to the rollout engines every this many updates.")
    steps: int = Field(20, ge=1, le=MAX_STEPS, description="RL steps to run.")
    prompts_per_step: int = Field(
        16, ge=1, le=MAX_SEQUENCES, description="Prompts per rollout batch (samples = prompts * rollout.n); at most 2**20."
    )
    eval_every: int = Field(0, ge=0, le=MAX_STEPS, description="Greedy evaluation every this many steps (0: only before and after).")
    continue_as_new_every: int = Field(
        0, ge=0, le=MAX_STEPS, description="Continue the workflow as new every this many steps (0: only when Temporal suggests it)."
    )
    heartbeat_timeout_s: float = Field(
        30.0,
        gt=1,
        le=600,
        description="An activity whose worker process stops heartbeating for this long is retried elsewhere; at most "
        "600 s, the time limit of the shortest heartbeating activity, beyond which it would never fire.",
    )


class CheckpointConfig(Section):
    export_final: bool = Field(True, description="Export the final policy in Hugging Face format to the run folder.")
    every: int = Field(
        10,
        ge=0,
        le=MAX_STEPS,
        description="Checkpoint (trainer state, HF export, run state) every this many steps; 0: never. "
        "A lost trainer is rebuilt from the last one plus a replay of the stored batches after it.",
    )
    keep_last: int = Field(3, ge=1, le=MAX_STEPS, description="Retention: keep the last this many checkpoints...")
    keep_every: int = Field(0, ge=0, le=MAX_STEPS, description="...and every checkpoint whose step is a multiple of this (0: none).")


_URL_PREFIX = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")  # two letters at least: C: is a Windows drive


class StorageConfig(Section):
    root: str = Field(
        RunLayout.DEFAULT_ROOT,
        description="Local folder, or object-store URL, under which each run gets a folder: "
        + "; ".join(f"{name}://{'bucket/prefix' if s.needs_bucket else ''} {s.description}" for name, s in schemes.SCHEMES.objects())
        + ".",
    )

    @field_validator("root")
    @classmethod
    def _known_scheme(cls, root: str) -> str:
        """Any other fsspec protocol (or a `s3:/` typo read as a local folder) would fail, or
        write somewhere unexpected, only once the workers start. The schemes, and which need a
        bucket, come from the storage layer's table (src/ratchet/catalog/storage_schemes.py)."""
        supported = schemes.supported()
        if not root.strip():
            raise ValueError(f"empty; set {supported}")
        match = _URL_PREFIX.match(root)
        if "::" in root or (match and not root.startswith(f"{match.group(1)}://")):
            raise ValueError(f"{root!r} is not a URL ratchet supports; use {supported}")
        if match is None:
            return root
        if schemes.lookup(root).needs_bucket and not root.split("://", 1)[1].strip("/"):
            raise ValueError(f"{root!r} names no bucket; use {schemes.scheme_of(root)}://bucket[/prefix]")
        return root


PoolRole = Literal[POOL_ROLES]  # type: ignore[valid-type]


class PoolConfig(Section):
    """One resource pool (HybridFlow): nodes of equal size and the roles placed on them;
    a Ray placement group (docs/placement.md)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$", description="Pool name (letters, digits, '_', '.', '-').")
    nodes: int = Field(1, ge=1, le=1024, description="Nodes in the pool.")
    cpus_per_node: float = Field(
        gt=0, le=MAX_CPUS, description="Ray CPUs the pool reserves on each node (at most 65536, more than a machine has)."
    )
    gpus_per_node: int = Field(0, ge=0, le=64, description="GPUs the pool reserves on each node (0: a CPU pool).")
    roles: list[PoolRole] = Field(
        min_length=1,
        description=f"Roles placed on this pool ({', '.join(POOL_ROLES)}); trainer and rollout on one pool are colocated "
        "(the engine releases its memory while the trainer runs), on two pools split.",
    )


class ResourcesConfig(Section):
    pools: list[PoolConfig] = Field(
        default_factory=list,
        description="Resource pools and the roles on each (docs/placement.md); empty: every actor reserves its *_cpus "
        "from the whole cluster.",
    )
    # Ray CPUs of one actor: at most 65536 (MAX_CPUS), more than any machine has.
    rollout_cpus: float = Field(1.0, gt=0, le=MAX_CPUS, description="Ray CPUs reserved by each rollout worker (at most 65536).")
    trainer_cpus: float = Field(1.0, gt=0, le=MAX_CPUS, description="Ray CPUs reserved by each trainer rank (at most 65536).")
    reward_cpus: float = Field(
        0.0, ge=0, le=MAX_CPUS, description="Ray CPUs reserved by the reward worker (rule-based rewards are light: 0; at most 65536)."
    )
    critic_cpus: float = Field(0.0, ge=0, le=MAX_CPUS, description="Ray CPUs reserved by the critic (GAE estimators only; at most 65536).")
    torch_threads: int = Field(
        1, ge=1, le=1024, description="torch threads per worker process (one is fastest on small CPUs); at most 1024."
    )

    @field_validator("pools")
    @classmethod
    def _pool_names_unique(cls, pools: list[PoolConfig]) -> list[PoolConfig]:
        names = [p.name for p in pools]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"pool names must differ; {', '.join(map(repr, twice))} is used more than once")
        return pools


# Tracking stores MLflow accepts as a URI (a plain folder path is accepted too).
MLFLOW_URI_SCHEMES = ("sqlite", "file", "http", "https", "postgresql", "mysql", "mssql", "databricks")


class WandbConfig(Section):
    """wandb as a second tracker: off by default, and offline unless asked (no network)."""

    enabled: bool = Field(False, description="Log each run to wandb as well (one wandb run per ratchet run, id = run id).")
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: write the run folder only (sync it later with `wandb sync`); online: send to the wandb "
        "server (needs WANDB_API_KEY in the worker's environment, never in the config).",
    )
    project: str | None = Field(None, max_length=128, description="wandb project (default: tracking.experiment).")
    entity: str | None = Field(None, max_length=128, description="wandb entity (team or user); default: wandb's own.")
    dir: str | None = Field(None, description="Folder for wandb's run folders (default: <state dir>/wandb).")


class TrackingConfig(Section):
    name: str = Field(
        "run",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$",
        description="Run name (letters, digits, '_', '.', '-'; at most 100); the run id is '<name>-<timestamp>-<random>'.",
    )
    tags: list[str] = Field(default_factory=list, description="Free-form tags stored with the run.")
    experiment: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$",
        description="The experiment the run belongs to (letters, digits, '_', '.', '-'): searchable in the Temporal UI "
        "(ratchet_experiment), the MLflow experiment, the wandb project.",
    )
    mlflow: bool = Field(True, description="Log each run to MLflow (a local SQLite store under the state dir by default).")
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking URI (sqlite:///path.db, a folder, http(s)://server, postgresql://...); default: "
        "$MLFLOW_TRACKING_URI, else sqlite:///<state dir>/mlflow.db. No credentials here: the server's user and password "
        "go in MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD on the worker.",
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    @field_validator("mlflow_uri")
    @classmethod
    def _mlflow_uri(cls, uri: str | None) -> str | None:
        if uri is None:
            return None
        if not uri.strip():
            raise ValueError("is empty; leave tracking.mlflow_uri out for the default store, or give a URI")
        scheme = uri.split("://", 1)[0].split("+", 1)[0].lower() if "://" in uri else ""
        if "://" in uri and scheme not in MLFLOW_URI_SCHEMES:
            raise ValueError(f"{uri.split('://', 1)[0]!r} is not an MLflow store scheme; use one of {', '.join(MLFLOW_URI_SCHEMES)}")
        if "://" in uri and "@" in uri.split("://", 1)[1].split("/", 1)[0]:
            # The config travels through Temporal's history and config.json: no secrets in it.
            raise ValueError(
                "holds credentials (user@host); remove them and set MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD in the worker's environment instead"
            )
        return uri


# --------------------------------------------------------------------------- pipeline stages
# `stages:` makes the run a pipeline (docs/pipelines.md): each stage starts from the model the
# stage before it ended with. sft and dpo stages have their own data and optimiser settings;
# an rl stage is this config's RL run, with its own overrides.


class SftData(Section):
    """stages[].data of an sft stage: chat conversations (verl's multi-turn SFT layout)."""

    train_files: str = Field(description="Conversations: a .parquet, .jsonl/.json or save_to_disk dataset with a messages column.")
    eval_files: str | None = Field(None, description="Held-out conversations for the stage's eval loss; null: none.")
    messages_key: str = Field("messages", description="Column of chat messages [{role, content}]; the loss covers the assistant turns.")


class PreferenceData(Section):
    """stages[].data of a dpo stage: preference pairs (TRL's layout)."""

    train_files: str = Field(description="Pairs: a .parquet, .jsonl/.json or save_to_disk dataset with prompt, chosen, rejected.")
    eval_files: str | None = Field(None, description="Held-out pairs for preference accuracy and reward margin; null: none.")
    prompt_key: str = Field("prompt", description="Column of the prompt: chat messages or a string (one user message).")
    chosen_key: str = Field("chosen", description="Column of the preferred completion: assistant messages or a string.")
    rejected_key: str = Field("rejected", description="Column of the other completion: assistant messages or a string.")


class SupervisedStageBase(Section):
    steps: int = Field(ge=1, le=MAX_STEPS, description="Optimiser steps of the stage.")
    # Bounds as the RL trainer's (MAX_SEQUENCES, MAX_LR, MAX_WEIGHT, MAX_TOKENS, MAX_STEPS).
    batch_size: int = Field(16, ge=1, le=MAX_SEQUENCES, description="Conversations (sft) or pairs (dpo) per step; at most 2**20.")
    lr: float = Field(1e-4, gt=0, le=MAX_LR, description="AdamW learning rate (constant); at most 1.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay; at most 1.")
    betas: tuple[UnitInterval, UnitInterval] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    grad_clip: float = Field(1.0, gt=0, le=MAX_WEIGHT, description="Max global gradient norm; at most 1e6.")
    max_length: int = Field(
        512, gt=0, le=MAX_TOKENS, description="Longest sequence (prompt and answer) in tokens; a longer row is an error. At most 2**21."
    )
    eval_size: int = Field(
        256, gt=0, le=MAX_SEQUENCES, description="How many held-out rows to evaluate (the first ones, in file order); at most 2**20."
    )
    chunk_steps: int = Field(
        20, ge=1, le=MAX_STEPS, description="Steps per activity, each ending with a checkpoint: a crash redoes at most this many steps."
    )


class SftStage(SupervisedStageBase):
    """A supervised fine-tuning stage: token cross-entropy on the assistant turns."""

    kind: Literal["sft"] = Field(description="sft: supervised fine-tuning on chat conversations.")
    data: SftData


class DpoStage(SupervisedStageBase):
    """A preference stage: DPO or a variant against the stage's starting model, frozen."""

    kind: Literal["dpo"] = Field(description="dpo: preference optimisation on (prompt, chosen, rejected) pairs.")
    data: PreferenceData
    loss: str = Field("sigmoid", description="Preference loss by registered name: sigmoid (DPO), ipo, simpo (no reference).")
    beta: float = Field(
        0.1,
        gt=0,
        le=MAX_WEIGHT,
        description="DPO/IPO/SimPO beta: the implicit reward's scale (IPO: the target margin is 1/(2 beta)); at most 1e6.",
    )
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Conservative DPO / SimPO: probability that a label is flipped.")
    simpo_gamma: float = Field(0.5, ge=0, le=MAX_WEIGHT, description="SimPO: target reward margin gamma (TRL's simpo_gamma); at most 1e6.")

    @field_validator("loss")
    @classmethod
    def _known_preference_loss(cls, name: str) -> str:
        from ratchet.catalog.algorithms import PREFERENCE_LOSSES

        return PREFERENCE_LOSSES.check(name)


class RlStage(Section):
    """An RL stage: this config's RL run (rollout, reward, algorithm, loop, ...) from the
    previous stage's model, with `overrides` for this stage alone."""

    kind: Literal["rl"] = Field(description="rl: the run's RL loop (TrainingWorkflow) from the previous stage's model.")
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Keys of this config that differ for this stage, nested (loop: {steps: 3}) or dotted ('loop.steps': 3).",
    )


def _stage_kind(value: Any) -> str | None:
    return value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)


# Chosen by `kind` (a callable discriminator: Section's mode="before" check on every field
# rules out pydantic's field discriminator); an unknown kind is one error naming the three.
Stage = Annotated[
    Annotated[SftStage, Tag("sft")] | Annotated[DpoStage, Tag("dpo")] | Annotated[RlStage, Tag("rl")],
    Discriminator(_stage_kind, custom_error_type="stage_kind", custom_error_message="kind must be one of: sft, dpo, rl"),
]


def stage_model(data: dict[str, Any]) -> SftStage | DpoStage | RlStage:
    """A stage's config (as stored) validated back into its model."""
    from pydantic import TypeAdapter

    return TypeAdapter(Stage).validate_python(data)


class RunConfig(Section):
    """A whole training run. YAML plus dotted overrides, merged with OmegaConf."""

    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed for sampling, data order and initialisation (0 to 2**32 - 1).")
    deterministic: bool = Field(
        False,
        description="Deterministic torch kernels in the workers (sampling is always seeded per batch) and a fixed "
        "schedule: each batch is generated by exactly the policy version its index calls for (fully_async: batch k by "
        "version k - lag, see workflows/training/loops/fully_async.py; no partial rollouts). A run that was killed and recovered then "
        "ends with the same weights as one that was not, in every loop mode.",
    )
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    safety: SafetyConfig = Field(default_factory=SafetyConfig)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    loop: LoopConfig = Field(default_factory=LoopConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    stages: list[Stage] = Field(
        default_factory=list,
        description="A pipeline (docs/pipelines.md): stages run in order (kind sft, dpo or rl), each from the model the "
        "stage before ended with, the first from model.path; empty: one RL run.",
    )

    @property
    def uses_partial_rollouts(self) -> bool:
        """Weight syncs land inside generations in flight (`rollout.partial_rollout`)."""
        return self.rollout.partial_rollout and self.loop.mode == "fully_async" and not self.deterministic

    @property
    def uses_critic(self) -> bool:
        return ADV_ESTIMATORS.get(self.algorithm.adv_estimator).needs_critic

    @property
    def uses_safety(self) -> bool:
        """Safe-RLHF: a cost (function or model) is configured."""
        return self.safety.enabled
