"""The one table type of every catalog: a name -> implementation registry, so configs pick
an implementation by name and errors list what exists instead of failing deep inside a
worker.

An entry may be given as a "module:attribute" string, imported on the first `get`: the
names (and an entry's flags) are then known without importing torch, which is what lets
the config schema validate a config in a process that never loads the maths.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


def resolve(target: Any) -> Any:
    """`target` itself, or the object a "module:attribute" string names (imported once)."""
    return _load(target) if isinstance(target, str) else target


@functools.cache
def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ValueError(f"expected 'module:attribute', got {target!r}")
    return getattr(importlib.import_module(module), attr)


@dataclass
class Registry(Generic[T]):
    kind: str
    entries: dict[str, T | str] = field(default_factory=dict)

    def register(self, name: str, entry: T | str) -> T | str:
        """Add `entry` (or a "module:attribute" string naming it) under `name`."""
        if name in self.entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self.entries[name] = entry
        return entry

    def names(self) -> list[str]:
        return sorted(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __iter__(self):
        """The names, in the order they were registered (the order tables are shown in)."""
        return iter(self.entries)

    def objects(self) -> list[tuple[str, T]]:
        """(name, implementation) in registration order, each resolved as `get` does (a
        "module:attribute" entry is imported here)."""
        return [(name, self.get(name)) for name in self.entries]

    def check(self, name: str) -> str:
        """Return `name` if registered, else raise a ValueError that lists the valid names."""
        if name not in self.entries:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")
        return name

    def get(self, name: str) -> T:
        return resolve(self.entries[self.check(name)])


def decorator(registry: Registry[Any], name: str, wrap: Callable[[Callable], Any] = lambda fn: fn):
    """`@register_x("name")` helpers: registers `wrap(fn)` and returns `fn` unchanged."""

    def apply(fn: Callable) -> Callable:
        registry.register(name, wrap(fn))
        return fn

    return apply
