"""`metrics.jsonl` of a run: one JSON line per step, exactly once, stamped with the wall-clock
time it was written.

A retried activity may write a step's line again; the log is keyed by step, so the retry
replaces the line instead of adding a duplicate (and its time is the retry's). The file is
rewritten atomically: a reader sees the old or the new version, never half a line.

Every line carries `time_unix` (seconds since the epoch, UTC, to the millisecond) and
`time_utc` (the same instant in ISO 8601, e.g. "2026-12-01T20:17:18.123+00:00"), so a
step's duration and the time from submit to the first step can be read off the file, and
lines line up with other logs. A record that brings its own values for them keeps them.

A line that does not read (torn by a writer that died, or edited by hand: not a JSON
object with an integer `step`) is skipped by every reader with a warning naming the file
and the line, and kept in the file by writers: one bad line never hides the others.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

from .keys import check_key
from .layout import RunLayout
from .object_store import ObjectStore

KEY = RunLayout.METRICS

log = logging.getLogger(__name__)


def wall_clock_stamp(now: float) -> dict[str, float | str]:
    """The timestamp fields of a line written at unix time `now`."""
    ms = round(now * 1000)  # both fields from the same millisecond: isoformat would truncate, round() rounds
    utc = datetime.fromtimestamp(ms // 1000, timezone.utc).replace(microsecond=ms % 1000 * 1000)
    return {"time_unix": ms / 1000, "time_utc": utc.isoformat(timespec="milliseconds")}


@dataclass(frozen=True)
class MetricsRead:
    """What `MetricsLog.read_checked` found: the readable lines, and one text per line
    that was skipped (torn by a writer that died mid-write, or edited by hand)."""

    records: list[dict]
    skipped: list[str]


def _record(line: bytes) -> dict | None:
    """A metrics line as a record: a JSON object with an integer `step`; else None."""
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict):
        return None
    step = record.get("step")
    return record if isinstance(step, int) and not isinstance(step, bool) else None


class MetricsLog:
    def __init__(self, store: ObjectStore, key: str = KEY, clock: Callable[[], float] = time.time):
        self.store, self.key = store, check_key(key, allow_empty=False, what="metrics log key")
        self.clock = clock

    def read(self) -> list[dict]:
        """The readable lines; a torn or malformed line is skipped with a warning naming
        the file and the line (one bad line must not hide the others from a reader)."""
        return self.read_checked().records

    def read_checked(self) -> MetricsRead:
        if not self.store.exists(self.key):
            return MetricsRead([], [])
        records, skipped = [], []
        for number, line in enumerate(self.store.get_bytes(self.key).splitlines(), 1):
            if not line.strip():
                continue
            record = _record(line)
            if record is None:
                skipped.append(f"line {number}: {line[:60]!r}")
                continue
            records.append(record)
        if skipped:
            log.warning(
                "%s: skipped %d unreadable lines (not a JSON object with an integer 'step'): %s",
                self.store.uri(self.key), len(skipped), "; ".join(skipped[:3]),
            )  # fmt: skip
        return MetricsRead(records, skipped)

    def write(self, step: int, record: dict) -> None:
        line = {"step": step, **wall_clock_stamp(self.clock()), **record}
        old = self.store.get_bytes(self.key) if self.store.exists(self.key) else b""
        last = _record(old.rstrip(b"\n").rpartition(b"\n")[2]) if old.strip() else None
        if not old.strip() or (last is not None and last["step"] < step):
            # The usual case, a step after every line there: appended without parsing the
            # lines before (a long run's file would otherwise be re-read and re-encoded whole
            # at every step).
            head = old if not old or old.endswith(b"\n") else old + b"\n"
            self.store.put_bytes(self.key, head + (json.dumps(line, sort_keys=True) + "\n").encode())
            return
        # A retried step (or a last line that does not read): the lines by step, this one
        # replacing its step's. Unreadable lines are kept as they were, first: the file
        # loses nothing it held, and readers skip them.
        by_step, kept = {}, []
        for raw in old.splitlines():
            if raw.strip():
                parsed = _record(raw)
                if parsed is None:
                    kept.append(raw.decode(errors="replace"))
                else:
                    by_step[parsed["step"]] = parsed
        by_step[step] = line
        lines = kept + [json.dumps(by_step[s], sort_keys=True) for s in sorted(by_step)]
        self.store.put_bytes(self.key, ("\n".join(lines) + "\n").encode())
