"""What a user reads when the services are not up, no worker runs, or a run has ended or
never existed: one line naming the problem and the command that fixes it, a non-zero exit
code, never a traceback (src/ratchet/platform/cli_errors.py, worker.py).

Real parts: `ratchet` subprocesses against ports nothing listens on, a Temporal dev server
with no worker (started as `ratchet up` starts it), and, for a run that completed, the
session's platform."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ratchet.platform.client import RECIPE_PATH
from ratchet.platform.services import ServiceSettings, free_ports, temporal_address

RATCHET = str(Path(__file__).resolve().parents[2] / ".venv" / "bin" / "ratchet")
SWEEP_SPEC = RECIPE_PATH.parent / "sweep_copy.yaml"
NO_WORKER = "no worker is polling task queue 'ratchet': start one with `ratchet worker`"


def ratchet(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [RATCHET if os.path.exists(RATCHET) else shutil.which("ratchet") or RATCHET, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "COLUMNS": "400", **(env or {})})
    assert "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr
    return out


def many(commands: list[list[str]], env: dict) -> list[subprocess.CompletedProcess]:
    """`ratchet` once per command, two at a time (each is mostly Python start-up)."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda args: ratchet(*args, env=env), commands))


def one_line(out: subprocess.CompletedProcess) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.fixture(scope="module")
def nothing_up() -> dict:
    """Addresses where nothing listens (ports that were free a moment ago)."""
    t, r = free_ports(2)
    return {"RATCHET_TEMPORAL_ADDRESS": f"127.0.0.1:{t}", "RATCHET_RAY_ADDRESS": f"127.0.0.1:{r}"}


@pytest.fixture(scope="module")
def bare_temporal():
    """A Temporal dev server alone, no worker, no Ray (as `ratchet up` starts the server)."""
    from ratchet.platform.services import temporal_server

    state = Path(tempfile.mkdtemp(dir="/tmp", prefix="rt-msg-"))
    t, ui = free_ports(2)
    settings = ServiceSettings(state_dir=state, temporal_port=t, temporal_ui_port=ui, start_timeout_s=60.0)
    (state / "logs").mkdir(parents=True, exist_ok=True)
    rec = temporal_server.start(settings)
    (ray_port,) = free_ports(1)
    try:
        yield {"RATCHET_TEMPORAL_ADDRESS": temporal_address(settings), "RATCHET_RAY_ADDRESS": f"127.0.0.1:{ray_port}"}
    finally:
        temporal_server.stop(rec, timeout=10)
        shutil.rmtree(state, ignore_errors=True)


def _train_args(assets, runs_root: Path, *extra: str) -> list[str]:
    train, _ = assets.data["copy"]
    return [
        f"model.path={assets.model}", f"data.train_files={train}", "data.eval_files=null", f"storage.root={runs_root}",
        "loop.steps=2", "warmup.steps=0", *extra,
    ]  # fmt: skip


# -- services not up --------------------------------------------------------------------


@pytest.mark.slow
def test_every_command_that_needs_temporal_says_it_is_not_up(nothing_up, assets, tmp_path):
    address = nothing_up["RATCHET_TEMPORAL_ADDRESS"]
    expected = (
        f"cannot reach the Temporal server at {address} (connection refused): "
        "start the services with `ratchet up` (or set RATCHET_TEMPORAL_ADDRESS)"
    )
    train, evals = assets.data["copy"]
    base = [f"model.path={assets.model}", f"data.train_files={train}", f"data.eval_files={evals}", f"storage.root={tmp_path}"]
    # One place (main()) says it for every command; these reach it by each path there is:
    # after a config check (train, sweep), with a run id, with a registry opened first (runs).
    commands = [
        ["train", str(RECIPE_PATH), *base], ["sweep", str(SWEEP_SPEC), *base], ["pause", "r1"],
        ["fork", "r1", "--checkpoint", "step-2"], ["runs", "--where", "ratchet_step > 1"],
    ]  # fmt: skip
    for args, out in zip(commands, many(commands, nothing_up)):
        assert (out.returncode, one_line(out)) == (1, expected), (args, out.stdout, out.stderr)


def test_debug_shows_the_traceback(nothing_up):
    """`--debug` (as RATCHET_DEBUG=1) keeps the traceback for a bug report."""
    out = subprocess.run([RATCHET, "--debug", "pause", "r1"], capture_output=True, text=True, timeout=60, env={**os.environ, **nothing_up})
    assert out.returncode == 1
    assert "Traceback" in out.stderr and "Connection refused" in out.stderr


