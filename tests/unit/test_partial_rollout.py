"""Partial rollouts: weights that change between two decode steps of a generation in flight.

In-process (no Ray): the HF engine's swap point, and the rollout worker's hand-over of
weights from a second thread to the generating one (what a threaded Ray actor does)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ratchet.config.schema import RunConfig
from ratchet.storage.batch_store import BatchStore
from ratchet.storage.object_store import ObjectStore
from ratchet.tasks.generate import write_task_parquet
from ratchet.workers.batch import RolloutBatch
from ratchet.workers.engines.hf import HFEngine
from ratchet.workers.engines.base import SamplingParams
from ratchet.workers.rollout import RolloutWorker

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def copy_data(tmp_path_factory) -> Path:
    return write_task_parquet(tmp_path_factory.mktemp("data") / "copy.parquet", "copy", 32, seed=0, min_len=4, max_len=4)


def other_weights(engine: HFEngine, seed: int) -> dict[str, np.ndarray]:
    """The engine's weights plus noise: a different policy with the same names."""
    g = torch.Generator().manual_seed(seed)
    return {k: (v + 0.5 * torch.randn(v.shape, generator=g)).numpy() for k, v in engine.model.state_dict().items()}


def test_engine_swaps_weights_between_decode_steps(tiny_model):
    engine = HFEngine(str(tiny_model))
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new = other_weights(engine, 0)
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    params = SamplingParams(n=3, max_new_tokens=10, seed=4)
    plain = engine.generate(prompts, params, version=2)
    calls = []

    def swap():
        calls.append(1)
        if len(calls) == 4:  # after the 4th token's logits: tokens 0-3 old, 4.. new
            engine.load_weights(new.items())
            return 3
        return None

    swapped = engine.generate(prompts, params, version=2, weight_swap=swap)
    long = [(p, s) for gp, gs in zip(plain, swapped) for p, s in zip(gp, gs) if len(s.token_ids) > 6]
    assert len(long) >= 3  # a random model rarely stops early
    for p, s in long:
        assert p.versions == [2] * len(p.token_ids)
        assert s.versions == [2] * 4 + [3] * (len(s.token_ids) - 4)
        # Same RNG stream and the same weights up to the swap: the same first tokens.
        assert s.token_ids[:4] == p.token_ids[:4] and s.logprobs[:4] == p.logprobs[:4]
    # After the swap the new weights sample: the continuations differ.
    assert sum(p.token_ids[4:] != s.token_ids[4:] for p, s in long) >= len(long) // 2
    engine.load_weights((k, v.numpy()) for k, v in original.items())


def make_cfg(model: Path, data: Path, run: Path, **loop) -> RunConfig:
    return RunConfig.model_validate(
        {
            "seed": 0,
            "model": {"path": str(model)},
            "data": {"train_files": str(data)},
            "rollout": {"n": 4, "max_response_length": 12},
            "loop": {"mode": "fully_async", "steps": 4, **loop},
            "storage": {"root": str(run)},
        }
    )


def token_versions(run_dir, step: int) -> set[int]:
    """The policy versions that produced the response tokens of a stored batch."""
    batch = RolloutBatch.load(BatchStore(ObjectStore(str(run_dir))), step)
    return set(batch.policy_version[batch.response_mask > 0].tolist())


def test_rollout_worker_takes_a_sync_inside_a_generation(tiny_model, copy_data, tmp_path):
    """A `load_weights` from another thread lands at the next decode step; the batch then
    holds tokens of both versions, oldest first, and the call returns once they serve."""
    worker = RolloutWorker(make_cfg(tiny_model, copy_data, tmp_path), str(tiny_model), str(tmp_path))
    assert worker.slot.partial
    new = other_weights(worker.engine, 1)
    swap, calls, done = worker.slot._swap, [], {}

    def sync():
        done["bytes"] = worker.load_weights(new, 1)
        done["version"] = worker.version

    def swap_with_sync_arriving():
        calls.append(1)
        if len(calls) == 3:  # the sync arrives while tokens 0-2 are out: it must wait for the hook
            t = threading.Thread(target=sync)
            t.start()
            deadline = time.monotonic() + 10
            while worker.slot.pending is None and time.monotonic() < deadline:
                time.sleep(0.001)
            assert worker.slot.pending is not None and "bytes" not in done
        return swap()

    worker.slot._swap = swap_with_sync_arriving
    out = worker.generate(batch_index=0, prompt_start=0, prompt_count=2, policy_version=0)
    assert out.policy_version == 0 and token_versions(tmp_path, 0) == {0, 1}
    assert done == {"bytes": sum(v.nbytes for v in new.values()), "version": 1}
    batch = RolloutBatch.load(BatchStore(ObjectStore(str(tmp_path))), 0)
    for row in range(len(batch)):
        k = int(batch.response_mask[row].sum())
        assert batch.policy_version[row, :k].tolist() == [0] * min(k, 3) + [1] * max(0, k - 3)
    # The next generation starts on the new weights, and asking for the older version is
    # allowed (the workflow may not have heard of the sync yet); asking ahead is not.
    out = worker.generate(batch_index=1, prompt_start=2, prompt_count=2, policy_version=0)
    assert out.policy_version == 1 and token_versions(tmp_path, 1) == {1}
    with pytest.raises(RuntimeError, match="holds policy v1, asked for v2"):
        worker.generate(batch_index=2, prompt_start=4, prompt_count=2, policy_version=2)


