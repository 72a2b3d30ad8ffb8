"""Importing a user's own code by the names configs use: 'package.module' or
'path/to/file.py' (the part before ':' of a reward function, cost function, rollout filter
or tool class). Stdlib only, so the torch-free tool catalog and the task loaders share it."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


class UserCodeError(Exception):
    """The module cannot be imported; the message says why (callers re-raise it as their
    own config error, naming their key)."""


def import_user_module(target: str, namespace: str = "ratchet_user") -> ModuleType:
    """The module `target` names: an installed 'package.module', or a 'path/to/file.py'
    loaded once per path (as `<namespace>_<digest>` in sys.modules). Any failure of the
    user's code at import time becomes a UserCodeError with its type and message."""
    try:
        if not target.endswith(".py"):
            return importlib.import_module(target)
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise UserCodeError(f"file not found: {path}")
        name = f"{namespace}_{hashlib.sha256(str(path).encode()).hexdigest()[:16]}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise UserCodeError(f"cannot load {path} as a Python module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # before running it: dataclasses and pickling look it up
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        return module
    except UserCodeError:
        raise
    except Exception as exc:  # any import-time failure of user code is a config error
        raise UserCodeError(f"cannot import {target!r}: {type(exc).__name__}: {exc}") from exc