@pytest.mark.integration
def test_worker_names_what_is_not_up(nothing_up, bare_temporal):
    t, r = nothing_up["RATCHET_TEMPORAL_ADDRESS"], nothing_up["RATCHET_RAY_ADDRESS"]
    out = ratchet("worker", env=nothing_up, timeout=60)
    assert (out.returncode, one_line(out)) == (
        1,
        f"cannot reach the Temporal server at {t} (connection refused) or the Ray head (GCS) at {r} (connection refused): "
        "start the services with `ratchet up` (or set RATCHET_TEMPORAL_ADDRESS and RATCHET_RAY_ADDRESS)",
    )
    ray = bare_temporal["RATCHET_RAY_ADDRESS"]  # the server is up, Ray is not
    out = ratchet("worker", env=bare_temporal, timeout=60)
    assert (out.returncode, one_line(out)) == (
        1,
        f"cannot reach the Ray head (GCS) at {ray} (connection refused): start the services with `ratchet up` (or set RATCHET_RAY_ADDRESS)",
    )


@pytest.mark.slow
def test_a_worker_ratchet_starts_waits_for_a_server_that_is_restarting(tmp_path):
    """The worker process the demo and the test platforms start has no supervisor: one
    started while the Temporal server restarts (a Ray restart right before a server kill)
    waits for the server instead of exiting, which left its run without a worker."""
    import time

    from ratchet.platform.demo import start_worker_process

    t, r = free_ports(2)
    proc = start_worker_process(ServiceSettings(state_dir=tmp_path, temporal_port=t, ray_port=r))
    log = tmp_path / "logs" / "worker.log"
    try:
        deadline = time.monotonic() + 300  # a hang guard: a worker start is seconds idle, a minute or more on a loaded 2-core machine
        while "waiting up to" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        assert f"cannot reach the Temporal server at 127.0.0.1:{t}" in log.read_text()
        assert "waiting up to 60 s" in log.read_text()
        time.sleep(1.5)  # past the first retry: still waiting
        assert proc.poll() is None, log.read_text()
    finally:
        proc.kill()
        proc.wait()


# -- no worker; runs that ended or never were -----------------------------------------------


@pytest.mark.integration
def test_no_worker_and_missing_runs(bare_temporal, assets, tmp_path):
    env = bare_temporal
    address = env["RATCHET_TEMPORAL_ADDRESS"]
    out = ratchet("train", str(RECIPE_PATH), *_train_args(assets, tmp_path, "tracking.name=queued"), "--detach", env=env)
    assert out.returncode == 0, out.stderr
    assert one_line(out) == f"{NO_WORKER} (the run is queued and starts when one does)"
    run_id = out.stdout.split("submitted run ")[1].split()[0]

    # The query would wait ~30 s for a worker: the task queue's pollers say at once there is none.
    progress, set_, pause = many([["progress", run_id], ["set", run_id, "trainer.lr=1e-5"], ["pause", run_id]], env)
    assert (progress.returncode, one_line(progress)) == (1, NO_WORKER)
    assert (set_.returncode, one_line(set_)) == (1, NO_WORKER)
    # A signal waits in the history: sent, with the warning.
    assert pause.returncode == 0 and f"pause: sent to {run_id}" in pause.stdout
    assert one_line(pause) == f"{NO_WORKER} (the run acts on it when one starts)"

    from ratchet.platform.client import Client

    client = Client.connect(address)
    client._run(client._temporal.get_workflow_handle(run_id).terminate("test"))
    missing = f"no run 'no-such-run' on the Temporal server at {address}: see `ratchet runs`"
    go_on = f"(continue it from a checkpoint: `ratchet resume {run_id}`, see `ratchet checkpoints {run_id}`)"
    expected = [
        (["pause", run_id], 1, f"run {run_id} was terminated: nothing to pause {go_on}"),
        (["progress", run_id], 1, f"run {run_id} was terminated: no live progress to show {go_on}"),
        (["pause", "no-such-run"], 2, missing),
        (["progress", "no-such-run"], 2, missing),
        (
            ["schedule", "delete", "no-such-schedule"],
            2,
            f"no schedule 'no-such-schedule' on the Temporal server at {address}: see `ratchet schedule list`",
        ),
    ]
    for (args, code, line), out in zip(expected, many([args for args, _, _ in expected], env)):
        assert (out.returncode, one_line(out)) == (code, line), args


def test_checkpoints_of_a_missing_run_and_of_a_run_without_any(tmp_path):
    out = ratchet("checkpoints", "no-such-run", "--root", str(tmp_path))
    assert (out.returncode, one_line(out)) == (
        2,
        f"no run folder 'no-such-run' under {tmp_path}: pass --root (the run's storage.root), or see `ratchet runs` for run ids",
    )
    (tmp_path / "young").mkdir()
    (tmp_path / "young" / "config.json").write_text("{}")
    out = ratchet("checkpoints", "young", "--root", str(tmp_path))
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.strip() == "run young has no checkpoint yet (one is written every checkpoint.every steps)"


