"""The activity of a supervised pipeline stage: one chunk of SFT or DPO steps, run as a Ray
task (workers/supervised.py) while the activity heartbeats.

The task is not retried by Ray (max_retries=0): a process that dies fails the attempt, and
Temporal's retry runs the chunk again from the same checkpoint, so the stage's history
shows every attempt. The stage's config is stored once as `stage.json` in its run folder
(config.json stays an RL run's) for whoever reads the folder later.
"""

from __future__ import annotations

import ray
from temporalio import activity

from ratchet.ids import check_id
from ratchet.pipeline_types import ChunkInput, ChunkOutput
from ratchet.storage.object_store import ObjectStore
from ratchet.workers.supervised import STAGE_CONFIG, ChunkRequest, run_chunk

from .ray_calls import wait
from .translate import temporal_errors

_task = None


def _remote(cpus: float):
    global _task
    if _task is None:
        _task = ray.remote(run_chunk)
    # The task's name is its process title while it runs (`ray::supervised_chunk`).
    return _task.options(name="supervised_chunk", max_retries=0, num_cpus=cpus)


@activity.defn(name="supervised_chunk")
@temporal_errors
def supervised_chunk(inp: ChunkInput) -> ChunkOutput:
    run = ObjectStore(inp.storage_root).child(check_id(inp.run_id))
    if inp.start == 0:
        run.put_json(STAGE_CONFIG, {"stage_index": inp.stage_index, "model_uri": inp.model_uri, "seed": inp.seed, "stage": inp.stage})
    req = ChunkRequest(
        run_uri=run.url, stage=inp.stage, stage_index=inp.stage_index, model_uri=inp.model_uri, start=inp.start, end=inp.end,
        seed=inp.seed, torch_threads=inp.torch_threads,
    )  # fmt: skip
    out = wait(_remote(inp.cpus).remote(req), details=f"steps {inp.start}-{inp.end - 1}")
    return ChunkOutput(
        run_uri=run.url, start=out.start, end=out.end, checkpoint=out.checkpoint, train=dict(out.train),
        eval_before=dict(out.eval_before), eval_after=dict(out.eval_after), model_uri=out.model_uri, seconds=out.seconds,
    )  # fmt: skip


SUPERVISED_ACTIVITIES = [supervised_chunk]
