"""Embedded services (ratchet.platform.services) against a REAL Temporal dev server
and a REAL Ray head, on free ports under a short state dir in /tmp."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ratchet.platform import services as svc
from ratchet.platform.services import PORT_ENV, ServiceError, ServiceSettings, processes, ray_head

from ratchet.platform.services import free_ports


def _settings(state_dir: str) -> ServiceSettings:
    t, ui, r = free_ports(3)
    return ServiceSettings(
        state_dir=Path(state_dir), temporal_port=t, temporal_ui_port=ui, ray_port=r,
        start_timeout_s=60.0, stop_timeout_s=10.0,
    )  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture
def state_dir():
    d = tempfile.mkdtemp(dir="/tmp", prefix="rt-")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def running():
    """Services started once for the module; always stopped at the end."""
    d = tempfile.mkdtemp(dir="/tmp", prefix="rt-")
    settings = _settings(d)
    try:
        first = svc.up(settings)
        yield settings, first
    finally:
        try:
            svc.down(settings)
        finally:
            shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- unit


def test_settings_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RATCHET_STATE_DIR", str(tmp_path / "st"))
    monkeypatch.setenv("RATCHET_TEMPORAL_PORT", "17000")
    monkeypatch.setenv("RATCHET_TEMPORAL_UI_PORT", "18000")
    monkeypatch.setenv("RATCHET_RAY_PORT", "26000")
    s = ServiceSettings.from_env()
    assert s.state_dir == tmp_path / "st"
    assert (s.temporal_port, s.temporal_ui_port, s.ray_port) == (17000, 18000, 26000)
    assert svc.temporal_address(s) == "127.0.0.1:17000"
    assert svc.ray_address(s) == "127.0.0.1:26000"
    monkeypatch.setenv("RATCHET_RAY_PORT", "nope")
    with pytest.raises(ServiceError, match="RATCHET_RAY_PORT"):
        ServiceSettings.from_env()


def test_defaults_and_status_starts_nothing(state_dir):
    s = ServiceSettings()
    assert (s.temporal_port, s.temporal_ui_port, s.ray_port) == (7233, 8233, 6380)
    assert s.state_dir == Path.cwd() / ".ratchet"
    empty = Path(state_dir) / "never-created"
    st = svc.status(_settings(str(empty)))
    assert not st.temporal.managed and not st.ray.managed
    assert not empty.exists()


def test_long_state_dir_uses_short_ray_temp_dir(state_dir):
    long_dir = Path(state_dir) / ("x" * 80)
    ray_tmp = ray_head.temp_dir(ServiceSettings(state_dir=long_dir))
    assert len(str(ray_tmp)) <= svc.RAY_TEMP_DIR_MAX_LEN
    assert str(ray_tmp).startswith("/tmp/")
    assert ray_head.temp_dir(ServiceSettings(state_dir=long_dir)) == ray_tmp  # stable
    ray_tmp.parent.rmdir()  # the private folder temp_dir made (Ray has not run in it)
    short = ray_head.temp_dir(ServiceSettings(state_dir=Path(state_dir)))
    assert short == Path(state_dir) / "ray"


def _proc_start_ticks(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat, read by hand as services.json recorded it before
    psutil was used."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    return int(raw[raw.rfind(")") + 2 :].split()[19])


def test_process_identity_matches_records_written_from_proc():
    """`start_ticks` (psutil) equals the value older records hold, so a state file
    written by either version identifies the same processes."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        while processes.cmdline(child.pid) != ["sleep", "30"] and time.monotonic() < deadline:
            time.sleep(0.02)  # between fork and exec
        ticks = _proc_start_ticks(child.pid)
        assert processes.start_ticks(child.pid) == ticks
        assert processes.same_process(child.pid, ticks)
        assert not processes.same_process(child.pid, ticks + 1)  # a reused pid
        assert processes.exe_name(child.pid) == "sleep"
    finally:
        child.kill()
        child.wait()
    assert processes.start_ticks(child.pid) is None


def test_a_zombie_is_dead_and_reap_collects_it():
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while _alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert Path(f"/proc/{child.pid}").exists()  # exited, not yet reaped: a zombie
    assert not processes.alive(child.pid)
    assert processes.wait_gone([child.pid], 1.0) == []  # reaps it on the way
    assert not Path(f"/proc/{child.pid}").exists()


# --------------------------------------------------------------------------- integration