@pytest.mark.integration
def test_a_completed_run_says_so(platform):
    handle = platform.client.submit(RECIPE_PATH, platform.overrides("loop.steps=2", "warmup.steps=0", "tracking.name=msg-done"))
    handle.result()
    run_id, env = handle.run_id, {"RATCHET_TEMPORAL_ADDRESS": temporal_address(platform.settings)}
    fork = f"fork it to train on: `ratchet fork {run_id} --checkpoint NAME`, names from `ratchet checkpoints {run_id}`"
    expected = [
        (["pause", run_id], "nothing to pause"), (["progress", run_id], "no live progress to show"),
        (["set", run_id, "trainer.lr=1e-5"], "nothing to change live"),
    ]  # fmt: skip
    for (args, nothing), out in zip(expected, many([args for args, _ in expected], env)):
        assert (out.returncode, one_line(out)) == (1, f"run {run_id} already completed: {nothing} ({fork})"), args


# -- the worker's watch on its Temporal server ---------------------------------------------


@pytest.mark.slow
def test_the_worker_says_once_when_the_server_goes_and_comes_back_then_gives_up(caplog):
    """`_watch_server` against a real listening socket that is closed, reopened, closed
    (what it probes is whether the frontend's port accepts a connection):
    one line per change, the SDK's retry warnings held back while it is away, and after
    the grace period the stop event set with True (exit 1)."""
    from ratchet.platform.worker import WorkerSettings, _QuietRetries, _watch_server

    port, ray_port = free_ports(2)

    def listen(at: int = port) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", at))
        s.listen()
        return s

    retries = _QuietRetries()
    core = logging.getLogger("temporalio.core")
    core.addFilter(retries)
    retry_warning = core.makeRecord(
        "temporalio.core-sdk_core::temporalio_client::retry", logging.WARNING, "(sdk-core)", 0, "gRPC call poll retried 6 times", (), None
    )
    settings = WorkerSettings(temporal_address=f"127.0.0.1:{port}", ray_address=f"127.0.0.1:{ray_port}", lost_server_s=1.5)
    ray_head = listen(ray_port)  # stays up: only the Temporal server comes and goes

    async def scenario() -> tuple[bool, list[bool]]:
        stop = asyncio.Event()
        server = listen()
        watching = asyncio.ensure_future(_watch_server(settings, retries, stop, every_s=0.1))
        await asyncio.sleep(0.3)
        server.close()  # gone
        await asyncio.sleep(0.5)
        held = [core.filter(retry_warning)]  # while lost: held back
        server = listen()  # back
        await asyncio.sleep(0.5)
        held.append(core.filter(retry_warning))  # back: one a minute passes
        server.close()  # gone for good
        result = await asyncio.wait_for(watching, 10)
        assert stop.is_set()
        return result, held

    try:
        with caplog.at_level(logging.INFO, logger="ratchet.platform.worker.status"):
            gave_up, held = asyncio.run(scenario())
    finally:
        core.removeFilter(retries)
        ray_head.close()
    assert gave_up is True and held == [False, True]
    said = [r.getMessage() for r in caplog.records if r.name == "ratchet.platform.worker.status"]
    address = settings.temporal_address
    assert len(said) == 4, said
    assert said[0] == f"lost the Temporal server at {address} (connection refused): the worker retries quietly for up to 1.5 s, then exits"
    assert said[1].startswith(f"the Temporal server at {address} is reachable again after ")
    assert said[2] == said[0]
    assert said[3].startswith(f"the Temporal server at {address} has been unreachable for ")
    assert said[3].endswith("then `ratchet worker`")


@pytest.mark.integration
def test_the_worker_says_one_line_when_ready_and_none_when_stopped(platform, tmp_path):
    """Against the session's services, on a task queue of its own (it takes no other
    test's work): one line when it serves, nothing else, exit 0 on SIGTERM."""
    import signal

    from ratchet.platform.services import ray_address, ray_auth_env
    from tests.polling import wait_until

    env = {
        **os.environ, **ray_auth_env(platform.settings), "RATCHET_TASK_QUEUE": "msg-test",
        "RATCHET_TEMPORAL_ADDRESS": temporal_address(platform.settings), "RATCHET_RAY_ADDRESS": ray_address(platform.settings),
    }  # fmt: skip
    log = tmp_path / "worker.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen([RATCHET, "worker"], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_until(lambda: "worker ready" in log.read_text() or proc.poll() is not None, timeout=120)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert log.read_text().splitlines() == [
        f"worker ready: task queue 'msg-test' on {env['RATCHET_TEMPORAL_ADDRESS']}, Ray {env['RATCHET_RAY_ADDRESS']} (Ctrl-C stops it)"
    ]
