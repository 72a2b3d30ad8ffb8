"""Importing a user's own code by the names configs use: 'package.module' or
'path/to/file.py' (the part before ':' of a reward function, cost function, rollout filter
or tool class). Stdlib only, so the torch-free tool catalog and the task loaders share it.

This code runs with the worker's rights (its files, its credentials, the Ray cluster), so
a file another user owns or can write, or one in a folder another user can write, is
refused before it is imported (`private_paths.check_trusted_code`): that user could
otherwise make the worker run code of theirs. The config check at submit time imports
the same modules, so such a run is refused before any work starts."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from ratchet.private_paths import UntrustedCode, check_trusted_code


class UserCodeError(Exception):
    """The module cannot be imported; the message says why (callers re-raise it as their
    own config error, naming their key)."""


def import_user_module(target: str, namespace: str = "ratchet_user") -> ModuleType:
    """The module `target` names: an installed 'package.module', or a 'path/to/file.py'
    loaded once per path (as `<namespace>_<digest>` in sys.modules). Any failure of the
    user's code at import time becomes a UserCodeError with its type and message."""
    try:
        if not target.endswith(".py"):
            _check_module_file(target)
            return importlib.import_module(target)
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise UserCodeError(f"file not found: {path}")
        check_trusted_code(path)
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
    except UntrustedCode as exc:
        raise UserCodeError(str(exc)) from None
    except Exception as exc:  # any import-time failure of user code is a config error
        raise UserCodeError(f"cannot import {target!r}: {type(exc).__name__}: {exc}") from exc


def _check_module_file(target: str) -> None:
    """The file an installed 'package.module' would run, checked before it runs (finding
    it imports its parent packages, as any import would)."""
    if target in sys.modules:
        return  # already imported: nothing of it runs again
    spec = importlib.util.find_spec(target)
    if spec is not None and spec.origin and spec.has_location and Path(spec.origin).is_file():
        check_trusted_code(Path(spec.origin).resolve())
