"""Every check that reads more than one section of a run config, in one place, run once the
config has parsed (each section has checked its own fields by then, in schema.py).

- the estimator against the sampling (a group baseline needs several samples per prompt),
  the loop mode, the KL controller, a critic's warm-up and Safe-RLHF;
- the batch split over the trainer ranks;
- placement: every role on one pool, each pool big enough (placement_plan.py), and a forced
  `trainer.sync_transport` that the placement can carry (sync_transport.py);
- a pipeline's rl stages, each stage's own config put through these same checks
  (pipeline_plan.py).

`problems(cfg)` answers (the field to blame, or None when the message starts with it;
the message). The loader turns them into a ConfigError, so `load_config`,
`validate_config`, a sweep's trials and a live change all refuse the same configs.
`RunConfig.model_validate` alone does not run them: a worker takes a config the submit
check passed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ratchet.catalog.algorithms import ADV_ESTIMATORS

from .pipeline_plan import stage_problems
from .placement_plan import PlacementProblem, plan_placement, problems_text
from .sync_transport import transport_problems

if TYPE_CHECKING:
    from .schema import RunConfig

# (the dotted field the problem is about, or None when the message starts with it; message)
Problem = tuple[str | None, str]


def problems(cfg: RunConfig) -> list[Problem]:
    found = _algorithm_problems(cfg) + _batch_split(cfg) + _placement(cfg)
    if cfg.stages and not found:  # a stage's config is this one plus its overrides: this one passes first
        stages = stage_problems(cfg, stage_checks=problems)
        if stages:
            found.append((None, "; ".join(stages)))
    return found


def _algorithm_problems(cfg: RunConfig) -> list[Problem]:
    alg, estimator, out = cfg.algorithm, ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator), []
    if cfg.critic.warmup_steps and not estimator.needs_critic:
        out.append((None, f"critic.warmup_steps={cfg.critic.warmup_steps} needs a critic, and adv_estimator="
                          f"{alg.adv_estimator!r} trains none: set critic.warmup_steps=0 or algorithm.adv_estimator=gae"))  # fmt: skip
    if estimator.needs_group and cfg.rollout.n < 2:
        out.append((None, f"rollout.n must be >= 2 for adv_estimator={alg.adv_estimator!r} "
                          "(a group baseline needs several samples per prompt)"))  # fmt: skip
    if cfg.loop.mode == "fully_async" and alg.dynamic_sampling:
        out.append((None, "algorithm.dynamic_sampling needs loop.mode sync or one_step_off (fully_async batches are fixed-size)"))
    if cfg.loop.mode == "fully_async" and cfg.loop.sync_every > cfg.loop.max_staleness + 1:
        out.append((None, f"loop.sync_every={cfg.loop.sync_every} > loop.max_staleness + 1 = {cfg.loop.max_staleness + 1}: "
                          "every batch would be too stale to train on"))  # fmt: skip
    if alg.kl.target is not None and alg.kl.coef == 0:
        out.append((None, "algorithm.kl.coef must be > 0 when algorithm.kl.target is set (the adaptive controller scales it)"))
    return out + _safety(cfg)


def _safety(cfg: RunConfig) -> list[Problem]:
    """Safe-RLHF needs the cost's own advantage from the same estimator: no cost critic or
    greedy cost baseline exists, so estimators that need one are refused."""
    if not cfg.uses_safety:
        return []
    estimator, safety = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator), cfg.safety
    if estimator.needs_critic or estimator.needs_baseline:
        needs = "a critic" if estimator.needs_critic else "a greedy baseline"
        return [(None, f"safety (Safe-RLHF) with algorithm.adv_estimator={cfg.algorithm.adv_estimator!r}: that estimator needs "
                       f"{needs}, and ratchet has none for the cost; use a critic-free estimator without a baseline (grpo, rloo, "
                       "reinforce_plus_plus_baseline, reinforce_plus_plus) or unset safety.cost_function and safety.cost_model_path")]  # fmt: skip
    if safety.lambda_update == "log" and safety.lambda_init == 0:
        return [(None, "safety.lambda_init must be > 0 with safety.lambda_update=log (log 0 is -inf: it would never move)")]
    if safety.lambda_max is not None and safety.lambda_init > safety.lambda_max:
        return [(None, f"safety.lambda_init={safety.lambda_init} is above safety.lambda_max={safety.lambda_max}")]
    return []


def _batch_split(cfg: RunConfig) -> list[Problem]:
    """Every trainer rank must get the same number of samples, or FSDP's collectives hang."""
    samples = cfg.loop.prompts_per_step * cfg.rollout.n
    world = cfg.trainer.world_size
    if samples % world == 0:
        return []
    divisors = [d for d in range(1, min(samples, 64) + 1) if samples % d == 0]
    return [
        (
            "trainer.world_size",
            f"{samples} samples per step (loop.prompts_per_step={cfg.loop.prompts_per_step} x rollout.n="
            f"{cfg.rollout.n}) do not split evenly over {world} ranks; every rank must get the same number "
            f"of samples, so use a world size that divides {samples} (e.g. {', '.join(map(str, divisors))})",
        )
    ]


def _placement(cfg: RunConfig) -> list[Problem]:
    try:
        found = transport_problems(plan_placement(cfg), cfg)
    except PlacementProblem as exc:
        found = exc.problems
    return [(None, problems_text(found))] if found else []
