"""Temporal payloads are sealed with a key only ratchet's processes hold (payload_codec):
whoever reaches the Temporal port without it cannot start a run the worker acts on.

The key file is created private and shared by processes that start together, and refused
when unsafe or malformed. On a real dev server (in memory, no UI; ~1 s) the real training
workflow runs with stand-in activities whose `prepare_run` imports the config's reward file
as the worker would: a start from a plain Temporal client (no key) is refused, the workflow
fails saying why, and its reward file is never imported; the same start through ratchet's
converter imports it (the control: the harness would see an import).
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from ratchet import sweep_types as st
from ratchet import types as t
from ratchet.platform import payload_codec as pc
from ratchet.platform.payload_key import KEY_FILE_VAR, PayloadKeyError, key_file_path, load_key

TEMPORAL = Path(sys.executable).parent / "temporal"


def test_key_file_default_path_and_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_FILE_VAR, raising=False)
    monkeypatch.setenv("RATCHET_STATE_DIR", str(tmp_path / "state"))
    assert key_file_path() == tmp_path / "state" / "payload.key"
    assert key_file_path(tmp_path / "other") == tmp_path / "other" / "payload.key"
    monkeypatch.setenv(KEY_FILE_VAR, str(tmp_path / "secret" / "k"))
    assert key_file_path(tmp_path / "other") == tmp_path / "secret" / "k"  # the variable wins


def test_processes_starting_together_create_one_private_key(tmp_path):
    """Eight processes race to create the key: all end with the same one, the file 0600
    with 64 hex characters, its new folder 0700, no temporary file left behind."""
    path = tmp_path / "state" / "payload.key"
    code = "import sys; from ratchet.platform.payload_key import load_key; print(load_key(sys.argv[1]).key_id)"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True) for _ in range(8)]
    ids = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert ids == {load_key(path).key_id} and len(next(iter(ids))) == 16
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(path.read_text().strip()) == 64 and int(path.read_text(), 16) >= 0
    assert sorted(p.name for p in path.parent.iterdir()) == ["payload.key"]
    # Threads of one process too (the link is the only step that can lose a race).
    other = tmp_path / "threads.key"
    got: list[str] = []
    barrier = threading.Barrier(6)

    def load():
        barrier.wait()
        got.append(load_key(other).key_id)

    threads = [threading.Thread(target=load) for _ in range(6)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    assert len(got) == 6 and len(set(got)) == 1


@pytest.mark.parametrize(
    "mode, content, words",
    [
        (0o644, "ab" * 32, ["mode 644", "other users can read", "chmod 600"]),
        (0o620, "ab" * 32, ["mode 620", "chmod 600"]),
        (0o600, "not a key", ["cannot be read (not hex text)", "64 hex characters"]),
        (0o600, "ab" * 16, ["holds 16 bytes, not 32"]),
    ],
)
def test_unsafe_or_malformed_key_file_is_refused(tmp_path, mode, content, words):
    path = tmp_path / "payload.key"
    path.write_text(content)
    os.chmod(path, mode)
    with pytest.raises(PayloadKeyError) as err:
        load_key(path)
    message = str(err.value)
    assert str(path) in message and all(w in message for w in words), message
    assert "ab" * 16 not in message  # the key's content is never echoed


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_key_file_of_another_user_is_refused(tmp_path):
    path = tmp_path / "payload.key"
    path.write_text("ab" * 32)
    os.chmod(path, 0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(PayloadKeyError, match=r"owned by uid 65534, not by you"):
        load_key(path)


def test_missing_named_key_file_is_refused_when_not_created(tmp_path):
    with pytest.raises(PayloadKeyError, match=r"does not exist; mount the run's key there"):
        load_key(tmp_path / "nope.key", create=False)


def test_codec_seals_opens_and_refuses(tmp_path):
    codec = pc.AesGcmCodec(load_key(tmp_path / "a.key"))
    other = pc.AesGcmCodec(load_key(tmp_path / "b.key"))
    plain = pc.RatchetPayloadConverter().to_payload({"reward": {"function": "/home/me/reward.py:score"}})
    [sealed] = asyncio.run(codec.encode([plain]))
    assert sealed.metadata["encoding"] == b"binary/encrypted" and sealed.metadata["encryption-key-id"] == codec.key.key_id.encode()
    assert b"reward.py" not in sealed.SerializeToString()
    assert asyncio.run(codec.decode([sealed])) == [plain]
    # Sealed twice, never the same bytes (a fresh nonce each time).
    assert asyncio.run(codec.encode([plain]))[0].data != sealed.data

    def refused_with(payload: Payload) -> str:
        [opened] = asyncio.run(codec.decode([payload]))
        with pytest.raises(ApplicationError) as err:
            pc.RatchetPayloadConverter().from_payloads([opened])
        assert err.value.type == "PayloadNotAuthenticated" and err.value.non_retryable
        return str(err.value)

    message = refused_with(plain)
    assert "not authenticated with this process's key" in message and f"{KEY_FILE_VAR}={tmp_path / 'a.key'}" in message
    assert "not encrypted" in message
    tampered = Payload()
    tampered.CopyFrom(sealed)
    tampered.data = sealed.data[:-1] + bytes([sealed.data[-1] ^ 1])
    assert "tag does not verify" in refused_with(tampered)
    # Sealed with another key: the wrong key file somewhere, retryable, both key ids named.
    with pytest.raises(pc.PayloadKeyMismatch, match=rf"key id {other.key.key_id}, but this process holds .*key id {codec.key.key_id}"):
        asyncio.run(codec.decode(asyncio.run(other.encode([plain]))))


REWARD = """
from pathlib import Path
Path({marker!r}).write_text("imported")

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0
"""


def test_a_start_without_the_key_is_refused_and_its_reward_never_imported(tmp_path):
    """A plain temporalio client (no key) starts a TrainingWorkflow whose reward file writes
    a marker when imported: the worker (ratchet's converter) fails the workflow with the
    refusal, no activity runs, the marker never appears. The same start through ratchet's
    converter runs and imports it. The history keeps the keyed run's config sealed."""
    from tests.faults.standins import StandIns, plan, worker_for

    from ratchet.tasks.loading import load_reward_fn

    marker = tmp_path / "imported.txt"
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD.format(marker=str(marker)))
    spec = f"{reward}:compute_score"

    async def import_reward(inp: t.PrepareInput) -> None:  # what the worker does with a config
        load_reward_fn(inp.config["reward"]["function"])

    standins = StandIns(before={"prepare_run": import_reward})
    converter = pc.data_converter(tmp_path / "state" / "payload.key")

    def training(run_id: str) -> t.TrainingInput:
        return t.TrainingInput(run_id=run_id, config={"reward": {"function": spec}}, plan=plan(steps=1))

    async def go():
        env = await WorkflowEnvironment.start_local(dev_server_existing_path=str(TEMPORAL), ui=False)
        try:
            target = env.client.service_client.config.target_host
            keyed = await Client.connect(target, data_converter=converter)
            async with worker_for(keyed, standins, "codec"):
                attacker = await env.client.start_workflow("TrainingWorkflow", training("intruder"), id="intruder", task_queue="codec")
                with pytest.raises(WorkflowFailureError) as err:
                    await asyncio.wait_for(attacker.result(), 60)
                refused = err.value.cause
                calls_after_refusal = list(standins.calls)
                marker_after_refusal = marker.exists()
                own = await keyed.start_workflow(
                    "TrainingWorkflow", training("mine"), id="mine", task_queue="codec", result_type=t.RunSummary
                )
                summary = await asyncio.wait_for(own.result(), 60)
                raw = await env.client.get_workflow_handle("mine").fetch_history()
            return refused, calls_after_refusal, marker_after_refusal, summary, raw
        finally:
            await env.shutdown()

    refused, calls, marker_seen, summary, raw = asyncio.run(go())
    assert isinstance(refused, ApplicationError) and refused.type == "PayloadNotAuthenticated", refused
    assert "not authenticated with this process's key" in refused.message and "not encrypted" in refused.message
    assert calls == [] and not marker_seen
    # The control: with the key, the same config reaches the worker and its file is imported.
    assert summary.steps == 1 and marker.read_text() == "imported"
    started = raw.events[0].workflow_execution_started_event_attributes
    [inp] = started.input.payloads
    assert inp.metadata["encoding"] == b"binary/encrypted" and b"reward.py" not in raw.to_json().encode()


