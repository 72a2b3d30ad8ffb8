"""Names that become storage keys and Temporal ids: run ids, sweep ids, checkpoint names.

One pattern for all of them, checked at every entry point (client, CLI, activities,
storage), so that a `..` or a `/` never reaches a path or an object key: a run id is
joined onto `storage.root`, and `../../etc` would read or overwrite files outside it.
Standard library only: workflow code and the storage layer import it.
"""

from __future__ import annotations

import re

# Letters, digits, '_', '.', '-'; starts with a letter or digit (so never '.' or '..'),
# at most 128 characters (an S3 key segment, a Temporal workflow id and a Ray actor name
# all take that comfortably). Matched whole with `fullmatch`: a `$` anchor also matches
# before a final newline, and `run1\n` would pass as an id (an object key with a newline,
# a Temporal id unlike the run's folder).
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
ID_RULE = "1-128 characters of letters, digits, '_', '.', '-', starting with a letter or digit, no '..'"


class InvalidId(ValueError):
    """A run id, sweep id or checkpoint name that could escape its folder."""


def is_valid_id(value: object) -> bool:
    return isinstance(value, str) and ID_PATTERN.fullmatch(value) is not None and ".." not in value


def check_id(value: object, what: str = "run id") -> str:
    """`value` if it is a safe id; else InvalidId naming `what` and the rule."""
    if not is_valid_id(value):
        raise InvalidId(f"invalid {what} {value!r}: expected {ID_RULE}")
    return value  # type: ignore[return-value]
