"""The roles a resource pool can host (`resources.pools[].roles`): the schema's choices and
the placement plan's (placement_plan.py) vocabulary. The reference policy lives inside the
trainer ranks (they compute its log-probs), so it can only be named on the trainer's pool."""

TRAINER, ROLLOUT, REFERENCE, CRITIC, REWARD = "trainer", "rollout", "reference", "critic", "reward"
POOL_ROLES = (TRAINER, ROLLOUT, REFERENCE, CRITIC, REWARD)
