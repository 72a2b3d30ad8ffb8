"""What a run that rode out faults must show, read from its run folder in the object store
(a local folder or S3): every step recorded once, every prompt trained on once, and
(deterministic mode) final weights equal to an undisturbed run's bit for bit."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file

from ratchet.config.schema import RunConfig
from ratchet.data.order import data_order_seed
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout
from ratchet.workers.batch import RolloutBatch
from ratchet.workers.batch_seeds import prompt_indices


def _store(run: str | Path) -> ObjectStore:
    return ObjectStore(str(run))


def metric_lines(run: str | Path) -> list[dict]:
    store = _store(run)
    if not store.exists(RunLayout.METRICS):
        return []
    return [json.loads(x) for x in store.get_bytes(RunLayout.METRICS).decode().splitlines() if x.strip()]


def steps_recorded(run: str | Path) -> int:
    """Lines in the run's metrics.jsonl (0 before the first). A failed read (the S3 server
    busy while a node dies) is tried again: taken for 0, it made a fault injector see its
    fault's next step at once. One GET and no JSON: fault injectors call this many times a
    second, and on S3 each request costs the test process the moto server's work too."""
    for attempt in range(10):
        try:
            return sum(1 for line in _store(run).get_bytes(RunLayout.METRICS).splitlines() if line.strip())
        except FileNotFoundError:
            return 0
        except OSError:
            if attempt == 9:
                raise
            time.sleep(0.2)
    raise AssertionError("unreachable")


def trained_prompts(run: str | Path, steps: int) -> list[int]:
    store = _store(run)
    batches = BatchStore(store)
    out = []
    for v in range(steps):
        entry = store.get_json(RunLayout.train_log(v))
        for part in range(entry["parts"]):
            name = "rollout" if part == 0 else f"rollout-{part}"
            out += torch.unique(RolloutBatch.load(batches, entry["batch"], name).prompt_index).tolist()
    return sorted(out)


def first_prompts(run: str | Path, count: int) -> list[int]:
    """The dataset rows at the run's first `count` prompt positions (data.shuffle: a seeded order)."""
    cfg = RunConfig.model_validate(_store(run).get_json(RunLayout.CONFIG))
    return prompt_indices(0, count, pq.read_metadata(cfg.data.train_files).num_rows, data_order_seed(cfg))


def final_weights(summary) -> dict[str, torch.Tensor]:
    store = ObjectStore(summary.final_policy_uri)
    with tempfile.TemporaryDirectory(prefix="ratchet-test-weights-") as tmp:
        path = Path(tmp) / "model.safetensors"
        store.get_file("model.safetensors", path)
        return load_file(str(path))


def check_exactly_once(summary, run: str | Path, steps: int, prompts_per_step: int) -> None:
    assert summary.steps == steps and summary.policy_version == steps
    assert [m["step"] for m in metric_lines(run)] == list(range(steps)), "every step's metrics exist exactly once"
    assert trained_prompts(run, steps) == sorted(first_prompts(run, steps * prompts_per_step)), "every prompt trained on exactly once"


def assert_same_weights(clean, summary, fired: list[str]) -> None:
    a, b = final_weights(clean), final_weights(summary)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), f"weights differ after faults {fired}"


def batch_versions(run: str | Path) -> list[int]:
    """The policy version that generated each step's batch, from the recorded metrics."""
    return [int(m["batch_policy_version"]) for m in metric_lines(run)]


def is_actor_process(title: str, actor_class: str) -> bool:
    """Whether a process title is an `actor_class` actor's: Ray titles it
    `ray::<Class>.<method>` while it runs a method and `ray::<name>:<Class>` when idle."""
    head = title.split(" ", 1)[0]
    return head.startswith(f"ray::{actor_class}") or (head.startswith("ray::") and head.endswith(f":{actor_class}"))
