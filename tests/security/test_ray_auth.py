"""`ratchet up` starts Ray with token authentication.

Ray binds its GCS, raylet, worker and agent ports beyond loopback whatever
`--node-ip-address` says, so the token is what keeps other machines (and other users)
out. A real `up()` on free ports under a short state dir in /tmp; every probe addresses
127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from ratchet.platform import services as svc
from ratchet.platform.services import ServiceError, ServiceSettings, free_ports, ray_auth

LOOPBACK = {"127.0.0.1", "::1"}
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")

# A client of the GCS alone (never the other addresses a full `ray.init` would reach).
PROBE = """
import sys
from ray._raylet import GcsClient
try:
    nodes = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=10)
except Exception as e:
    print("REFUSED", type(e).__name__, e)
    sys.exit(3)
print("ACCEPTED", len(nodes))
"""

# A detached actor, so that a Ray worker process (and its port) is part of the picture.
ACTOR = """
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
@ray.remote(num_cpus=0)
class Probe:
    def ping(self):
        return 7
a = Probe.options(name="probe", namespace="auth-test", lifetime="detached").remote()
print(ray.get(a.ping.remote()))
"""


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS and k != "RAY_ADDRESS"}
    env.update(extra)
    return env


def _run(code: str, address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, address], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def head():
    state = tempfile.mkdtemp(dir="/tmp", prefix="rt-")
    t, ui, r = free_ports(3)
    settings = ServiceSettings(state_dir=Path(state), temporal_port=t, temporal_ui_port=ui, ray_port=r, start_timeout_s=60.0)
    with pytest.MonkeyPatch.context() as mp:
        for var in AUTH_VARS:  # the default, not whatever this shell has
            mp.delenv(var, raising=False)
        try:
            svc.up(settings)
            out = _run(ACTOR, f"127.0.0.1:{r}", _clean_env(**svc.ray_auth_env(settings)))
            assert out.returncode == 0 and out.stdout.split()[-1] == "7", out.stderr[-2000:]
            yield settings
        finally:
            svc.down(settings)
            shutil.rmtree(state, ignore_errors=True)


def _ray_record(settings: ServiceSettings) -> dict:
    return json.loads(settings.state_file.read_text())["services"]["ray"]


def _session_procs(sid: int) -> list[psutil.Process]:
    """Every process of the session `ray start` led: what `up()` started for Ray."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                out.append(p)
        except (ProcessLookupError, PermissionError):
            continue
    return out


def _auth_vars(proc: psutil.Process, members: set[int]) -> dict[str, str]:
    """RAY_AUTH_* of `proc`. Ray's Python processes write their process title over the
    start of their environment block (it reads back as empty entries); for those, the
    variables of the session ancestor they inherited them from."""
    raw = Path(f"/proc/{proc.pid}/environ").read_bytes()
    entries = raw.split(b"\0")
    if entries and entries[0]:
        return {k: v for k, _, v in (e.decode(errors="replace").partition("=") for e in entries) if k in AUTH_VARS}
    parent = proc.parent()
    assert parent is not None and parent.pid in members, f"{proc.name()} ({proc.pid}): environment unreadable, no parent in the session"
    return _auth_vars(parent, members)


def _listening(settings: ServiceSettings) -> list[tuple[psutil.Process, str, int]]:
    procs = _session_procs(_ray_record(settings)["sid"])
    out = []
    for p in procs:
        for c in p.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                out.append((p, c.laddr.ip, c.laddr.port))
    return out


# --------------------------------------------------------------------------- integration


@pytest.mark.integration
def test_every_port_beyond_loopback_belongs_to_a_process_with_token_auth(head):
    settings = head
    rec = _ray_record(settings)
    members = {p.pid for p in _session_procs(rec["sid"])}
    listening = _listening(settings)
    names = {p.name() for p, _, _ in listening}
    assert "gcs_server" in names and "raylet" in names, listening
    assert any(port == settings.ray_port for _, _, port in listening)
    token_path = str(svc.ray_token_path(settings))
    for proc, ip, port in listening:
        if ip in LOOPBACK:
            continue
        auth = _auth_vars(proc, members)
        assert auth.get("RAY_AUTH_MODE") == "token", f"{proc.name()} listens on {ip}:{port} without token auth: {auth}"
        assert auth.get("RAY_AUTH_TOKEN_PATH") == token_path, (proc.name(), auth)
    assert rec["auth_mode"] == "token" and rec["auth_token_path"] == token_path
    st = svc.status(settings)
    assert (st.ray_auth_mode, st.ray_auth_token_path) == ("token", token_path)


