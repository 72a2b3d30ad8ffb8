"""A name -> implementation registry, so configs pick algorithms by name and errors list
what exists instead of failing deep inside the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


@dataclass
class Registry(Generic[T]):
    kind: str
    config_key: str
    entries: dict[str, T] = field(default_factory=dict)

    def register(self, name: str, entry: T) -> T:
        if name in self.entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self.entries[name] = entry
        return entry

    def names(self) -> list[str]:
        return sorted(self.entries)

    def check(self, name: str) -> str:
        """Return `name` if registered, else raise a ValueError that lists the valid names."""
        if name not in self.entries:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")
        return name

    def get(self, name: str) -> T:
        return self.entries[self.check(name)]


def decorator(registry: Registry[Any], name: str, wrap: Callable[[Callable], Any] = lambda fn: fn):
    """`@register_x("name")` helpers: registers `wrap(fn)` and returns `fn` unchanged."""

    def apply(fn: Callable) -> Callable:
        registry.register(name, wrap(fn))
        return fn

    return apply
