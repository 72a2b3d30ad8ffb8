"""Placing a run's actors: how much the run needs in all, which resource pool's placement
group takes each actor, and did a node take it?

A run is admitted to the cluster whole before it reserves anything (admission.py: it gets
everything `run_need` says at once, or waits in a visible queue); a run the cluster can
never hold fails at once (`ResourcesUnavailable`, `check_never_fits`). With
`resources.pools`, each pool is a detached Ray placement group named `<run id>/pool-<name>`
(config/placement_plan.py says which bundle each actor takes); a pool bigger than the
cluster, or than any of its nodes, is refused before anything is reserved.
`check_resources` (free CPUs now, or fail naming who holds them) still guards the start of
a run that was not admitted (one started before the queue existed).
"""

from __future__ import annotations

import logging
import math
import time

import ray

from ratchet.config.placement_plan import PlacementPlan, PoolPlan, Slot, plan_placement
from ratchet.config.schema import RunConfig
from ratchet.errors import ResourcesUnavailable

from . import admission
from .names import NAMESPACE, Role, actor_name, pool_group_name, role_of, run_actor_names, run_pool_groups, wait_name_free
from .waiting import Waiter, WaitTimeout

log = logging.getLogger(__name__)

# An actor that no node could place in this long fails its activity instead of waiting
# forever; a placed actor may then take as long as its constructor needs.
PLACEMENT_TIMEOUT_S = 60.0
# Freed CPUs reach Ray's resource view a moment after the kill that freed them.
RESOURCE_SETTLE_S = 10.0
_POLL_S = 0.5


def actor_pid(actor) -> int | None:
    """The worker process id of an actor; 0 while no node has placed it, -1 once it died
    before it was placed, None if unknown. (Ray's private actor table: the public state
    API needs the dashboard.)"""
    try:
        from ray._private import state

        info = state.actors(actor_id=actor._actor_id.hex())
        pid = int(info.get("Pid", 0) or 0)
    except Exception:  # noqa: BLE001 - an older or newer Ray: no placement check
        return None
    return -1 if pid == 0 and info.get("State") == "DEAD" else pid


def actor_env(cfg: RunConfig, num_cpus: float) -> dict | None:
    """The runtime_env an actor of `num_cpus` CPUs needs, or None when Ray's own start gives
    the same. Ray sets OMP_NUM_THREADS to the actor's whole CPUs (at least 1) before the
    process imports torch, and `configure_worker_process` sets the rest inside the process
    (torch's threads, the malloc thresholds, TOKENIZERS_PARALLELISM). Only a
    `resources.torch_threads` other than that count needs the variables set at the start,
    for the threads a threaded actor runs its calls on: OpenMP gives a thread it did not
    start the count it read then. Without a runtime_env Ray starts the actor's process
    directly, not through a set-up process of its own that imports Ray first (about
    0.4 CPU-s and as many seconds more for every actor start, and every rebuild)."""
    threads = cfg.resources.torch_threads
    if threads == max(math.floor(num_cpus), 1):
        return None
    return {"env_vars": {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}}


def role_cpus(cfg: RunConfig) -> dict[str, float]:
    r = cfg.resources
    return {Role.TRAINER: r.trainer_cpus, Role.ROLLOUT: r.rollout_cpus, Role.REWARD: r.reward_cpus, Role.CRITIC: r.critic_cpus}


def needed_cpus(cfg: RunConfig) -> float:
    r = cfg.resources
    need = r.trainer_cpus * cfg.trainer.world_size + r.rollout_cpus * cfg.rollout.replicas + r.reward_cpus
    return need + (r.critic_cpus if cfg.uses_critic else 0.0)


def run_need(cfg: RunConfig, plan: PlacementPlan | None = None) -> admission.Need:
    """Everything the run reserves at once: its actors' CPUs, or with resource pools the
    pools' bundles (CPUs and GPUs). No Ray calls."""
    plan = plan if plan is not None else plan_placement(cfg)
    if plan.pools:
        return admission.Need(sum(p.cpus for p in plan.pools), sum(p.gpus for p in plan.pools))
    return admission.Need(needed_cpus(cfg))


def held_by_run(run_id: str, cfg: RunConfig, plan: PlacementPlan | None = None) -> admission.Need:
    """What the run's own live actors (or pools) hold in Ray now: a retried or resumed
    start kills or reuses them, so they count as free for it."""
    plan = plan if plan is not None else plan_placement(cfg)
    if plan.pools:
        own = run_pool_groups(run_id)
        mine = [p for p in plan.pools if pool_group_name(run_id, p.name) in own]
        return admission.Need(sum(p.cpus for p in mine), sum(p.gpus for p in mine))
    per_role = role_cpus(cfg)
    return admission.Need(sum(per_role.get(role_of(n), 0.0) for n in run_actor_names().get(run_id, [])))


_NEED_TEXT = (
    "resources.trainer_cpus x trainer.world_size + resources.rollout_cpus x rollout.replicas + resources.reward_cpus "
    "[+ resources.critic_cpus]"
)