def test_codec_server_decodes_for_the_ui_only_and_never_encodes(tmp_path):
    """The UI's codec server (in this process, on 127.0.0.1): `/decode` opens what the key
    sealed and hands plain payloads back as they are; `/encode` is refused (it would seal
    a stranger's start); a browser page of another origin is refused; the UI's preflight
    is answered with exactly its origin."""
    import base64
    import json
    import urllib.error
    import urllib.request
    from http.server import ThreadingHTTPServer

    from google.protobuf import json_format
    from temporalio.api.common.v1 import Payloads

    from ratchet.platform.services.codec_server import _handler

    codec = pc.AesGcmCodec(load_key(tmp_path / "payload.key"))
    ui = "http://127.0.0.1:8233"
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(codec, {ui}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def call(path: str, method: str = "POST", body: bytes | None = None, **headers) -> tuple[int, dict, bytes]:
        req = urllib.request.Request(base + path, data=body, method=method, headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read()

    try:
        plain = pc.RatchetPayloadConverter().to_payload({"reward": {"function": "/home/me/reward.py:score"}})
        sealed = codec.seal(plain)
        body = json_format.MessageToJson(Payloads(payloads=[sealed, plain])).encode()
        assert b"reward.py" not in body
        # The path as the UI sends it.
        status, headers, out = call("/decode?preserveStorageRefs=true", body=body, Origin=ui, **{"X-Namespace": "default"})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == ui
        got = json.loads(out)["payloads"]
        assert [base64.b64decode(p["data"]) for p in got] == [plain.data, plain.data]
        assert base64.b64decode(got[0]["metadata"]["encoding"]) == b"json/plain"
        # The CLI's --codec-endpoint templating (`/{namespace}/decode`), no Origin.
        assert call("/default/decode", body=body)[0] == 200

        status, headers, _ = call("/decode", "OPTIONS", Origin=ui, **{"Access-Control-Request-Method": "POST"})
        assert status == 204 and headers["Access-Control-Allow-Origin"] == ui
        assert headers["Access-Control-Allow-Headers"] == "content-type, x-namespace"
        assert call("/decode", body=body, Origin="http://evil.example")[0] == 403
        assert call("/decode", "OPTIONS", Origin="http://evil.example")[0] == 403
        status, _, out = call("/encode", body=json_format.MessageToJson(Payloads(payloads=[plain])).encode(), Origin=ui)
        assert status == 403 and b"only decodes" in out
    finally:
        server.shutdown()
        server.server_close()


# -- signals without arguments: pause, resume and stop carry a sealed RunCommand ----------------


class HeldStep:
    """Holds the run's second `train` call (policy version 1) until the command is sent."""

    def __init__(self):
        self.reached = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, inp) -> None:
        if inp.policy_version == 1:
            self.reached.set()
            await self.release.wait()


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """One dev server for the commands below (its own event loop) and the key's file."""
    loop = asyncio.new_event_loop()
    env = loop.run_until_complete(WorkflowEnvironment.start_local(dev_server_existing_path=str(TEMPORAL), ui=False))
    try:
        yield env.client.service_client.config.target_host, tmp_path_factory.mktemp("state") / "payload.key"
    finally:
        loop.run_until_complete(env.shutdown())
        loop.close()


def command_run(keyed_server, run_id: str, send, replay: bool = False) -> tuple[t.RunSummary, list[str]]:
    """Run a 3-step TrainingWorkflow (stand-in activities, a worker with the key); while its
    second step is held, `send(plain, keyed)` signals it, `plain` a handle from a temporalio
    client without the key, `keyed` one from a client with ratchet's converter. Its summary
    (a run left paused would time out) and the worker's warnings about ignored signals.
    `replay`: the history, with the refusals' patch marker, replays with the workflow."""
    import logging

    from tests.faults.standins import StandIns, plan, worker_for

    target, key_file = keyed_server
    held = HeldStep()
    standins = StandIns(before={"train": held})
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            if "ignored" in record.getMessage():
                warnings.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logging.getLogger("temporalio").addHandler(handler)

    async def go():
        keyed = await Client.connect(target, data_converter=pc.data_converter(key_file))
        plain = await Client.connect(target)
        queue = f"codec-{run_id}"
        async with worker_for(keyed, standins, queue):
            inp = t.TrainingInput(run_id=run_id, config={}, plan=plan(steps=3))
            handle = await keyed.start_workflow("TrainingWorkflow", inp, id=run_id, task_queue=queue, result_type=t.RunSummary)
            await asyncio.wait_for(held.reached.wait(), 60)
            await send(plain.get_workflow_handle(run_id), handle)
            held.release.set()
            summary = await asyncio.wait_for(handle.result(), 60)
        if replay:
            from temporalio.worker import Replayer

            from ratchet.workflows.training import TrainingWorkflow

            history = await handle.fetch_history()
            result = await Replayer(workflows=[TrainingWorkflow], data_converter=keyed.data_converter).replay_workflow(
                history, raise_on_replay_failure=False
            )
            assert result.replay_failure is None, result.replay_failure
        return summary

    try:
        return asyncio.run(go()), warnings
    finally:
        logging.getLogger("temporalio").removeHandler(handler)


def test_stop_and_pause_from_a_client_without_the_key_are_ignored(keyed_server):
    """A plain temporalio client sends `stop` and `pause` with no argument, and with a
    command it can only send unsealed: the run goes on to its last step, never paused; its
    history (the refusals behind `workflow.patched`) replays."""

    async def send(plain, keyed):
        forged = {"workflow_id": plain.id}
        for name in ("stop", "pause"):
            await plain.signal(name)
            await plain.signal(name, forged)

    summary, warnings = command_run(keyed_server, "plain-commands", send, replay=True)
    assert summary.steps == 3 and not summary.stopped, summary
    assert any("signal 'stop' without an authenticated command: ignored" in w for w in warnings), warnings
    assert any("signal 'pause' without an authenticated command: ignored" in w for w in warnings), warnings
    assert any("ratchet's client, which holds the payload key" in w for w in warnings), warnings


def test_a_stop_from_ratchets_client_stops_the_run(keyed_server):
    """The control: the same `stop` with the command ratchet's client sends (command_for,
    what RunHandle.stop and `ratchet stop` send) ends the run at the held step."""
    from ratchet.platform.client import command_for

    async def send(plain, keyed):
        await keyed.signal("stop", command_for(keyed.id))

    summary, warnings = command_run(keyed_server, "keyed-stop", send)
    assert summary.stopped and summary.steps == 2, summary
    assert warnings == []


def test_a_sealed_command_for_another_run_is_ignored(keyed_server):
    """Sealed with the key, but naming another workflow (a command copied out of another
    run's history): ignored, the run goes on to its end."""
    from ratchet.platform.client import command_for

    async def send(plain, keyed):
        await keyed.signal("stop", command_for("another-run"))
        await keyed.signal("pause", command_for("another-run"))

    summary, warnings = command_run(keyed_server, "replayed-commands", send, replay=True)
    assert summary.steps == 3 and not summary.stopped, summary
    assert any("the command names workflow 'another-run', not this one" in w and "'stop'" in w for w in warnings), warnings
    assert any("'pause'" in w and "another-run" in w for w in warnings), warnings


def test_a_sweep_ignores_a_cancel_without_the_key_and_signals_its_trials_with_commands(keyed_server):
    """A sweep of one trial (the real SweepWorkflow and TrainingWorkflow, stand-in
    activities): a plain client's `cancel` and `pause` are ignored; ratchet's `cancel`
    (command_for the sweep) makes the sweep send its trial a `stop` carrying a command for
    the trial, which the trial accepts: it ends at the held
    step and the sweep completes as cancelled."""
    from temporalio import activity
    from temporalio.api.enums.v1 import EventType
    from temporalio.worker import Worker

    from tests.faults.standins import StandIns, plan

    from ratchet.platform.client import command_for
    from ratchet.workflows.sweep import SweepWorkflow
    from ratchet.workflows.training import TrainingWorkflow

    @activity.defn(name="sweep_begin")
    async def sweep_begin(inp) -> None:
        return None

    @activity.defn(name="sweep_status")
    async def sweep_status(inp) -> None:
        return None

    @activity.defn(name="plan_trial")
    async def plan_trial(inp: st.PlanTrialInput) -> st.TrialPlan:
        run_id = f"{inp.sweep_id}-t{inp.trial_index}"
        return st.TrialPlan(trial_index=inp.trial_index, run_id=run_id, params={}, config={}, plan=plan(steps=3), storage_root="")

    @activity.defn(name="finish_trial")
    async def finish_trial(inp: st.FinishTrialInput) -> st.TrialResult:
        return st.TrialResult(trial_index=inp.trial_index, run_id=inp.run_id, state=inp.state, steps=inp.steps)

    target, key_file = keyed_server
    held = HeldStep()
    standins = StandIns(before={"train": held})
    sweep_id = "codec-sweep"

    async def go():
        keyed = await Client.connect(target, data_converter=pc.data_converter(key_file))
        plain = await Client.connect(target)
        worker = Worker(
            keyed,
            task_queue="codec-sweep",
            workflows=[SweepWorkflow, TrainingWorkflow],
            activities=[*standins.activities(), sweep_begin, sweep_status, plan_trial, finish_trial],
        )
        async with worker:
            spec = {"name": "s", "search": "grid", "objective": {"metric": "reward_mean"}}
            inp = st.SweepInput(sweep_id, spec, {}, st.SweepPlan(trials=1, parallelism=1))
            handle = await keyed.start_workflow("SweepWorkflow", inp, id=sweep_id, task_queue="codec-sweep", result_type=st.SweepSummary)
            await asyncio.wait_for(held.reached.wait(), 60)
            await plain.get_workflow_handle(sweep_id).signal("pause")
            await plain.get_workflow_handle(sweep_id).signal("cancel")
            await handle.signal("cancel", command_for(sweep_id))
            trial = keyed.get_workflow_handle(f"{sweep_id}-t0")

            async def stop_reached():  # the sweep's `stop` is in the trial's history
                while not any(
                    e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED for e in (await trial.fetch_history()).events
                ):
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(stop_reached(), 60)
            held.release.set()
            return await asyncio.wait_for(handle.result(), 60)

    summary = asyncio.run(go())
    assert summary.status == "cancelled", summary
    [trial] = summary.trials
    assert trial.state == "cancelled" and trial.steps == 2, trial  # stopped at the held step
