"""Load a reward function named 'package.module:function' or 'path/to/file.py:function'."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Callable

REQUIRED_PARAMS = ("data_source", "solution_str", "ground_truth")


class RewardLoadError(ValueError):
    pass


def load_reward_fn(spec: str) -> Callable:
    """Import and return the function; raise RewardLoadError saying what is wrong and how to fix it."""
    target, sep, fn_name = spec.rpartition(":")
    if not sep or not target or not fn_name:
        raise RewardLoadError(f"{spec!r} is not 'module:function' or 'path/to/file.py:function'")
    try:
        if target.endswith(".py"):
            path = Path(target).expanduser().resolve()
            if not path.is_file():
                raise RewardLoadError(f"file not found: {path}")
            mod_name = f"ratchet_user_reward_{abs(hash(str(path)))}"
            module = sys.modules.get(mod_name)
            if module is None:
                loader_spec = importlib.util.spec_from_file_location(mod_name, path)
                module = importlib.util.module_from_spec(loader_spec)
                loader_spec.loader.exec_module(module)
                sys.modules[mod_name] = module
        else:
            module = importlib.import_module(target)
    except RewardLoadError:
        raise
    except Exception as exc:  # any import-time failure of user code is a config error
        raise RewardLoadError(f"cannot import {target!r}: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, fn_name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardLoadError(f"{target!r} has no function {fn_name!r}; callables there: {', '.join(public) or 'none'}")
    if not callable(fn):
        raise RewardLoadError(f"{spec!r} is not callable")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn
    accepts_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [p for p in REQUIRED_PARAMS if p not in params]
    if missing and not accepts_kwargs:
        raise RewardLoadError(
            f"{spec!r} lacks parameters {', '.join(missing)}; expected "
            "compute_score(data_source, solution_str, ground_truth, extra_info=None)"
        )
    return fn
