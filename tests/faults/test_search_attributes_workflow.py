"""The training workflow and the Temporal UI: histories recorded before the search
attributes and activity summaries still replay, a server without ratchet's search
attributes still runs every run, and one with them sees step, reward and status upserted.

The workflow is the real one on a real Temporal dev server; the activities are stand-ins
(tests/faults/standins.py): what is tested is what the workflow sends to Temporal.
"""

from __future__ import annotations

import asyncio
import gzip
import sys
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError, WorkflowHistory
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from ratchet.types import RunLineage
from ratchet.workflows import search_attributes as sa
from ratchet.workflows.training import TrainingWorkflow

from .standins import StandIns, dev_server, plan, run_on, training_input, worker_for

HISTORIES = Path(__file__).parent / "histories"
TEMPORAL = Path(sys.executable).parent / "temporal"
CONFIG = {
    "model": {"path": "/models/tiny-llama"},
    "algorithm": {"adv_estimator": "grpo"},
    "loop": {"mode": "sync", "steps": 3},
    "tracking": {"experiment": "sa-test", "name": "r"},
}


@pytest.mark.parametrize("name", ["sync", "onestep"])
def test_histories_from_before_the_search_attributes_replay(name):
    """Recorded with the workflow as it was before summaries and upserts (3 steps, a
    checkpoint and an evaluation at step 2, a final evaluation): today's code replays them."""
    raw = gzip.decompress((HISTORIES / f"pre-search-attributes-{name}.json.gz").read_bytes()).decode()
    history = WorkflowHistory.from_json(f"old-{name}", raw)
    result = asyncio.run(Replayer(workflows=[TrainingWorkflow]).replay_workflow(history, raise_on_replay_failure=False))
    assert result.replay_failure is None, result.replay_failure


def test_a_server_without_the_attributes_runs_the_run():
    """The stand-in dev server has none of ratchet's attributes: a run told so (the default)
    completes; one told wrongly that they exist would be stuck, which is why the client checks."""

    async def go():
        async with dev_server() as env:
            from ratchet.platform.search import registered_attributes

            assert sa.missing_from(await registered_attributes(env.client)) == [k.name for k in sa.ALL_KEYS]
            summary = await run_on(env.client, StandIns(), training_input("plain", plan(steps=2)))
            desc = await env.client.get_workflow_handle("plain").describe()
            return summary, desc

    summary, desc = asyncio.run(go())
    assert summary.steps == 2 and summary.policy_version == 2
    assert not any(p.key.name.startswith("ratchet_") for p in desc.typed_search_attributes)


