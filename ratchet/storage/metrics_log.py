"""`metrics.jsonl` of a run: one JSON line per step, exactly once.

A retried activity may write a step's line again; the log is keyed by step, so the retry
replaces the line instead of adding a duplicate. The file is rewritten atomically: a
reader sees the old or the new version, never half a line.
"""

from __future__ import annotations

import json

from .keys import check_key
from .layout import RunLayout
from .object_store import ObjectStore

KEY = RunLayout.METRICS


class MetricsLog:
    def __init__(self, store: ObjectStore, key: str = KEY):
        self.store, self.key = store, check_key(key, allow_empty=False, what="metrics log key")

    def read(self) -> list[dict]:
        if not self.store.exists(self.key):
            return []
        return [json.loads(line) for line in self.store.get_bytes(self.key).decode().splitlines() if line.strip()]

    def write(self, step: int, record: dict) -> None:
        by_step = {r["step"]: r for r in self.read()}
        by_step[step] = {"step": step, **record}
        lines = [json.dumps(by_step[s], sort_keys=True) for s in sorted(by_step)]
        self.store.put_bytes(self.key, ("\n".join(lines) + "\n").encode())
