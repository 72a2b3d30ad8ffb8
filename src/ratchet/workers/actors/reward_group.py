"""The run's reward worker as a group of one: made, found by name (a lost one recreated),
and its scoring held to `reward.timeout_s`: past it the worker is killed (the next attempt
makes a fresh one) and RewardTimeout names the batch and the fix. A reward function that
hangs costs one worker process, never the run's rollout engines or trainer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ratchet.errors import RewardTimeout
from ratchet.storage.layout import RunLayout

from ..results import ScoreResult
from ..reward import RewardWorker
from .names import Role, kill_named
from .waiting import WaitTimeout

if TYPE_CHECKING:
    from .run_context import RunContext

# Reward workers (by actor id) this process saw constructed: scoring's time limit then
# covers scoring only, and later calls skip asking again.
_CONSTRUCTED: set[str] = set()


@dataclass
class RewardGroup:
    actors: "RunContext"

    def start(self, policy_path: str):
        """The reward worker (it needs the tokenizer of `policy_path`), not waited for."""
        cfg = self.actors.cfg
        return self.actors.create(RewardWorker, Role.REWARD, 0, cfg.resources.reward_cpus, cfg, policy_path, self.actors.run_uri)

    def _constructed(self):
        actor = self.actors.find(Role.REWARD) or self.start(self.actors.initial_policy())
        key = actor._actor_id.hex()
        if key not in _CONSTRUCTED:  # once per actor: a recreated one has a new id
            self.actors.wait(actor.__ray_ready__.remote())
            _CONSTRUCTED.add(key)
        return actor

    def score(self, batch_index: int, kind: str = RunLayout.BATCHES, part: int = 0) -> ScoreResult:
        """Score stored batch `batch_index` (part `part`) of `kind` (batches/, evals/)."""
        return self._within_timeout(self._constructed().score.remote(batch_index, kind, part), batch_index, kind)

    def score_shares(self, batch_index: int, shares: list) -> tuple:
        """Score a batch handed over in memory (RolloutShare ObjectRefs; sync mode's fused
        step) as `score` does a stored one, then have the reward worker store batch and
        scores; returns the ObjectRefs (of the StepScores, of the store), not waited on: the
        trainer takes the scores straight from the reward worker. Wait on the scores with
        `handed_scores` (the time limit)."""
        actor = self._constructed()
        scores = actor.score_shares.remote(batch_index, *shares)
        stored = actor.store_handed.remote(batch_index, scores, *shares)  # queued behind the scoring
        return scores, stored

    def handed_scores(self, scores, batch_index: int):
        """The StepScores of `score_shares`, waited on for at most `reward.timeout_s`."""
        return self._within_timeout(scores, batch_index, RunLayout.BATCHES)

    def _within_timeout(self, ref, batch_index: int, kind: str):
        timeout_s = self.actors.cfg.reward.timeout_s
        try:
            return self.actors.wait(ref, timeout_s=timeout_s)
        except WaitTimeout:
            kill_named([self.actors.name(Role.REWARD)])
            raise RewardTimeout(
                f"run {self.actors.run_id}: scoring batch {batch_index} of {kind}/ took longer than reward.timeout_s={timeout_s:g} s; "
                "the reward worker was killed and the next attempt uses a new one. Fix a reward function that hangs, or "
                "raise reward.timeout_s"
            ) from None
