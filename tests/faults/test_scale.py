"""The controller's scaling properties (benchmarks/scale.py measures them at 64 replicas x
16 ranks; here they are checked, cheaply, so a change that breaks one fails CI):

- a step adds the same Temporal history (events, and bytes within a few per cent) at
  1 replica x 1 rank as at 64 x 16: the fan-out to replicas and ranks stays inside one
  activity (workers/actors/rollout_pool.py), never one activity per replica or rank;
- continue-as-new, when Temporal suggests it, keeps every segment of a run's history
  under the threshold plus a step or two, and carries the same state size each time;
- the run state after 100,000 steps is a few KB, and the input a continue-as-new carries
  does not grow with replicas, ranks or steps.

The real TrainingWorkflow on a real Temporal dev server (told to suggest continue-as-new
early), with the benchmark's activities that only sleep. No wall-clock assertions.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from temporalio.testing import WorkflowEnvironment

from ratchet.workflows import search_attributes as sa

from ..benchmark_scripts import load_benchmark

SUGGEST_EVENTS = 60  # the dev server suggests continue-as-new from this history length
CHAIN_STEPS = 12
PHASES = ("generate", "score", "train", "sync_weights")
SETUP = {"prepare_run": 1, "admit_run": 1, "warmup": 1, "start_workers": 1, "finish_run": 1}


scale = load_benchmark("scale", "scale_benchmark")


def test_run_state_after_100000_steps_is_small_and_does_not_grow_with_scale():
    big, small = scale.Workload(64, 16), scale.Workload(1, 1)
    at_100k = scale.state_at(100_000, big)
    assert at_100k.reward_count == 100_000 and len(at_100k.ready) == 3
    state_bytes = scale.payload_bytes(at_100k)
    assert state_bytes < 8 * 1024, state_bytes
    # Ten times fewer steps: the same size but for one more digit in each step number it
    # holds (32 evaluations, 3 batches, counters), nothing per step.
    assert state_bytes - scale.payload_bytes(scale.state_at(10_000, big)) < 128
    carried = scale.payload_bytes(scale.carried_input(at_100k, big))
    carried_1x1 = scale.payload_bytes(scale.carried_input(scale.state_at(100_000, small), small))
    assert carried < 16 * 1024, carried
    # 64 replicas and 16 ranks cost the config's digits, nothing per replica or rank.
    assert 0 <= carried - carried_1x1 < 64, (carried, carried_1x1)


@pytest.mark.integration
def test_history_per_step_is_independent_of_replicas_and_ranks_and_segments_stay_bounded():
    async def go():
        env = await WorkflowEnvironment.start_local(
            dev_server_existing_path=str(scale.TEMPORAL), ui=False, search_attributes=list(sa.ALL_KEYS),
            dev_server_extra_args=["--dynamic-config-value", f"limit.historyCount.suggestContinueAsNew={SUGGEST_EVENTS}"],
        )  # fmt: skip
        out = {}
        try:
            for mode in scale.MODES:
                # Short sleeps of the same lengths at both scales (a replica's or rank's share
                # shrinks as their number grows), so the two schedules match.
                for name, w in (("1x1", scale.Workload(1, 1, step_seconds=0.1)), ("64x16", scale.Workload(64, 16, step_seconds=0.1))):
                    out[mode, name] = await scale.run_mode(env.client, mode, w, 4, run_id=f"{mode}-{name}", search_attributes=True)
            # Continue-as-new ends sync's loop after a step, and fully_async's after its
            # producer finished the batch in flight: a longer run of each, without sleeps.
            for mode in ("sync", "fully_async"):
                chain = replace(scale.Workload(64, 16), step_seconds=0.0)
                out[mode, "chain"] = await scale.run_mode(
                    env.client, mode, chain, CHAIN_STEPS, run_id=f"{mode}-chain", search_attributes=True
                )
        finally:
            await env.shutdown()
        return out

    out = asyncio.run(go())
    # One activity per phase (sync: one for the whole step), whatever the replicas and ranks.
    per_step = {"sync": {"step": 1}, "one_step_off": dict.fromkeys(PHASES, 1), "fully_async": dict.fromkeys(PHASES, 1)}
    for mode in scale.MODES:
        small, big = out[mode, "1x1"], out[mode, "64x16"]
        expected = {name: 4 * n for name, n in per_step[mode].items()} | SETUP
        assert big.activities() == small.activities() == expected, (mode, big.activities(), small.activities())
        # Their inputs and outputs: the same size but for a few digits.
        big_bytes, small_bytes = (sum(s.activity_bytes for s in r.segments) for r in (big, small))
        assert abs(big_bytes / small_bytes - 1) < 0.05, (mode, big_bytes, small_bytes)
        for r in (small, big):
            # Events a step: its activities, the workflow tasks between them, a metrics line and
            # a search-attribute upsert. How many workflow tasks depends on which completions
            # coincide: on a loaded machine each of the four activities' completions can get a
            # task of its own (3 events each), so the bound for the async modes is 4 x 3 for
            # the activities, 4 x 3 for their tasks, and a few for the record and the upsert.
            assert r.per_step("steady_events") <= (10 if mode == "sync" else 36), (mode, r.segments)

    for mode in ("sync", "fully_async"):
        segments = out[mode, "chain"].segments
        assert len(segments) >= 2 and sum(s.steps for s in segments) == CHAIN_STEPS, (mode, segments)
        per_step = max(x for s in segments for x in s.steady_events)
        for seg in segments:
            # Suggested after a step crossed the threshold; fully_async also lets the batch
            # being generated finish before it continues as new.
            # (+1: sync mode's last line before continue-as-new, which no next step carries,
            # is written by the record_step local activity: its marker.)
            assert seg.events <= SUGGEST_EVENTS + 2 * per_step + 1, (mode, seg)
        carried = [s.carried_bytes for s in segments if s.carried_bytes]
        assert len(carried) == len(segments) - 1 and max(carried) - min(carried) < 1024, (mode, carried)
