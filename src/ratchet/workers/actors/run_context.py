"""What an actor group needs of the run it belongs to: its ids and config, how to wait
(heartbeating in an activity), how its actors are named, found and created, and where RL
starts from. `RunActors` (run_actors.py) is one; the groups take this protocol rather
than importing the class that builds them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ratchet.config.placement_plan import PlacementPlan
    from ratchet.config.schema import RunConfig

    from .waiting import Waiter


class RunContext(Protocol):
    run_id: str
    run_uri: str
    cfg: RunConfig
    waiter: Waiter

    @property
    def plan(self) -> PlacementPlan: ...

    def wait(self, refs: Any, *, timeout_s: float | None = None) -> Any: ...

    def name(self, role: str, rank: int = 0) -> str: ...

    def find(self, role: str, rank: int = 0) -> Any: ...

    def create(self, cls: type, role: str, rank: int, num_cpus: float, *args: Any, concurrency: int = 1) -> Any: ...

    def initial_policy(self) -> str: ...
