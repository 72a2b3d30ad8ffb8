"""`metrics.jsonl` of a run: one JSON line per step, exactly once, stamped with the wall-clock
time it was written.

A retried activity may write a step's line again; the log is keyed by step, so the retry
replaces the line instead of adding a duplicate (and its time is the retry's). The file is
rewritten atomically: a reader sees the old or the new version, never half a line.

Every line carries `time_unix` (seconds since the epoch, UTC, to the millisecond) and
`time_utc` (the same instant in ISO 8601, e.g. "2026-12-01T20:17:18.123+00:00"), so a
step's duration and the time from submit to the first step can be read off the file, and
lines line up with other logs. A record that brings its own values for them keeps them.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Callable

from .keys import check_key
from .layout import RunLayout
from .object_store import ObjectStore

KEY = RunLayout.METRICS


def wall_clock_stamp(now: float) -> dict[str, float | str]:
    """The timestamp fields of a line written at unix time `now`."""
    ms = round(now * 1000)  # both fields from the same millisecond: isoformat would truncate, round() rounds
    utc = datetime.fromtimestamp(ms // 1000, timezone.utc).replace(microsecond=ms % 1000 * 1000)
    return {"time_unix": ms / 1000, "time_utc": utc.isoformat(timespec="milliseconds")}


class MetricsLog:
    def __init__(self, store: ObjectStore, key: str = KEY, clock: Callable[[], float] = time.time):
        self.store, self.key = store, check_key(key, allow_empty=False, what="metrics log key")
        self.clock = clock

    def read(self) -> list[dict]:
        if not self.store.exists(self.key):
            return []
        return [json.loads(line) for line in self.store.get_bytes(self.key).decode().splitlines() if line.strip()]

    def write(self, step: int, record: dict) -> None:
        line = {"step": step, **wall_clock_stamp(self.clock()), **record}
        old = self.store.get_bytes(self.key) if self.store.exists(self.key) else b""
        last = old.rstrip(b"\n").rpartition(b"\n")[2]
        if not last.strip() or json.loads(last)["step"] < step:
            # The usual case, a step after every line there: appended without parsing the
            # lines before (a long run's file would otherwise be re-read and re-encoded whole
            # at every step).
            head = old if not old or old.endswith(b"\n") else old + b"\n"
            self.store.put_bytes(self.key, head + (json.dumps(line, sort_keys=True) + "\n").encode())
            return
        by_step = {r["step"]: r for r in (json.loads(x) for x in old.decode().splitlines() if x.strip())}
        by_step[step] = line
        lines = [json.dumps(by_step[s], sort_keys=True) for s in sorted(by_step)]
        self.store.put_bytes(self.key, ("\n".join(lines) + "\n").encode())
