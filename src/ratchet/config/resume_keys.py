"""Which config keys a resume from a checkpoint may change (`ratchet resume R key=value`).

A resume carries on from a checkpoint's trainer state and run state. A key the resumed run
would not honour (the checkpoint's optimizer state or run state overrides it), or one that
would make the checkpoint describe another run (another model, other data, another
algorithm), is refused by `Client.resume` rather than stored and silently ignored.
The keys (globs over dotted keys), each with why a resume honours a change, are the
`resume` column of config/key_rules.py; everything else is refused.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any, Mapping

from ratchet.config.loader import ConfigError

from ratchet.config.key_rules import RESUMABLE  # the table of every key's rules


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value; lists (betas, tags) are values, not sections."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def may_change(key: str) -> bool:
    return any(fnmatchcase(key, pattern) for pattern in RESUMABLE)


def changed_keys(stored: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (stored value, new value) for every key whose value differs."""
    old, now = flatten(stored), flatten(new)
    missing = object()
    return {key: (old.get(key), now.get(key)) for key in sorted(old.keys() | now.keys()) if old.get(key, missing) != now.get(key, missing)}


def check_resume_changes(stored: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The changed keys, if a resume may change all of them; else a ConfigError naming each
    refused key and listing the keys that may change."""
    changed = changed_keys(stored, new)
    allowed = ", ".join(RESUMABLE)
    refused = [
        (key, f"a resume cannot change it (stored {old!r}, asked {now!r}); a resume may change: {allowed}. "
              "Start a new run for this change")
        for key, (old, now) in changed.items()
        if not may_change(key)
    ]  # fmt: skip
    if refused:
        raise ConfigError(refused)
    return changed
