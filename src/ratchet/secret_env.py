"""Secrets given as files: `<VAR>_FILE` names a file that holds `<VAR>`'s value.

Why: a value in a process's environment is shown by `docker inspect` and `kubectl get pod
-o yaml`, is inherited by every child (every Ray worker, so every actor and the user code
in it), and lands in crash reports. A mounted Secret file is read by the code that needs
it, when it needs it. The convention is Docker's (`POSTGRES_PASSWORD_FILE`); the plain
variable still works and wins, for a laptop. Stdlib only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

__all__ = ["SecretFileError", "secret_value"]


class SecretFileError(ValueError):
    """`<VAR>_FILE` names a file that cannot be read or is empty."""


def secret_value(var: str, environ: Mapping[str, str] | None = None) -> str | None:
    """`var`'s value (stripped) when set; else the contents of the file `<var>_FILE` names
    (surrounding whitespace and the trailing newline removed); None when neither is set.
    The message of an error names the variable and the file, never the value."""
    env = os.environ if environ is None else environ
    value = (env.get(var) or "").strip()
    if value:
        return value
    path = (env.get(f"{var}_FILE") or "").strip()
    if not path:
        return None
    try:
        text = Path(path).expanduser().read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SecretFileError(
            f"{var}_FILE={path}: cannot read it ({type(exc).__name__}); mount the Secret there or unset {var}_FILE"
        ) from None
    if not text:
        raise SecretFileError(f"{var}_FILE={path} is empty; put {var}'s value in it")
    return text