@pytest.mark.slow
def test_attributes_summaries_and_details_as_the_run_goes():
    """On a server with the attributes: step, reward, eval reward and status are upserted
    once per step (not per activity), every activity has a summary, the current details
    name the step and reward, and the upserts replay."""

    async def go():
        env = await WorkflowEnvironment.start_local(dev_server_existing_path=str(TEMPORAL), ui=False, search_attributes=list(sa.ALL_KEYS))
        try:
            client = env.client
            cfg = {**CONFIG, "loop": {"mode": "one_step_off", "steps": 4}}
            lineage = RunLineage(sweep_id="sw1", trial_index=3)
            inp = training_input("shown", plan(steps=4, mode="one_step_off", eval_every=2, evaluate=True), search_attributes=True)
            inp.config = cfg
            async with worker_for(client, StandIns(), "sa-shown"):
                handle = await client.start_workflow(
                    "TrainingWorkflow", inp, id="shown", task_queue="sa-shown",
                    search_attributes=sa.initial_attributes(cfg, lineage),
                    static_summary=sa.static_summary("shown", cfg, lineage), static_details=sa.static_details("shown", cfg, lineage),
                )  # fmt: skip
                await asyncio.wait_for(handle.result(), 60)
                details = await handle.query("__temporal_workflow_metadata")
                desc = await handle.describe()
                desc.summary_text, desc.details_text = await desc.static_summary(), await desc.static_details()
                history = await handle.fetch_history()
                found = [w.id async for w in client.list_workflows('ratchet_experiment = "sa-test" AND ratchet_step >= 4')]
            # A run that fails says so in its status (and the step it got to).
            boom = StandIns(fail={"train": ApplicationError("boom", non_retryable=True)})
            broken = training_input("broken", plan(steps=3), search_attributes=True)
            async with worker_for(client, boom, "sa-broken"):
                h = await client.start_workflow("TrainingWorkflow", broken, id="broken", task_queue="sa-broken")
                with pytest.raises(WorkflowFailureError):
                    await asyncio.wait_for(h.result(), 60)
                desc.failed = {
                    p.key.name: p.value for p in (await h.describe()).typed_search_attributes if p.key.name.startswith("ratchet_")
                }
            return desc, details, history, found
        finally:
            await env.shutdown()

    desc, details, history, found = asyncio.run(go())
    attrs = {p.key.name: p.value for p in desc.typed_search_attributes}
    # Stand-in rewards: 0.1 * batch index; the last step trained batch 3. Evaluations: 0.5.
    assert attrs["ratchet_step"] == 4 and attrs["ratchet_status"] == "completed", attrs
    assert attrs["ratchet_reward"] == pytest.approx(0.3) and attrs["ratchet_eval_reward"] == pytest.approx(0.5), attrs
    assert (attrs["ratchet_experiment"], attrs["ratchet_algorithm"], attrs["ratchet_loop_mode"]) == ("sa-test", "grpo", "one_step_off")
    assert (attrs["ratchet_model"], attrs["ratchet_sweep"]) == ("tiny-llama", "sw1")
    assert found == ["shown"]
    assert desc.failed == {"ratchet_status": "failed", "ratchet_step": 0}, desc.failed
    assert desc.summary_text == "GRPO on tiny-llama · 4 steps, one_step_off loop · experiment sa-test · sweep sw1 trial 3"
    assert "- learning rate" not in desc.details_text and "- model: `/models/tiny-llama`" in desc.details_text
    assert "step 4/4" in details.current_details and "reward 0.300" in details.current_details, details.current_details

    events = history.events
    upserts = [e for e in events if e.HasField("upsert_workflow_search_attributes_event_attributes")]
    shown = [
        sorted(
            (k, v.data.decode()) for k, v in e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields.items()
        )
        for e in upserts
    ]
    ours = [u for u in shown if any(k.startswith("ratchet_") for k, _ in u)]
    assert len(ours) == 4 + 1, shown  # one per step, one at completion (the patch marker's own is Temporal's)
    assert [dict(u)["ratchet_step"] for u in ours] == ["1", "2", "3", "4", "4"], ours
    scheduled = [e.activity_task_scheduled_event_attributes for e in events if e.HasField("activity_task_scheduled_event_attributes")]
    from temporalio.converter import default as default_converter

    conv = default_converter().payload_converter
    summaries = [conv.from_payload(e.user_metadata.summary, str) for e in events if e.HasField("activity_task_scheduled_event_attributes")]
    assert len(summaries) == len(scheduled) and all(summaries), summaries
    assert "generate batch 1 with v0" in summaries and "train step 1 on batch 1" in summaries and "sync weights v2" in summaries, summaries
    assert "evaluate step 2" in summaries, summaries

    result = asyncio.run(Replayer(workflows=[TrainingWorkflow]).replay_workflow(history, raise_on_replay_failure=False))
    assert result.replay_failure is None, result.replay_failure


def test_up_adds_the_attributes_a_server_lacks():
    """`start-dev --search-attribute` only registers on a new database file: a server on an
    older one gets the missing attributes from `ensure_search_attributes` (once)."""
    from ratchet.platform.search import registered_attributes
    from ratchet.platform.services.temporal_server import ensure_search_attributes

    async def go():
        async with dev_server() as env:
            address = env.client.service_client.config.target_host
            first = await asyncio.to_thread(ensure_search_attributes, address, "default", 10.0)
            again = await asyncio.to_thread(ensure_search_attributes, address, "default", 10.0)
            return first, again, sa.missing_from(await registered_attributes(env.client))

    first, again, missing = asyncio.run(go())
    assert first == sorted(k.name for k in sa.ALL_KEYS) and again == [] and missing == []


def test_a_query_on_a_server_without_the_attributes_says_how_to_create_them():
    from ratchet.platform.search import InvalidQuery, find_runs

    async def go():
        async with dev_server() as env:
            with pytest.raises(InvalidQuery) as err:
                await find_runs(env.client, "ratchet_step >= 1")
            return str(err.value)

    message = asyncio.run(go())
    assert "the server refused it" in message and "lacks some of ratchet's attributes" in message, message
    assert "temporal operator search-attribute create" in message
