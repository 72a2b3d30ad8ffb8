"""The loop modes' ordering through the real training workflow on a real Temporal dev server,
with stand-in activities registered under the workflow's activity names
(tests/faults/standins.py) that record each call and the versions it was given. They answer
at once (or after a set `delay`, to let work overlap), so a change to a loop mode is checked
in seconds, without Ray or torch; the end-to-end runs are in tests/e2e/test_async.py.

One dev server serves the module; each run has its own worker and task queue.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import pytest_asyncio

from ratchet.platform.client import command_for
from ratchet import types as t
from ratchet.workflows import scheduling as sched

from ..faults.standins import StandIns, dev_server, plan, run_on, training_input

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client():
    async with dev_server() as env:
        yield env.client


# -- reading the stand-ins' records ----------------------------------------------------


def loop_calls(standins: StandIns) -> list[tuple[str, Any]]:
    """The calls of the RL steps, in the order they started (no setup, no teardown)."""
    steps = ("generate", "score", "train", "sync_weights", "checkpoint", "record_step")
    return [(n, a) for n, a in standins.calls if n in steps]


def at(standins: StandIns, event: str, name: str, match) -> int:
    """The position in `standins.log` of the first `event` of `name` whose input matches."""
    return next(i for i, (e, n, a) in enumerate(standins.log) if e == event and n == name and match(a))


def ahead_at_each_generate(standins: StandIns) -> list[int]:
    """For each batch when its generation started: batches generated before it whose update
    had not ended yet (the one training included)."""
    out, trained = [], 0
    for event, name, inp in standins.log:
        if event == "end" and name == "train":
            trained += 1
        elif event == "start" and name == "generate":
            out.append(inp.batch_index - trained)
    return out


def generated_for(standins: StandIns, steps: int) -> list[t.RolloutInput]:
    """The generations of the run's batches. fully_async may start one batch past the last
    step (see test_fully_async_generates_no_batch_past_the_last_step); the others leave it
    out of what they check."""
    return [g for g in standins.args("generate") if g.batch_index < steps]


def trained_prompts(standins: StandIns) -> list[int]:
    return sorted(t.batch.prompt_start for t in standins.args("train"))


async def wait_until(predicate, limit_s: float = 30.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), limit_s)


# -- sync and one_step_off -------------------------------------------------------------


async def test_sync_runs_generate_score_train_sync_record_per_step(client):
    standins = StandIns()
    summary = await run_on(client, standins, training_input("sync-order", plan(steps=3)))

    assert summary.steps == 3 and summary.policy_version == 3
    names = [n for n, _ in loop_calls(standins) if n != "record_step"]
    assert names == ["generate", "score", "train", "sync_weights"] * 3
    assert [(g.batch_index, g.policy_version, g.prompt_start) for g in standins.args("generate")] == [(0, 0, 0), (1, 1, 2), (2, 2, 4)]
    assert [(i.policy_version, i.batch.policy_version) for i in standins.args("train")] == [(0, 0), (1, 1), (2, 2)]
    assert [s.policy_version for s in standins.args("sync_weights")] == [1, 2, 3]
    records = standins.args("record_step")
    assert [r.step for r in records] == [0, 1, 2]
    assert [r.metrics["staleness"] for r in records] == [0.0, 0.0, 0.0]
    for step in range(3):
        # Each step's line is written after its sync, and the next step starts after the sync.
        synced = at(standins, "end", "sync_weights", lambda s, v=step + 1: s.policy_version == v)
        assert at(standins, "start", "record_step", lambda r, s=step: r.step == s) > synced
        if step < 2:
            assert at(standins, "start", "generate", lambda g, s=step + 1: g.batch_index == s) > synced


async def test_one_step_off_generates_the_next_batch_while_the_step_trains(client):
    standins = StandIns(delay={"train": 0.2})
    summary = await run_on(client, standins, training_input("one-step-off", plan(mode="one_step_off", steps=4)))

    assert summary.steps == 4 and summary.policy_version == 4
    # Batch n+1 is generated with step n's version (batches 0 and 1 both with version 0).
    assert [(g.batch_index, g.policy_version) for g in standins.args("generate")] == [(0, 0), (1, 0), (2, 1), (3, 2)]
    assert [(i.policy_version, i.batch.policy_version) for i in standins.args("train")] == [(0, 0), (1, 0), (2, 1), (3, 2)]
    assert [r.metrics["staleness"] for r in standins.args("record_step")] == [0.0, 1.0, 1.0, 1.0]
    assert [s.policy_version for s in standins.args("sync_weights")] == [1, 2, 3, 4]
    for n in range(3):
        train_ended = at(standins, "end", "train", lambda i, n=n: i.batch.index == n)
        # ... while step n trains, and the sync waits for both.
        assert at(standins, "start", "generate", lambda g, n=n: g.batch_index == n + 1) < train_ended
        sync = at(standins, "start", "sync_weights", lambda s, n=n: s.policy_version == n + 1)
        assert sync > train_ended and sync > at(standins, "end", "score", lambda s, n=n: s.batch.index == n + 1)
    assert trained_prompts(standins) == [0, 2, 4, 6]


# -- fully_async -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "max_staleness, queue_limit, sync_every, partial",
    # The queue binds; the staleness binds; partial rollouts (the sync overlaps the next
    # update); a sync every second update.
    [(3, 2, 1, False), (2, 4, 1, False), (1, 4, 1, True), (2, 3, 2, False)],
)
async def test_fully_async_respects_staleness_and_queue(client, max_staleness, queue_limit, sync_every, partial):
    steps = 5
    p = plan(
        mode="fully_async",
        steps=steps,
        max_staleness=max_staleness,
        queue_limit=queue_limit,
        sync_every=sync_every,
        partial_rollout=partial,
    )
    standins = StandIns(delay={"train": 0.2})
    run_id = f"fa-{max_staleness}-{queue_limit}-{sync_every}-{int(partial)}"
    summary = await run_on(client, standins, training_input(run_id, p))

    assert summary.steps == steps and summary.policy_version == steps and summary.dropped_samples == 0
    trains = standins.args("train")
    assert [i.batch.index for i in trains] == list(range(steps))  # oldest first, none dropped
    staleness = [i.policy_version - i.batch.policy_version for i in trains]
    assert max(staleness) <= max_staleness, staleness
    assert [r.metrics["staleness"] for r in standins.args("record_step")] == [float(s) for s in staleness]
    ahead = ahead_at_each_generate(standins)
    assert max(ahead) <= queue_limit - 1, ahead
    if sync_every == 1:
        # With the update slow the producer fills the pipeline to the tighter bound: the
        # queue, or the versions a new batch would lag (the training one counts too).
        assert max(ahead) == min(queue_limit - 1, max_staleness), ahead
    assert [s.policy_version for s in standins.args("sync_weights")] == list(range(sync_every, steps + 1, sync_every))
    assert [g.batch_index for g in generated_for(standins, steps)] == list(range(steps))
    assert trained_prompts(standins) == list(range(0, 2 * steps, 2))


@pytest.mark.parametrize("slow", ["train", "generate"])
async def test_deterministic_fully_async_generates_each_batch_with_its_scheduled_version(client, slow):
    """The same versions whichever side is slow: lag = min(2 - 2 + 1, 3 - 1) = 1, batch k by
    max(0, k - 1) rounded down to an even version."""
    steps = 8
    p = plan(mode="fully_async", deterministic=True, steps=steps, max_staleness=2, sync_every=2, queue_limit=3)
    standins = StandIns(delay={slow: 0.1})
    summary = await run_on(client, standins, training_input(f"det-{slow}", p))

    assert summary.steps == steps and summary.dropped_samples == 0
    generated = generated_for(standins, steps)
    assert [(g.batch_index, g.policy_version) for g in generated] == list(enumerate([0, 0, 0, 2, 2, 4, 4, 6]))
    assert [sched.scheduled_version(p, k) for k in range(steps)] == [g.policy_version for g in generated]
    assert all(g.exact_version for g in generated)
    assert [s.policy_version for s in standins.args("sync_weights")] == [2, 4, 6, 8]
    assert [i.policy_version - i.batch.policy_version for i in standins.args("train")] == [0, 1, 2, 1, 2, 1, 2, 1]


async def test_fully_async_generates_no_batch_past_the_last_step(client):
    steps = 4
    standins = StandIns()
    await run_on(client, standins, training_input("fa-last", plan(mode="fully_async", steps=steps)))
    assert [g.batch_index for g in standins.args("generate")] == list(range(steps))


# -- dynamic sampling, checkpoints, resume ---------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
async def test_dynamic_sampling_rolls_out_more_rounds_until_enough_signal(client, mode):
    """Two prompts a step, up to 3 rounds: even batches have one informative group a round
    (done after 2 rounds), odd ones none (the budget of 3 is spent)."""

    def score(i: t.ScoreInput) -> t.ScoreOutput:
        return t.ScoreOutput(reward_mean=0.1 * i.batch.index, reward_std=0.0, seconds=0.0, informative_groups=1 - i.batch.index % 2)

    standins = StandIns(answers={"score": score})
    summary = await run_on(client, standins, training_input(f"dyn-{mode}", plan(mode=mode, steps=4, sampling_rounds=3)))

    assert summary.steps == 4
    generated = [(g.batch_index, g.part, g.prompt_start) for g in generated_for(standins, 4)]
    assert generated == [
        (0, 0, 0), (0, 1, 2),
        (1, 0, 4), (1, 1, 6), (1, 2, 8),
        (2, 0, 10), (2, 1, 12),
        (3, 0, 14), (3, 1, 16), (3, 2, 18),
    ]  # fmt: skip
    # The trainer gets the first round's reference and the number of rounds.
    assert [(i.batch.index, i.batch.prompt_start, i.parts) for i in standins.args("train")] == [
        (0, 0, 2),
        (1, 4, 3),
        (2, 10, 2),
        (3, 14, 3),
    ]
    records = standins.args("record_step")
    assert [r.metrics["rollout_rounds"] for r in records] == [2.0, 3.0, 2.0, 3.0]
    assert [r.metrics["reward_mean"] for r in records] == pytest.approx([0.0, 0.1, 0.2, 0.3])


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
async def test_checkpoint_every_n_steps_accounts_for_every_prompt(client, mode):
    """A checkpoint every 2 steps; its run state holds each prompt range below its frontier
    exactly once: trained, ready, or queued to be redone (a batch still being generated)."""
    steps = 4
    standins = StandIns(delay={"generate": 0.05, "train": 0.05})
    await run_on(client, standins, training_input(f"ckpt-{mode}", plan(mode=mode, steps=steps, checkpoint_every=2)))

    checkpoints = standins.args("checkpoint")
    assert [(c.step, c.policy_version, c.state.next_step) for c in checkpoints] == [(2, 2, 2), (4, 4, 4)]
    records = standins.args("record_step")
    assert [r.step for r in records if "checkpoint_stall_seconds" in r.metrics] == [1, 3]
    trains = standins.args("train")
    for c in checkpoints:
        s = c.state
        done = [i.batch.prompt_start for i in trains[: s.next_step]]
        ready = [r.batch.prompt_start for rounds in s.ready for r in rounds]
        assert sorted(done + ready + s.retry_prompts) == list(range(0, s.next_prompt, 2)), (c.step, done, ready, s)
        # Batches in flight are redone under their own indices: the next is the first of them.
        assert s.next_batch == s.next_step + len(s.ready)
    assert trained_prompts(standins) == list(range(0, 2 * steps, 2))


async def test_resume_from_a_checkpoint_trains_every_prompt_once(client):
    """A deterministic fully_async run checkpoints after step 4 with work in flight; a run
    resumed from that checkpoint trains the rest. Together they train every prompt range
    once, and the resumed run generates nothing with a version older than 4."""
    steps = 6
    p = plan(mode="fully_async", deterministic=True, steps=steps, max_staleness=2, sync_every=2, queue_limit=3, checkpoint_every=4)
    first = StandIns(delay={"generate": 0.05, "train": 0.05})
    await run_on(client, first, training_input("resume-a", p))
    snapshot = first.args("checkpoint")[0].state
    assert snapshot.next_step == 4 and snapshot.policy_version == 4

    second = StandIns()
    summary = await run_on(client, second, training_input("resume-b", p, resume=snapshot, restore=True))

    assert summary.steps == steps and summary.policy_version == steps
    assert [w.restore_version for w in second.args("start_workers")] == [4]
    before = [i.batch.prompt_start for i in first.args("train")[:4]]
    after = [i.batch.prompt_start for i in second.args("train")]
    assert sorted(before + after) == list(range(0, 2 * steps, 2))
    # Batches redone or new: scheduled as before, but on no version older than the floor.
    for g in second.args("generate"):
        assert g.policy_version == max(sched.scheduled_version(p, g.batch_index), 4), g
    assert [i.batch.index for i in second.args("train")] == list(range(4, steps))


def stale_ready(parts: int) -> t.RunState:
    """Carried on (as after a continue-as-new) at step 2 with version 2, holding batch 2,
    generated by version 0 in `parts` rounds of prompt ranges 4, 6, ...: too stale to train
    with max_staleness 1."""
    rounds = [
        t.ScoredBatch(t.BatchRef("stale", 2, "u", 2, 4, 8, 0, part=k, prompt_start=4 + 2 * k), t.ScoreOutput(0.0, 0.0, 0.0))
        for k in range(parts)
    ]
    run = t.RunRef("stale", "/nonexistent/stale")
    return t.RunState(run, next_step=2, next_prompt=4 + 2 * parts, next_batch=3, policy_version=2, rollout_version=2, ready=[rounds])


async def test_fully_async_drops_a_too_stale_batch_and_redoes_its_prompts(client):
    standins = StandIns()
    p = plan(mode="fully_async", steps=3, max_staleness=1)
    summary = await run_on(client, standins, training_input("stale-1", p, resume=stale_ready(parts=1)))

    assert summary.steps == 3 and summary.dropped_samples == 4
    assert [(g.batch_index, g.prompt_start, g.policy_version) for g in generated_for(standins, 4)] == [(3, 4, 2)]
    assert [(i.batch.index, i.batch.prompt_start) for i in standins.args("train")] == [(3, 4)]
    assert [r.metrics["dropped_samples"] for r in standins.args("record_step")] == [4.0]


async def test_fully_async_redoes_every_round_of_a_dropped_batch(client):
    def score(i: t.ScoreInput) -> t.ScoreOutput:
        return t.ScoreOutput(0.0, 0.0, 0.0, informative_groups=0)  # always both rounds

    standins = StandIns(answers={"score": score})
    p = plan(mode="fully_async", steps=3, max_staleness=1, sampling_rounds=2)
    await run_on(client, standins, training_input("stale-2", p, resume=stale_ready(parts=2)))

    assert sorted(g.prompt_start for g in generated_for(standins, 4)) == [4, 6]


# -- pause, resume, stop ---------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
async def test_pause_and_stop_at_a_step_boundary(client, mode):
    standins = StandIns()
    held: dict[str, int] = {}

    async def control(handle):
        await wait_until(lambda: standins.count("train") >= 2)
        await handle.signal("pause", command_for(handle.id))
        await wait_until_paused(handle)
        await asyncio.sleep(0.1)  # activities the workflow started just before reach the stand-ins
        progress = await handle.query("progress", result_type=t.Progress)
        held.update(step=progress.step, train=standins.count("train"), generate=standins.count("generate"))
        await asyncio.sleep(0.3)
        progress = await handle.query("progress", result_type=t.Progress)
        assert progress.paused and progress.phase == "paused" and progress.step == held["step"]
        # Nothing new starts while paused: no update, and no generation in fully_async.
        assert standins.count("train") == held["train"] and standins.count("generate") == held["generate"]
        await handle.signal("resume", command_for(handle.id))
        await wait_until(lambda: standins.count("train") >= held["train"] + 2)
        await handle.signal("stop", command_for(handle.id))

    summary = await run_on(client, standins, training_input(f"ctl-{mode}", plan(mode=mode, steps=10_000)), control)

    assert summary.stopped and held["step"] + 2 <= summary.steps < 10_000
    # Every update started is a finished, recorded step: the stop landed between steps.
    assert standins.count("train") == summary.steps == summary.policy_version
    assert [r.step for r in standins.args("record_step")] == list(range(summary.steps))
    assert standins.count("finish_run") == 1 and summary.final_policy_uri == "final"


async def wait_until_paused(handle) -> None:
    for _ in range(3000):
        if (await handle.query("progress", result_type=t.Progress)).phase == "paused":
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the run did not hold at a step boundary")
