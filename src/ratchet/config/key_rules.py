"""Every config key that may change after a run has started, in one table: while it trains
(`ratchet set RUN key=value`, config/live_keys.py) and at a resume from a checkpoint
(`ratchet resume RUN key=value`, config/resume_keys.py), each with the reason the change is
honoured; and, for keys people ask to change live that cannot, what to do instead.

A key missing from a column is refused there. A key's bounds and type are its schema
field's (config/schema.py): a changed value goes through that field like a submitted one.
Sweeps may vary any key (config/sweep_spec.py): a trial is a new run.

Standard library only: the training workflow checks a live change inside Temporal's
sandbox (its update's validator).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeyRule:
    key: str  # a dotted key; a glob over dotted keys where only `resume` is given
    live: str | None = None  # why a running run honours a change from its next update
    resume: str | None = None  # why a resume from a checkpoint honours a change
    instead: str | None = None  # a key refused live: why, and what to do instead


_OPTIMIZER_RESUME = "loaded into the optimizer's param groups after the checkpoint's optimizer state"
_EVERY_UPDATE = "read at every update"

RULES: tuple[KeyRule, ...] = (
    KeyRule(
        "trainer.lr",
        live="set in the optimizer's param groups before each update (there is no scheduler to overwrite it)",
        resume=_OPTIMIZER_RESUME,
    ),
    KeyRule("trainer.weight_decay", live="set in the optimizer's param groups before each update", resume=_OPTIMIZER_RESUME),
    KeyRule(
        "trainer.betas",
        live="set in the optimizer's param groups before each update; the moment estimates carry on",
        resume=_OPTIMIZER_RESUME,
    ),
    KeyRule("trainer.grad_clip", live="the gradient-norm bound, read at every update", resume=_EVERY_UPDATE),
    KeyRule("trainer.ppo_epochs", live="passes over each batch, read at every update", resume=_EVERY_UPDATE),
    KeyRule("trainer.micro_batch_size", resume="only splits an update into micro-batches; the update is the same"),
    KeyRule("trainer.world_size", resume="the sharded trainer state is resharded when a checkpoint is loaded"),
    KeyRule(
        "algorithm.kl.coef",
        live="the workflow's KL coefficient, passed with every update; only for runs that started with a reference model "
        "(algorithm.kl.coef > 0)",
        resume="becomes the run state's KL coefficient; the reference is the initial policy either way",
    ),
    KeyRule("algorithm.entropy_coeff", live="a loss weight read at every update", resume="a loss weight read at every update"),
    KeyRule("algorithm.clip_ratio_low", live="a PPO clip bound read at every update", resume="a PPO clip bound read at every update"),
    KeyRule("algorithm.clip_ratio_high", live="a PPO clip bound read at every update", resume="a PPO clip bound read at every update"),
    KeyRule(
        "algorithm.clip_ratio_c", live="the dual-clip constant read at every update", resume="the dual-clip constant read at every update"
    ),
    KeyRule(
        "loop.steps",
        resume="where the run ends; the workflow reads it",
        instead="the workflow plans the run from it; stop the run, or resume it with loop.steps=... (a resume may change it)",
    ),
    KeyRule("loop.eval_every", resume="an evaluation schedule; the workflow reads it"),
    KeyRule("loop.heartbeat_timeout_s", resume="how soon a lost worker is noticed"),
    KeyRule("loop.continue_as_new_every", resume="only how long a workflow history grows"),
    KeyRule("checkpoint.*", resume="when checkpoints are written and which are kept; those written stay readable"),
    KeyRule("resources.*", resume="the actors are rebuilt on a resume with the new reservations"),
    KeyRule("rollout.replicas", resume="how many engines share a batch; a batch is the same however it is split (seeds per prompt)"),
    KeyRule(
        "rollout.temperature",
        instead="the trainer recomputes a batch's log-probs at the temperature it was sampled with, and in one_step_off and "
        "fully_async a batch sampled before a change is trained after it; the stored batch does not record its temperature. "
        "Fork the run from a checkpoint with rollout.temperature=... instead",
    ),
    KeyRule(
        "rollout.top_p", instead="like rollout.temperature, it shapes batches already sampled but not yet trained on; fork the run instead"
    ),
    KeyRule("critic.lr", instead="the critic's optimizer is not rebuilt per update; fork the run with critic.lr=... instead"),
    KeyRule("reward.timeout_s", resume="a time limit per reward call, read on each call"),
    KeyRule("tracking.tags", resume="labels only"),
    KeyRule("tracking.experiment", resume="labels only"),
    KeyRule("tracking.mlflow*", resume="trackers only (a new mlflow_uri starts a new MLflow run in that store)"),
    KeyRule("tracking.wandb.*", resume="trackers only"),
)

# The columns, in table order: the messages list them as they stand here.
LIVE: dict[str, str] = {r.key: r.live for r in RULES if r.live is not None}
NOT_LIVE: dict[str, str] = {r.key: r.instead for r in RULES if r.instead is not None}
RESUMABLE: dict[str, str] = {r.key: r.resume for r in RULES if r.resume is not None}
