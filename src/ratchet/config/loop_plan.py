"""The loop plan of a run: the part of its config the training workflow schedules by,
computed once at submit (the workflow never reads the config's schema itself)."""

from __future__ import annotations

from ratchet.types import LoopPlan


def loop_plan(cfg) -> LoopPlan:
    """`cfg`: a validated RunConfig."""
    return LoopPlan(
        steps=cfg.loop.steps,
        prompts_per_step=cfg.loop.prompts_per_step,
        eval_every=cfg.loop.eval_every,
        evaluate=cfg.data.eval_files is not None,
        kl_coef=cfg.algorithm.kl.coef,
        sampling_rounds=cfg.algorithm.max_sampling_rounds if cfg.algorithm.dynamic_sampling else 1,
        mode=cfg.loop.mode,
        max_staleness=cfg.loop.max_staleness,
        queue_limit=cfg.loop.queue_limit,
        sync_every=cfg.loop.sync_every,
        partial_rollout=cfg.uses_partial_rollouts,
        deterministic=cfg.deterministic,
        checkpoint_every=cfg.checkpoint.every,
        continue_as_new_every=cfg.loop.continue_as_new_every,
        heartbeat_timeout_s=cfg.loop.heartbeat_timeout_s,
        safe_lambda=cfg.safety.lambda_init if cfg.uses_safety else None,
    )
