"""Which node bundle of which resource pool each of a run's actors takes, worked out from
the config alone (no Ray), so that a placement that cannot work is refused at submit.

HybridFlow's resource pools: `resources.pools` names pools (nodes, CPUs and GPUs per
node) and the roles each one hosts. A pool becomes one Ray placement group
(workers/actors/placement.py): one bundle per node on a CPU pool, one bundle per GPU on a
GPU pool, so that a trainer rank and the rollout replica colocated with it share one
device. Trainer and rollout in one pool is *colocated* (the engine sleeps while the
trainer runs); in two pools, *split*. No pools (the default): every actor reserves its
`resources.*_cpus` from the whole cluster, as before pools existed.

Imports nothing heavy: the submit check calls `plan_placement` once the config has parsed
(config/cross_checks.py).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .pool_roles import CRITIC, POOL_ROLES, REFERENCE, REWARD, ROLLOUT, TRAINER

if TYPE_CHECKING:
    from .schema import RunConfig

__all__ = ["CRITIC", "POOL_ROLES", "REFERENCE", "REWARD", "ROLLOUT", "TRAINER", "PlacementPlan", "PoolPlan", "Slot", "plan_placement"]

# (dotted field path, what is wrong with it): the message reads on from the path,
# "resources.pools.0.roles names 'rollout' 2 times; ...".
Problem = tuple[str, str]


@dataclass(frozen=True)
class Slot:
    """Where one actor goes: pool, bundle, and what it reserves there."""

    role: str
    rank: int
    pool: str
    bundle: int
    cpus: float
    gpus: float


@dataclass(frozen=True)
class PoolPlan:
    name: str
    bundles: tuple[dict[str, float], ...]  # Ray placement-group bundles
    strategy: str
    slots: tuple[Slot, ...]

    @property
    def cpus(self) -> float:
        return sum(b.get("CPU", 0.0) for b in self.bundles)

    @property
    def gpus(self) -> float:
        return sum(b.get("GPU", 0.0) for b in self.bundles)


@dataclass(frozen=True)
class PlacementPlan:
    pools: tuple[PoolPlan, ...]  # empty: no pools configured (each actor reserves from the cluster)
    colocated: bool  # trainer and rollout share a pool: the engine sleeps while the trainer runs

    def slot(self, role: str, rank: int = 0) -> Slot | None:
        for pool in self.pools:
            for s in pool.slots:
                if s.role == role and s.rank == rank:
                    return s
        return None

    def pool_of(self, role: str) -> PoolPlan | None:
        return next((p for p in self.pools if any(s.role == role for s in p.slots)), None)


class PlacementProblem(ValueError):
    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__(problems_text(problems))


def problems_text(problems: list[Problem]) -> str:
    return "\n  ".join(f"{path} {msg}" for path, msg in problems)


def roles_used(cfg: RunConfig) -> list[str]:
    """The roles this run has actors (or, the reference, a model) for."""
    roles = [TRAINER, ROLLOUT, REWARD]
    if cfg.uses_critic:
        roles.append(CRITIC)
    if cfg.algorithm.kl.coef > 0:
        roles.append(REFERENCE)
    return roles


def rollout_devices(cfg: RunConfig) -> int:
    """GPUs one rollout replica shards its model over (the engine's tensor parallel size)."""
    return int(cfg.rollout.engine_options().get("tensor_parallel_size", 1)) if hasattr(cfg.rollout, "engine_options") else 1


def plan_placement(cfg: RunConfig) -> PlacementPlan:
    """The placement of every actor of the run; PlacementProblem names each field at fault."""
    pools = cfg.resources.pools
    if not pools:
        return PlacementPlan(pools=(), colocated=False)
    problems: list[Problem] = []
    home: dict[str, int] = {}
    for i, pool in enumerate(pools):
        for role, times in Counter(pool.roles).items():
            if times > 1:
                problems.append((f"resources.pools.{i}.roles", f"names {role!r} {times} times; name each role once"))
            if role in home and home[role] != i:
                problems.append(
                    (
                        f"resources.pools.{i}.roles",
                        f"names {role!r}, already on pool {pools[home[role]].name!r} (resources.pools.{home[role]}); a "
                        "role lives on exactly one pool: remove it from one of them",
                    )
                )
            home.setdefault(role, i)
    for role in roles_used(cfg):
        if role not in home:
            problems.append(
                (
                    "resources.pools",
                    f"has no pool for role {role!r} (this run uses it); add it to the roles of one pool (e.g. "
                    "resources.pools.0.roles), or remove resources.pools to place every actor on the whole cluster",
                )
            )
    if REFERENCE in home and TRAINER in home and home[REFERENCE] != home[TRAINER]:
        problems.append(
            (
                f"resources.pools.{home[REFERENCE]}.roles",
                f"names 'reference', but the reference policy lives in the trainer ranks, on pool "
                f"{pools[home[TRAINER]].name!r}; name it there or nowhere",
            )
        )
    if problems:
        raise PlacementProblem(problems)
    plans = tuple(_plan_pool(cfg, i, pool, [r for r in POOL_ROLES if home.get(r) == i], problems) for i, pool in enumerate(pools))
    colocated = home[TRAINER] == home[ROLLOUT]
    if colocated and pools[home[TRAINER]].gpus_per_node > 0 and cfg.loop.mode != "sync":
        problems.append(
            (
                "resources.pools",
                f"put trainer and rollout on one GPU pool, {pools[home[TRAINER]].name!r} (colocated), but loop.mode="
                f"{cfg.loop.mode} generates while the trainer trains; put them on separate pools (split) or use loop.mode=sync",
            )
        )
    if problems:
        raise PlacementProblem(problems)
    return PlacementPlan(pools=plans, colocated=colocated)


def _demands(cfg: RunConfig, roles: list[str], gpu_pool: bool) -> list[tuple[str, int, float, int]]:
    """(role, rank, CPUs, devices) of every actor of these roles; devices only on GPU pools."""
    r = cfg.resources
    out: list[tuple[str, int, float, int]] = []
    used = set(roles_used(cfg))
    if TRAINER in roles:
        out += [(TRAINER, k, r.trainer_cpus, 1 if gpu_pool else 0) for k in range(cfg.trainer.world_size)]
    if ROLLOUT in roles:
        out += [(ROLLOUT, k, r.rollout_cpus, rollout_devices(cfg) if gpu_pool else 0) for k in range(cfg.rollout.replicas)]
    if CRITIC in roles and CRITIC in used:
        out.append((CRITIC, 0, r.critic_cpus, 1 if gpu_pool else 0))
    if REWARD in roles:
        out.append((REWARD, 0, r.reward_cpus, 1 if gpu_pool and cfg.reward.model_path else 0))
    return out


def _plan_pool(cfg: RunConfig, i: int, pool, roles: list[str], problems: list[Problem]) -> PoolPlan:
    field = f"resources.pools.{i}"
    demands = _demands(cfg, roles, pool.gpus_per_node > 0)
    if pool.gpus_per_node > 0:
        return _plan_gpu_pool(cfg, field, pool, demands, problems)
    # A CPU pool: one bundle per node, actors first-fit in role order.
    bundles = [{"CPU": float(pool.cpus_per_node)} for _ in range(pool.nodes)]
    free = [float(pool.cpus_per_node)] * pool.nodes
    slots = []
    for role, rank, cpus, _ in demands:
        b = next((k for k, f in enumerate(free) if cpus <= f + 1e-9), None)
        if b is None:
            problems.append(_does_not_fit(cfg, field, pool, role, demands))
            break
        free[b] -= cpus
        slots.append(Slot(role, rank, pool.name, b, cpus, 0.0))
    strategy = "STRICT_SPREAD" if pool.nodes > 1 else "PACK"
    return PoolPlan(pool.name, tuple(bundles), strategy, tuple(slots))


def _plan_gpu_pool(cfg: RunConfig, field: str, pool, demands, problems: list[Problem]) -> PoolPlan:
    """One bundle per GPU. Each role's actors take consecutive devices from device 0 (a
    trainer rank and a rollout replica on one device are colocated there); actors sharing a
    device split it evenly, the fractional GPUs Ray lets them share it with. A replica's
    further tensor-parallel devices are the engine's own to place in the pool."""
    devices = pool.nodes * pool.gpus_per_node
    per_device_cpus = pool.cpus_per_node / pool.gpus_per_node
    bundles = tuple({"CPU": per_device_cpus, "GPU": 1.0} for _ in range(devices))
    world = cfg.trainer.world_size
    if any(role == TRAINER for role, *_ in demands) and world > devices:
        problems.append(
            (
                "trainer.world_size",
                f"of {world} (one GPU per rank) does not fit pool {pool.name!r}'s {devices} GPUs ({field}.nodes x "
                f"gpus_per_node); lower it to at most {devices} or give the pool more GPUs",
            )
        )
        return PoolPlan(pool.name, bundles, "PACK", ())
    tp = rollout_devices(cfg)
    replicas = sum(1 for role, *_ in demands if role == ROLLOUT)
    if replicas * tp > devices:
        problems.append(
            (
                "rollout.replicas",
                f"of {replicas}, at {tp} GPUs each (tensor parallel), does not fit pool {pool.name!r}'s {devices} GPUs; "
                f"lower it or the engine's tensor_parallel_size, or give {field} more GPUs",
            )
        )
        return PoolPlan(pool.name, bundles, "PACK", ())
    placed: list[tuple[str, int, float, int]] = []  # (role, rank, cpus, device)
    for role, rank, cpus, ndev in demands:
        device = rank * ndev if ndev else 0
        placed.append((role, rank, cpus, device if ndev else -1))
    sharing = Counter(d for *_, d in placed if d >= 0)
    cpus_on: defaultdict[int, float] = defaultdict(float)
    slots = []
    for role, rank, cpus, device in placed:
        bundle = max(device, 0)
        cpus_on[bundle] += cpus
        gpus = 1.0 / sharing[device] if device >= 0 else 0.0
        slots.append(Slot(role, rank, pool.name, bundle, cpus, gpus))
    over = [b for b, c in cpus_on.items() if c > per_device_cpus + 1e-9]
    if over:
        problems.append(
            (
                f"{field}.cpus_per_node",
                f"is too small: GPU {over[0]} of pool {pool.name!r} hosts actors reserving {cpus_on[over[0]]:g} CPUs, but "
                f"each GPU's bundle has {per_device_cpus:g} (cpus_per_node / gpus_per_node); raise it or lower "
                "the resources.*_cpus of its roles",
            )
        )
    return PoolPlan(pool.name, bundles, "PACK", tuple(slots))


def _does_not_fit(cfg: RunConfig, field: str, pool, role: str, demands) -> Problem:
    need = sum(c for _, _, c, _ in demands)
    what = ", ".join(f"{r} {n}x{c:g}" for r, n, c in _summary(demands))
    if role == TRAINER:
        return (
            "trainer.world_size",
            f"of {cfg.trainer.world_size}, at resources.trainer_cpus={cfg.resources.trainer_cpus:g} each, does not fit pool "
            f"{pool.name!r} ({pool.nodes} node(s) x {pool.cpus_per_node:g} CPUs, for {what}); lower it or "
            f"resources.trainer_cpus, or raise {field}.cpus_per_node / nodes",
        )
    return (
        f"{field}.cpus_per_node",
        f"is too small: pool {pool.name!r} has {pool.nodes} node(s) x {pool.cpus_per_node:g} CPUs but its actors need "
        f"{need:g} ({what}, each on one node); raise it or {field}.nodes, or lower the resources.*_cpus of its roles",
    )


def _summary(demands) -> list[tuple[str, int, float]]:
    out: dict[str, tuple[int, float]] = {}
    for role, _, cpus, _ in demands:
        n, _c = out.get(role, (0, cpus))
        out[role] = (n + 1, cpus)
    return [(r, n, c) for r, (n, c) in out.items()]
