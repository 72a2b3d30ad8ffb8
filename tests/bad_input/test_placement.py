"""Bad resource pools are refused at submit (config validation, no cluster needed), each
with an issue naming the field and the fix; what needs the cluster (more CPUs or GPUs than
it has) is refused by the first activity that touches Ray, before any actor exists
(tests/integration/test_rollout_pool.py). And the default, no pools, places as before."""

from __future__ import annotations

import pytest

from ratchet.config import ConfigError, load_config
from ratchet.config.placement_plan import plan_placement
from ratchet.platform.client import RECIPE_PATH

BASE = {"model": {"path": "/nowhere"}, "data": {"train_files": "/nowhere.parquet"}}
ALL = "[trainer, rollout, reward, reference]"


def cfg_of(*overrides: str):
    return load_config(None, list(overrides), base=BASE, check_files=False)


def issue_of(*overrides: str) -> tuple[str, str]:
    with pytest.raises(ConfigError) as excinfo:
        cfg_of(*overrides)
    issues = excinfo.value.issues
    assert len(issues) == 1, issues
    return issues[0]


@pytest.mark.parametrize(
    ("pools", "extra", "field", "fragments"),
    [
        (  # a role the run uses on no pool
            "[{name: a, cpus_per_node: 2, roles: [trainer, rollout]}]", [], "resources.pools",
            ["has no pool for role 'reward' (this run uses it)", "add it to the roles of one pool", "remove resources.pools"],
        ),
        (  # the critic, only when the estimator needs one
            f"[{{name: a, cpus_per_node: 4, roles: {ALL}}}]", ["algorithm.adv_estimator=gae", "rollout.n=1"], "resources.pools",
            ["has no pool for role 'critic'"],
        ),
        (  # one pool naming a role twice
            "[{name: a, cpus_per_node: 4, roles: [trainer, rollout, rollout, reward]}]", [], "resources.pools",
            ["resources.pools.0.roles names 'rollout' 2 times; name each role once"],
        ),
        (  # two pools naming one role
            "[{name: a, cpus_per_node: 2, roles: [trainer, rollout, reward]}, {name: b, cpus_per_node: 2, roles: [rollout]}]",
            [], "resources.pools",
            ["resources.pools.1.roles names 'rollout', already on pool 'a' (resources.pools.0)", "remove it from one of them"],
        ),
        (  # the reference policy is computed in the trainer ranks
            "[{name: a, cpus_per_node: 2, roles: [trainer, rollout, reward]}, {name: b, cpus_per_node: 1, roles: [reference]}]",
            ["algorithm.kl.coef=0.1"], "resources.pools",
            ["resources.pools.1.roles names 'reference', but the reference policy lives in the trainer ranks, on pool 'a'"],
        ),
        (  # trainer ranks that do not fit a CPU pool
            f"[{{name: a, cpus_per_node: 2, roles: {ALL}}}]", ["trainer.world_size=2", "resources.trainer_cpus=1.5"],
            "trainer.world_size",
            ["trainer.world_size of 2, at resources.trainer_cpus=1.5 each, does not fit pool 'a' (1 node(s) x 2 CPUs",
             "lower it or resources.trainer_cpus, or raise resources.pools.0.cpus_per_node / nodes"],
        ),
        (  # trainer ranks that do not fit a GPU pool (one GPU each)
            f"[{{name: g, cpus_per_node: 8, gpus_per_node: 2, roles: {ALL}}}]", ["trainer.world_size=4"], "trainer.world_size",
            ["trainer.world_size of 4 (one GPU per rank) does not fit pool 'g''s 2 GPUs", "lower it to at most 2"],
        ),
        (  # more replicas than the GPU pool has devices
            f"[{{name: g, cpus_per_node: 8, gpus_per_node: 2, roles: {ALL}}}]", ["rollout.replicas=3"], "rollout.replicas",
            ["rollout.replicas of 3, at 1 GPUs each (tensor parallel), does not fit pool 'g''s 2 GPUs"],
        ),
        (  # a pool too small for the actors on it
            f"[{{name: a, cpus_per_node: 1.5, roles: {ALL}}}]", ["rollout.replicas=2"], "resources.pools",
            ["resources.pools.0.cpus_per_node is too small: pool 'a' has 1 node(s) x 1.5 CPUs but its actors need 3",
             "rollout 2x1"],
        ),
        (  # colocated on GPUs, but an async loop would train while the engine generates
            f"[{{name: g, cpus_per_node: 8, gpus_per_node: 2, roles: {ALL}}}]", ["loop.mode=one_step_off"], "resources.pools",
            ["put trainer and rollout on one GPU pool, 'g' (colocated), but loop.mode=one_step_off", "separate pools (split)"],
        ),
    ],
)  # fmt: skip
def test_bad_pools_are_refused_naming_the_field(pools, extra, field, fragments):
    path, message = issue_of(f"resources.pools={pools}", *extra)
    assert path == field
    for fragment in fragments:
        assert fragment in message