@pytest.mark.integration
def test_up_starts_temporal_and_ray(running):
    settings, st = running
    assert st.started == ["temporal", "ray"]
    assert st.temporal.running and st.temporal.managed and _alive(st.temporal.pid)
    assert st.ray.running and st.ray.managed and _alive(st.ray.pid)
    assert st.temporal_address == f"127.0.0.1:{settings.temporal_port}"
    assert st.temporal_ui_url == f"http://127.0.0.1:{settings.temporal_ui_port}"
    assert st.ray_address == f"127.0.0.1:{settings.ray_port}"
    assert st.object_store_root == Path(settings.state_dir) / "runs"
    assert st.object_store_root.is_dir()
    assert Path(st.ray_temp_dir) == Path(settings.state_dir) / "ray"
    assert (st.ray_auth_mode, st.ray_auth_token_path) == ("token", str(svc.ray_token_path(settings)))
    assert _accepts("127.0.0.1", settings.temporal_ui_port)  # the web UI is on

    now = svc.status(settings)
    assert now.temporal.running and now.temporal.pid == st.temporal.pid
    assert now.ray.running and now.ray.pid == st.ray.pid

    async def list_workflows():
        from temporalio.client import Client

        client = await Client.connect(st.temporal_address, namespace="default")
        return [wf async for wf in client.list_workflows()]

    assert isinstance(asyncio.run(list_workflows()), list)

    # A Ray driver connects and runs a task (in a subprocess: keeps ray out of pytest).
    code = (
        "import ray, sys\n"
        "ray.init(address=sys.argv[1], log_to_driver=False)\n"
        "print(int(ray.get(ray.remote(lambda: 41 + 1).remote())))\n"
        "ray.shutdown()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, st.ray_address],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, **svc.ray_auth_env(settings)),  # the head's token
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "42"

    recorded = json.loads((Path(settings.state_dir) / "services.json").read_text())["services"]
    assert recorded["temporal"]["pid"] == st.temporal.pid
    assert recorded["ray"]["gcs_pid"] == st.ray.pid
    assert recorded["ray"]["temp_dir"] == st.ray_temp_dir
    # The head's processes include its raylet but no log monitor (RAY_NODE_FLAGS: nothing reads its output).
    commands = [" ".join(processes.cmdline(pid)) for pid in ray_head.pids(recorded["ray"])]
    assert any("raylet" in c for c in commands), commands
    assert not any("log_monitor" in c for c in commands), commands


@pytest.mark.integration
def test_second_up_is_idempotent(running):
    settings, first = running
    again = svc.up(settings)
    assert again.started == []
    assert again.temporal.pid == first.temporal.pid
    assert again.ray.pid == first.ray.pid
    # Asking for other ports while ours run elsewhere is an error, not a second server.
    other = ServiceSettings(
        state_dir=settings.state_dir, temporal_port=free_ports(1)[0],
        temporal_ui_port=settings.temporal_ui_port, ray_port=settings.ray_port,
    )  # fmt: skip
    with pytest.raises(ServiceError, match=str(settings.temporal_port)):
        svc.up(other)


@pytest.mark.integration
def test_up_restarts_only_a_dead_service(running):
    settings, first = running
    pid = svc.status(settings).temporal.pid
    os.kill(pid, signal.SIGKILL)  # our own Temporal, as recorded
    deadline = time.monotonic() + 10
    while (_alive(pid) or _accepts("127.0.0.1", settings.temporal_port)) and (time.monotonic() < deadline):
        processes.reap(pid)
        time.sleep(0.05)
    assert not svc.status(settings).temporal.running
    again = svc.up(settings)
    assert again.started == ["temporal"]
    assert again.temporal.running and again.temporal.pid != pid
    assert again.ray.pid == first.ray.pid


@pytest.mark.integration
def test_down_stops_only_what_is_recorded(running):
    settings, _ = running
    st = svc.status(settings)
    rec = json.loads((Path(settings.state_dir) / "services.json").read_text())["services"]
    ray_pids = ray_head.pids(rec["ray"])
    assert st.ray.pid in ray_pids and len(ray_pids) >= 2  # gcs, raylet, agents, ...
    # Foreign processes: a plain sleep, and one whose command line even names our Ray
    # session dir (but is not a Ray executable), in their own sessions.
    foreign = [
        subprocess.Popen(["sleep", "120"], start_new_session=True),
        subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)", rec["ray"]["session_dir"]],
            start_new_session=True,
        ),
    ]
    try:
        t0 = time.monotonic()
        stopped = svc.down(settings)
        took = time.monotonic() - t0
        assert sorted(stopped) == ["ray", "temporal"]
        assert took < 30
        assert all(p.poll() is None for p in foreign), "down killed a foreign process"
        assert not any(_alive(p) for p in ray_pids + [st.temporal.pid])
        after = svc.status(settings)
        assert not after.temporal.running and not after.temporal.managed
        assert not after.ray.running and not after.ray.managed
        assert not _accepts("127.0.0.1", settings.ray_port)
        assert not _accepts("127.0.0.1", settings.temporal_port)
        left = json.loads((Path(settings.state_dir) / "services.json").read_text())
        assert left["services"] == {}
        assert svc.down(settings) == []  # nothing recorded, nothing stopped
    finally:
        for p in foreign:
            p.kill()
            p.wait()


@pytest.mark.integration
@pytest.mark.parametrize("which", ["temporal_port", "temporal_ui_port", "ray_port"])
def test_port_taken_by_foreign_socket(state_dir, which):
    settings = _settings(state_dir)
    port = getattr(settings, which)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as foreign:
        foreign.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        foreign.bind(("127.0.0.1", port))
        foreign.listen()
        try:
            with pytest.raises(ServiceError) as err:
                svc.up(settings)
            msg = str(err.value)
            assert str(port) in msg
            assert PORT_ENV[which] in msg
            # Nothing was started: every port is checked before any service starts.
            st = svc.status(settings)
            assert not st.temporal.managed and not st.ray.managed
            assert svc.down(settings) == []
        finally:
            svc.down(settings)