def check_never_fits(run_id: str, cfg: RunConfig, plan: PlacementPlan | None = None) -> None:
    """ResourcesUnavailable at once (waiting in the queue could never help) when the run
    needs more than the whole cluster has, or pools its nodes cannot hold."""
    plan = plan if plan is not None else plan_placement(cfg)
    if plan.pools:
        _check_pools_fit(run_id, plan)
        return
    need, total = needed_cpus(cfg), ray.cluster_resources().get("CPU", 0.0)
    if need > total + 1e-9:
        raise ResourcesUnavailable(_too_big(run_id, need, total))


def _too_big(run_id: str, need: float, total: float) -> str:
    return f"run {run_id} needs {need:g} Ray CPUs ({_NEED_TEXT}) but the cluster has {total:g}; lower the resources.* values or add nodes"


def holders_text(run_id: str) -> str:
    others = {k: v for k, v in run_actor_names().items() if k != run_id}
    held = "; ".join(f"run {k}: {', '.join(v)}" for k, v in others.items()) or "no other run's actors"
    return (
        f"actors of other runs in the cluster: {held}. Stop the runs you no longer need (`ratchet stop RUN`), "
        "or lower resources.trainer_cpus / rollout_cpus / reward_cpus / critic_cpus (or trainer.world_size)"
    )


def check_resources(
    run_id: str, cfg: RunConfig, waiter: Waiter, settle_s: float = RESOURCE_SETTLE_S, plan: PlacementPlan | None = None
) -> None:
    """Fail at once, not after waiting for placement forever, when the CPUs the run
    needs are not free: Ray's free CPUs plus what this run's own actors already hold (a
    restore or a retry kills or reuses them). Waits up to `settle_s` for CPUs that a kill
    just freed to show up. With resource pools: the pools' placement groups instead."""
    if plan is not None and plan.pools:
        check_pools(run_id, plan, waiter, settle_s)
        return
    need = needed_cpus(cfg)
    per_role = role_cpus(cfg)
    total = ray.cluster_resources().get("CPU", 0.0)
    deadline = time.monotonic() + settle_s
    while True:
        own = sum(per_role.get(role_of(n), 0.0) for n in run_actor_names().get(run_id, []))
        free = ray.available_resources().get("CPU", 0.0)
        if need <= free + own + 1e-9 or need > total or time.monotonic() >= deadline:
            break
        waiter.progress("waiting for free CPUs")
        time.sleep(_POLL_S)
    if need <= free + own + 1e-9:
        return
    if need > total:
        msg = _too_big(run_id, need, total)
    else:
        msg = (
            f"run {run_id} needs {need:g} Ray CPUs ({_NEED_TEXT}) but only {free + own:g} of the cluster's {total:g} are "
            f"free ({free:g} free + {own:g} held by this run's own actors); {holders_text(run_id)}"
        )
    raise ResourcesUnavailable(msg)


def create_actor(
    run_id: str, cfg: RunConfig, waiter: Waiter, cls, role: str, rank: int, num_cpus: float, *args,
    concurrency: int = 1, slot: tuple[Slot, PoolPlan] | None = None,
):  # fmt: skip
    """The run's detached actor `role`-`rank` (the live one if it exists), once a node
    has placed it; with `slot`, in that bundle of its pool's placement group; with the
    concurrency groups its class declares (`CONCURRENCY_GROUPS`). The run holds its
    admission grant first (a rebuilt actor takes back its own CPUs)."""
    admission.reclaim(run_id, run_need(cfg))
    name = actor_name(run_id, role, rank)
    options = dict(
        name=name,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=num_cpus,
        max_concurrency=concurrency,
    )
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if slot is not None:
        where, pool = slot
        group = pool_group(run_id, pool, waiter)
        num_cpus = where.cpus
        options.update(
            num_cpus=where.cpus,
            num_gpus=where.gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=where.bundle),
        )
    env = actor_env(cfg, num_cpus)
    if env is not None:
        options["runtime_env"] = env
    groups = getattr(cls, "CONCURRENCY_GROUPS", None)
    remote_cls = ray.remote(concurrency_groups=groups)(cls) if groups else ray.remote(cls)
    deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
    while True:
        actor = remote_cls.options(**options).remote(*args)
        if wait_placed(run_id, actor, name, num_cpus, waiter, max(1.0, deadline - time.monotonic())):
            return actor
        # Its node died while Ray was placing it (the bundle it was headed for moved with
        # the node): Ray gives such an actor up. A new one goes where the bundle is now.
        if time.monotonic() >= deadline:
            raise ResourcesUnavailable(
                f"run {run_id}: actor {name} died before any node ran it, again and again for {PLACEMENT_TIMEOUT_S:g} s "
                "(nodes dying?); the activity is retried",
                non_retryable=False,
            )
        log.warning("run %s: actor %s died before a node ran it (its node went); creating it again", run_id, name)
        wait_name_free(name)
        if slot is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pool_group(run_id, slot[1], waiter), placement_group_bundle_index=slot[0].bundle
            )