def test_pool_names_and_roles_are_checked_by_the_schema():
    path, message = issue_of(
        f"resources.pools=[{{name: a, cpus_per_node: 2, roles: {ALL}}}, {{name: a, cpus_per_node: 1, roles: [critic]}}]"
    )
    assert path == "resources.pools" and "pool names must differ; 'a' is used more than once" in message
    path, message = issue_of("resources.pools=[{name: a, cpus_per_node: 2, roles: [trainer, actor]}]")
    assert (
        path == "resources.pools.0.roles.1"
        and "expected one of: 'trainer', 'rollout', 'reference', 'critic' or 'reward'; got 'actor'" in message
    )
    path, _ = issue_of("resources.pools=[{name: a, roles: [trainer]}]")
    assert path == "resources.pools.0.cpus_per_node"
    path, _ = issue_of("rollout.replicas=0")
    assert path == "rollout.replicas"


def test_no_pools_places_every_actor_on_the_cluster_as_before():
    from ratchet.workers.actors.placement import needed_cpus

    cfg = load_config(RECIPE_PATH, ["model.path=/nowhere", "data.train_files=/nowhere.parquet"], check_files=False)
    assert cfg.resources.pools == [] and cfg.rollout.replicas == 1
    plan = plan_placement(cfg)
    assert plan.pools == () and not plan.colocated and plan.slot("trainer", 0) is None
    r = cfg.resources
    assert needed_cpus(cfg) == r.trainer_cpus * cfg.trainer.world_size + r.rollout_cpus + r.reward_cpus
    two = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"replicas": 2})})
    assert needed_cpus(two) == needed_cpus(cfg) + r.rollout_cpus


def test_good_pools_plan_bundles_and_slots():
    """Split on CPUs: one bundle per node, first fit. Colocated on GPUs: one bundle per GPU,
    trainer rank k and replica k share GPU k half and half."""
    split = plan_placement(
        cfg_of(
            "resources.pools=[{name: train, nodes: 2, cpus_per_node: 1, roles: [trainer, reference]}, "
            "{name: gen, cpus_per_node: 2, roles: [rollout, reward]}]",
            "trainer.world_size=2",
            "rollout.replicas=2",
            "algorithm.kl.coef=0.1",
        )  # fmt: skip
    )
    assert not split.colocated
    train, gen = split.pools
    assert train.bundles == ({"CPU": 1.0}, {"CPU": 1.0}) and train.strategy == "STRICT_SPREAD"
    assert [(s.role, s.rank, s.bundle, s.cpus) for s in train.slots] == [("trainer", 0, 0, 1.0), ("trainer", 1, 1, 1.0)]
    assert [(s.role, s.rank, s.bundle) for s in gen.slots] == [("rollout", 0, 0), ("rollout", 1, 0), ("reward", 0, 0)]
    assert split.slot("rollout", 1).pool == "gen"

    colocated = plan_placement(
        cfg_of(
            f"resources.pools=[{{name: g, cpus_per_node: 8, gpus_per_node: 2, roles: {ALL}}}]",
            "trainer.world_size=2",
            "rollout.replicas=2",
            "resources.trainer_cpus=1",
            "resources.rollout_cpus=1",
        )  # fmt: skip
    )
    (g,) = colocated.pools
    assert colocated.colocated and g.bundles == ({"CPU": 4.0, "GPU": 1.0},) * 2 and g.gpus == 2
    assert [(s.role, s.rank, s.bundle, s.gpus) for s in g.slots] == [
        ("trainer", 0, 0, 0.5), ("trainer", 1, 1, 0.5), ("rollout", 0, 0, 0.5), ("rollout", 1, 1, 0.5), ("reward", 0, 0, 0.0),
    ]  # fmt: skip
