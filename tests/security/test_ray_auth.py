"""`ratchet up` starts Ray with token authentication, and keeps its state private.

Ray binds its GCS, raylet, worker and agent ports beyond loopback whatever
`--node-ip-address` says, so the token is what keeps other machines (and other users)
out. A real `up()` on free ports under a short state dir in /tmp. Every listener of the
head's processes is probed by connecting without the token (before, the test only read
each process's environment and probed the GCS alone); a probe addresses 127.0.0.1, or a
listener's own address on this machine, never another.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
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


def _run(code: str, address: str, env: dict[str, str], umask: int = -1) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, address], env=env, capture_output=True, text=True, timeout=120, umask=umask)


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
            # The driver runs as ratchet's worker does (umask 077: platform/worker.py).
            out = _run(ACTOR, f"127.0.0.1:{r}", _clean_env(**svc.ray_auth_env(settings)), umask=0o077)
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


def _listening(settings: ServiceSettings) -> list[tuple[psutil.Process, str, int]]:
    procs = _session_procs(_ray_record(settings)["sid"])
    out = []
    for p in procs:
        for c in p.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                out.append((p, c.laddr.ip, c.laddr.port))
    return out


def _still_listens(proc: psutil.Process, port: int) -> bool:
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in proc.net_connections(kind="inet"))
    except psutil.Error:
        return False


def _own_addresses() -> set[str]:
    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)}


def _probe_address(ip: str, port: int) -> str:
    """Where to reach a listener without leaving this machine: 127.0.0.1 for one on every
    interface, else its own address, which must be one of this machine's."""
    ip = ip.removeprefix("::ffff:")
    if ip in ("0.0.0.0", "::"):
        ip = "127.0.0.1"
    assert ip in _own_addresses(), f"listener on {ip}:{port} is not an address of this machine: not probed"
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


# One method of each gRPC service a Ray process serves (read-only where it matters: the
# control call with the token runs it). A request without the token must fail with
# UNAUTHENTICATED on the service the port serves; the others answer UNIMPLEMENTED, which
# is how the probe tells which service a port is.
GRPC_PROBES = {
    "ray.rpc.NodeInfoGcsService": "GetAllNodeInfo",  # the GCS
    "ray.rpc.NodeManagerService": "GetNodeStats",  # the raylet's node manager port
    "ray.rpc.ObjectManagerService": "Pull",  # the raylet's object manager port (never called with the token)
    "ray.rpc.CoreWorkerService": "NumPendingTasks",  # each worker's (and driver's) own port
    "ray.rpc.RayletDriver": "ClusterInfo",  # the Ray Client server (ray://, 10001)
}
READ_ONLY = ("ray.rpc.NodeInfoGcsService", "ray.rpc.NodeManagerService", "ray.rpc.CoreWorkerService")