def wait_placed(run_id: str, actor, name: str, num_cpus: float, waiter: Waiter, timeout_s: float = PLACEMENT_TIMEOUT_S) -> bool:
    """Until a node runs the actor (not until its constructor is done): True; False if the
    actor died before any node ran it. An actor that cannot be placed in `timeout_s` is
    killed (so it never takes CPUs later) and ResourcesUnavailable names who holds the CPUs."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid = actor_pid(actor)
        if pid is None or pid > 0:
            return True
        if pid < 0:
            return False
        if time.monotonic() >= deadline:
            break
        waiter.progress(f"waiting for a node to place {name}")
        time.sleep(_POLL_S)
    ray.kill(actor, no_restart=True)
    wait_name_free(name)
    raise ResourcesUnavailable(
        f"run {run_id}: no Ray node could place actor {name} ({num_cpus:g} CPUs) within {timeout_s:g} s; {holders_text(run_id)}"
    )


# -- resource pools: one detached placement group each ------------------------------------


def _node_totals() -> list[dict[str, float]]:
    return [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]


def check_pools(run_id: str, plan: PlacementPlan, waiter: Waiter, settle_s: float = RESOURCE_SETTLE_S) -> None:
    """Refuse pools the cluster can never hold (more CPUs or GPUs than it has, a bundle no
    node is big enough for, more nodes than it has), then create the placement groups,
    each ready within PLACEMENT_TIMEOUT_S or refused naming who holds the resources."""
    _check_pools_fit(run_id, plan)
    needs = {"CPU": sum(p.cpus for p in plan.pools), "GPU": sum(p.gpus for p in plan.pools)}
    own = run_pool_groups(run_id)
    deadline = time.monotonic() + settle_s
    while True:
        free = ray.available_resources()
        # The run's own groups (a retried start) already hold their share.
        missing = {
            k: v for k, v in needs.items()
            if v - sum(p.cpus if k == "CPU" else p.gpus for p in plan.pools if pool_group_name(run_id, p.name) in own)
            > free.get(k, 0.0) + 1e-9
        }  # fmt: skip
        if not missing or time.monotonic() >= deadline:
            break
        waiter.progress("waiting for free resources for the run's pools")
        time.sleep(_POLL_S)
        own = run_pool_groups(run_id)
    if missing:
        kind = next(iter(missing))
        raise ResourcesUnavailable(
            f"run {run_id}: resources.pools need {needs[kind]:g} {kind}s but only {free.get(kind, 0.0):g} are free; {holders_text(run_id)}"
        )
    for pool in plan.pools:
        pool_group(run_id, pool, waiter)


def _check_pools_fit(run_id: str, plan: PlacementPlan) -> None:
    """ResourcesUnavailable naming the field when the cluster can never hold a pool."""
    total = ray.cluster_resources()
    nodes = _node_totals()
    for i, pool in enumerate(plan.pools):
        field = f"resources.pools.{i}"
        for kind, have, need in (("CPU", total.get("CPU", 0.0), pool.cpus), ("GPU", total.get("GPU", 0.0), pool.gpus)):
            if need > have + 1e-9:
                raise ResourcesUnavailable(
                    f"run {run_id}: pool {pool.name!r} ({field}) needs {need:g} {kind}s but the cluster has {have:g}; lower "
                    f"{field}.nodes or {field}.{kind.lower()}s_per_node, or add nodes"
                )
        bundle = pool.bundles[0]
        fits = [n for n in nodes if all(n.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())]
        if not fits:
            raise ResourcesUnavailable(
                f"run {run_id}: no node of the cluster has {bundle} for one bundle of pool {pool.name!r}; lower "
                f"{field}.cpus_per_node / gpus_per_node to what one node has"
            )
        if pool.strategy == "STRICT_SPREAD" and len(fits) < len(pool.bundles):
            raise ResourcesUnavailable(
                f"run {run_id}: pool {pool.name!r} needs {len(pool.bundles)} nodes ({field}.nodes) but only {len(fits)} "
                f"node(s) of the cluster can hold {bundle}; lower {field}.nodes or add nodes"
            )


def pool_group(run_id: str, pool: PoolPlan, waiter: Waiter, timeout_s: float = PLACEMENT_TIMEOUT_S):
    """The pool's placement group, created (detached, so it outlives this process like the
    actors in it) unless it exists, once Ray has reserved all its bundles."""
    from ray.util import get_placement_group, placement_group, remove_placement_group

    name = pool_group_name(run_id, pool.name)
    try:
        group = get_placement_group(name)
    except ValueError:
        group = placement_group(list(pool.bundles), strategy=pool.strategy, name=name, lifetime="detached")
    try:
        waiter.wait(group.ready(), timeout_s=timeout_s)
    except WaitTimeout:
        remove_placement_group(group)
        raise ResourcesUnavailable(
            f"run {run_id}: Ray could not reserve pool {pool.name!r} ({len(pool.bundles)} bundles of {pool.bundles[0]}) "
            f"within {timeout_s:g} s; {holders_text(run_id)}"
        ) from None
    return group