def test_without_partial_rollouts_a_sync_waits_for_the_generation(tiny_model, copy_data, tmp_path):
    worker = RolloutWorker(make_cfg(tiny_model, copy_data, tmp_path, mode="sync"), str(tiny_model), str(tmp_path))
    assert not worker.slot.partial
    new, started, done = other_weights(worker.engine, 2), threading.Event(), {}
    load = worker.engine.load_weights

    def slow_generate(*args, **kwargs):
        started.set()
        time.sleep(0.3)  # the sync must not land in here
        assert kwargs.get("weight_swap") is None and "version" not in done
        return generate(*args, **kwargs)

    generate = worker.engine.generate
    worker.engine.generate = slow_generate
    t = threading.Thread(target=lambda: done.setdefault("out", worker.generate(0, 0, 2, 0)))
    t.start()
    started.wait(10)
    worker.engine.load_weights = lambda w: (load(w), done.setdefault("version", 1))
    worker.load_weights(new, 1)
    t.join(10)
    out = done["out"]
    assert out.policy_version == 0 and token_versions(tmp_path, 0) == {0} and worker.version == 1
    with pytest.raises(RuntimeError, match="holds policy v1, asked for v2"):
        worker.generate(1, 2, 2, 2)


def test_deterministic_worker_logs_what_it_serves_and_serves_it_again(tiny_model, copy_data, tmp_path):
    """A deterministic run turns partial rollouts off, asks for exact versions, and keeps
    the versions it was sent (the last max_staleness + sync_every + 1) to serve them again:
    a recreated worker generates a batch exactly as the lost one would have."""
    cfg = make_cfg(tiny_model, copy_data, tmp_path, max_staleness=1, queue_limit=2).model_copy(update={"deterministic": True})
    assert not cfg.uses_partial_rollouts
    worker = RolloutWorker(cfg, str(tiny_model), str(tmp_path))
    assert not worker.slot.partial
    original = worker.generate(0, 0, 2, 0, exact=True)
    first = RolloutBatch.load(BatchStore(ObjectStore(str(tmp_path))), 0)
    versions = {v: other_weights(worker.engine, v) for v in range(1, 6)}
    served = {}
    for v, w in versions.items():
        worker.load_weights(w, v)
        served[v] = {k: t.clone() for k, t in worker.engine.model.state_dict().items()}
    logged = sorted(ObjectStore(str(tmp_path)).list("policy_log"))
    assert logged == [f"policy_log/v{v:08d}.safetensors" for v in (3, 4, 5)]  # 5 - 1 - 1 and newer
    with pytest.raises(RuntimeError, match="holds policy v5, asked for v4"):
        worker.generate(1, 2, 2, 4, exact=True)  # older than held: fine without `exact`, not with it
    assert worker.serve_logged(4) and worker.version == 4
    state = worker.engine.model.state_dict()
    assert all(torch.equal(state[k], served[4][k]) for k in state)
    assert not worker.serve_logged(2)  # pruned
    # v0 is the initial policy's files: the same batch again, token for token.
    assert worker.serve_logged(0) and worker.version == 0
    again = worker.generate(0, 0, 2, 0, exact=True)
    assert again.num_response_tokens == original.num_response_tokens
    second = RolloutBatch.load(BatchStore(ObjectStore(str(tmp_path))), 0)
    assert torch.equal(first.response_ids, second.response_ids) and torch.equal(first.rollout_logprobs, second.rollout_logprobs)
