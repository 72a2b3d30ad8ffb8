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
                own = await keyed.start_workflow("TrainingWorkflow", training("mine"), id="mine", task_queue="codec", result_type=t.RunSummary)
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
