"""Loading a script of `benchmarks/` as a module, for the tests that check its parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str, module_name: str | None = None) -> ModuleType:
    """`benchmarks/<name>.py` as the module `module_name` (default: `name`)."""
    module_name = module_name or name
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module
