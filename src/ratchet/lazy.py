"""Packages whose public names are imported on first use.

A package that re-exports heavy names (torch, fsspec, transformers) from its submodules
would load them whenever any submodule is imported, since Python runs the package's
`__init__` first. Loading them on first access instead lets the torch-free catalogs
(the tables of `ratchet/catalog/`) be imported
by the config schema alone, in a client or CLI that never loads the maths.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, homes: dict[str, tuple[str, ...]]) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """(`__all__` names, `__getattr__`, `__dir__`) for `package`, whose names in `homes` (by
    the submodule that defines them) are imported on first access, then cached."""
    home = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(home))

    return sorted(home), __getattr__, __dir__