def _grpc(address: str, method: str, token: str | None = None) -> str:
    """The status name of an empty-request call (raw bytes: no Ray stubs needed)."""
    import grpc

    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary(method)(b"", timeout=20, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


def _http(address: str, method: str = "GET", token: str | None = None) -> tuple[int | str, bytes]:
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(f"http://{address}/", method=method, data=b"" if method == "POST" else None, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError as exc:  # not HTTP at all (a gRPC port answers with binary frames)
        return type(exc).__name__, b""


def _what_refuses(address: str) -> tuple[str, dict[str, str]]:
    """(what the listener is, as the probe found it; the gRPC answers without a token)."""
    codes = {service: _grpc(address, f"/{service}/{method}") for service, method in GRPC_PROBES.items()}
    refused = [service for service, code in codes.items() if code == "UNAUTHENTICATED"]
    if refused:
        return "grpc " + ",".join(refused), codes
    if all(code == "UNAVAILABLE" for code in codes.values()):  # not HTTP/2: try HTTP/1
        status, _ = _http(address)
        return f"http {status}", codes
    return "unknown", codes


# --------------------------------------------------------------------------- integration


@pytest.mark.integration
def test_every_ray_listener_refuses_a_request_without_the_token(head):
    """Each TCP port a process of the head's session listens on is probed without the
    token (at 127.0.0.1 or the port's own address on this machine, nowhere else): the GCS,
    the raylet's node manager and object manager ports and the actor's worker port answer
    UNAUTHENTICATED, the runtime-env agent's HTTP port 401, the Ray Client server (when
    its fixed port 10001 was free) UNAUTHENTICATED. The one port that takes no token is
    the autoscaler's Prometheus metrics (fixed port 44217, when free): read-only text, no
    secret in it, every other method refused. With the token the same calls pass, so
    the probe reaches each service."""
    settings = head
    token = svc.ray_token_path(settings).read_text().strip()
    found: dict[str, str] = {}
    for proc, ip, port in _listening(settings):
        cmd = ""
        address = _probe_address(ip, port)
        what, codes = _what_refuses(address)
        assert "OK" not in codes.values(), f"{proc.name()} at {address} answered without the token: {codes}"
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(proc.cmdline())
        if what.startswith("grpc "):
            for service in what[5:].split(","):
                found[service] = address
                if service in READ_ONLY:  # the control: the token is what made the difference
                    ok = _grpc(address, f"/{service}/{GRPC_PROBES[service]}", token)
                    assert ok == "OK", f"{service} at {address} with the token: {ok}"
        elif what == "http 401":
            assert "RuntimeEnvAgent" in cmd or "runtime_env" in cmd, f"{proc.name()} at {address}: {cmd}"
            found["runtime env agent (http)"] = address
            assert _http(address, "POST")[0] == 401
            assert _http(address, token=token)[0] != 401  # the control
        elif what == "http 200" and "autoscaler/_private/monitor.py" in cmd:
            status, body = _http(address)
            lines = [line for line in body.decode().splitlines() if line]
            assert all(line.startswith(("#", "autoscaler_")) for line in lines), lines[:5]
            assert token.encode() not in body
            assert _http(address, "POST")[0] == 405
            found["autoscaler metrics (http, read-only)"] = address
        elif not _still_listens(proc, port):
            continue  # the process closed the port meanwhile (nothing left to probe)
        else:
            pytest.fail(f"{proc.name()} ({cmd[:200]}) listens on {ip}:{port}: {what} {codes}; find out what it is")
    needed = {
        "ray.rpc.NodeInfoGcsService",
        "ray.rpc.NodeManagerService",
        "ray.rpc.ObjectManagerService",
        "ray.rpc.CoreWorkerService",
        "runtime env agent (http)",
    }
    assert needed <= found.keys(), found
    assert found["ray.rpc.NodeInfoGcsService"].endswith(f":{settings.ray_port}")
    rec = _ray_record(settings)
    token_path = str(svc.ray_token_path(settings))
    assert rec["auth_mode"] == "token" and rec["auth_token_path"] == token_path
    st = svc.status(settings)
    assert (st.ray_auth_mode, st.ray_auth_token_path) == ("token", token_path)


@pytest.mark.integration
def test_state_folder_is_closed_to_other_users(head):
    """After `up()` (Temporal, Ray, an actor): the state folder is 0700 and yours, and
    nothing ratchet or the services made in it has a group or other bit: services.json,
    the lock, the token, the logs, Temporal's database, runs/. Ray makes its temp folder
    and session folders 0777 on purpose (to share them between users); they sit inside
    the 0700 state folder, so nobody else reaches them, and every file in them is 0600."""
    settings = head
    st = os.stat(settings.state_dir)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    ray_dir = settings.state_dir / "ray"
    open_to_others, seen = [], set()
    for root, dirs, files in os.walk(settings.state_dir):
        for name in dirs + files:
            path = Path(root) / name
            mode = os.lstat(path).st_mode
            seen.add(path.relative_to(settings.state_dir).parts[0])
            if stat.S_ISLNK(mode) or (path.is_relative_to(ray_dir) and stat.S_ISDIR(mode)):
                continue
            if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
                if mode & 0o077:
                    open_to_others.append(f"{stat.S_IMODE(mode):o} {path}")
    assert open_to_others == []
    assert {"services.json", "ray_auth_token", "logs", "temporal.db", "runs", "ray"} <= seen, seen


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


@pytest.mark.slow
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