@pytest.mark.integration
def test_gcs_refuses_a_client_without_the_token(head, tmp_path):
    settings = head
    address = f"127.0.0.1:{settings.ray_port}"
    # An empty HOME: no ~/.ray/auth_token to fall back on.
    home = {"HOME": str(tmp_path)}
    cases = {
        "no auth": _clean_env(**home),
        "wrong token": _clean_env(**home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64),
    }
    for what, env in cases.items():
        out = _run(PROBE, address, env)
        assert out.returncode == 3, f"{what}: {out.stdout} {out.stderr[-1500:]}"
        assert "REFUSED AuthenticationError" in out.stdout, f"{what}: {out.stdout}"
        assert "token" in out.stdout.lower()
    ok = _run(PROBE, address, _clean_env(**home, **svc.ray_auth_env(settings)))
    assert ok.returncode == 0 and ok.stdout.split() == ["ACCEPTED", "1"], ok.stdout + ok.stderr[-1500:]


@pytest.mark.integration
def test_token_file_is_private_and_never_written_elsewhere(head):
    settings = head
    path = svc.ray_token_path(settings)
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    token = path.read_bytes()
    assert len(token) == 64 and int(token, 16) > 0  # 256 random bits, hex
    leaks = []
    for root, _, files in os.walk(settings.state_dir):
        for name in files:
            f = Path(root) / name
            if f == path or not f.is_file():
                continue
            try:
                if token in f.read_bytes():
                    leaks.append(str(f))
            except OSError:
                continue
    assert leaks == [], f"the Ray token appears in {leaks}"
    for p in _session_procs(_ray_record(settings)["sid"]):
        with contextlib.suppress(psutil.Error):
            assert token.decode() not in " ".join(p.cmdline()), p.name()


@pytest.mark.integration
def test_restart_ray_keeps_port_token_and_auth(head):
    """The seam the chaos test uses: a new head, the same token, still refusing strangers."""
    settings = head
    before = (_ray_record(settings)["gcs_pid"], svc.ray_token_path(settings).read_bytes())
    st = svc.restart_ray(settings)
    assert st.ray.running and st.ray.pid != before[0]
    assert svc.ray_token_path(settings).read_bytes() == before[1]
    address = f"127.0.0.1:{settings.ray_port}"
    assert _run(PROBE, address, _clean_env(HOME="/nonexistent")).returncode == 3
    assert _run(PROBE, address, _clean_env(**svc.ray_auth_env(settings))).returncode == 0


# --------------------------------------------------------------------------- unit


@pytest.fixture
def state(monkeypatch):
    for var in AUTH_VARS:
        monkeypatch.delenv(var, raising=False)
    d = tempfile.mkdtemp(dir="/tmp", prefix="rt-")
    try:
        yield ServiceSettings(state_dir=Path(d))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_token_is_created_private_kept_and_replaced_when_others_could_read_it(state):
    state.state_dir.mkdir(parents=True, exist_ok=True)
    path = ray_auth.ensure_token(state)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = path.read_text()
    assert ray_auth.ensure_token(state).read_text() == first  # the same token on every `up`
    path.chmod(0o644)
    assert ray_auth.ensure_token(state).read_text() != first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.unlink()
    path.symlink_to(state.state_dir / "elsewhere")
    with pytest.raises(ServiceError, match="regular file owned by you"):
        ray_auth.ensure_token(state)
    assert not (state.state_dir / "elsewhere").exists()


def test_ray_auth_env_gives_the_path_and_lets_the_user_win(state):
    assert svc.ray_auth_env(state, environ={}) == {}  # nothing started here
    state.state_dir.mkdir(parents=True, exist_ok=True)
    path = ray_auth.ensure_token(state)
    mine = svc.ray_auth_env(state, environ={})
    assert mine == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}
    assert path.read_text() not in json.dumps(mine)
    theirs = svc.ray_auth_env(state, environ={"RAY_AUTH_TOKEN_PATH": "/elsewhere/token"})
    assert theirs == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/elsewhere/token"}
    # Variables ratchet set itself to join another head (a driver of two clusters, a test
    # process) are not the user's choice: this head still gets its own token.
    joined = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/other-head/token"}
    ray_auth.record_applied(joined, ["RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"])
    assert svc.ray_auth_env(state, environ=joined) == mine


def test_status_down_and_drivers_with_a_state_file_from_before_token_auth(state):
    """A head recorded by the old code (no token): drivers use its mode, `status` and
    `down` still work."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    old = {
        "sid": gone.pid, "launcher_pid": gone.pid, "host": "127.0.0.1", "port": state.ray_port,
        "address": svc.ray_address(state), "temp_dir": str(state.state_dir / "ray"), "session_dir": None,
        "auth_mode": "disabled", "gcs_pid": gone.pid, "gcs_start_ticks": 1, "pids": [gone.pid],
    }  # fmt: skip
    state.state_dir.mkdir(parents=True, exist_ok=True)
    state.state_file.write_text(json.dumps({"version": 1, "services": {"ray": old}}))
    assert svc.ray_auth_env(state, environ={}) == {"RAY_AUTH_MODE": old["auth_mode"]}
    st = svc.status(state)
    assert not st.ray.managed and st.ray_auth_mode == old["auth_mode"] and st.ray_auth_token_path is None
    assert svc.down(state) == []
    assert json.loads(state.state_file.read_text())["services"] == {}
