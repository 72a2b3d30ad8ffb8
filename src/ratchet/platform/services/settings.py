"""Where the embedded services live and which ports they use: ``ServiceSettings`` (from
the environment or keyword arguments) and the addresses derived from it."""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet.private_paths import UnsafeLocalDir, ensure_private_dir, make_private_dirs

__all__ = [
    "DEFAULT_STATE_DIR",
    "PORT_ENV",
    "RAY_WORKER_PORTS",
    "ServiceError",
    "ServiceSettings",
    "free_ports",
    "object_store_root",
    "ray_address",
    "temporal_address",
    "temporal_ui_url",
    "mlflow_ui_url",
]

DEFAULT_STATE_DIR = Path(".ratchet")
STATE_FILE = "services.json"
RAY_TOKEN_FILE = "ray_auth_token"
# `ray start` keeps these for worker processes and refuses a GCS port inside them.
RAY_WORKER_PORTS = (10002, 19999)

# Ports `ray start` reserves or uses by default, which a picked port must avoid.
_AVOID_PORTS = set(range(RAY_WORKER_PORTS[0], RAY_WORKER_PORTS[1] + 1)) | {6379, 7233, 8233, 8265, 10001, 52365}

# Which env var chooses which port (for error messages).
PORT_ENV = {
    "temporal_port": "RATCHET_TEMPORAL_PORT",
    "temporal_ui_port": "RATCHET_TEMPORAL_UI_PORT",
    "ray_port": "RATCHET_RAY_PORT",
}


class ServiceError(RuntimeError):
    """An embedded service could not be started, found, or stopped."""


# free_ports picks from here up to the kernel's ephemeral range: every outgoing connection
# (and every `bind(0)`, which Ray and Temporal use for their inner ports) takes a port from
# that range, so a port found free there can be gone before the service binds it.
_PICK_FROM = RAY_WORKER_PORTS[1] + 1


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))  # Ray binds every interface
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that are free now, for tests and benchmarks that run their own
    services beside a user's: random ones between Ray's worker ports and the kernel's
    ephemeral range (no outgoing connection takes one there before the service binds
    it), outside the ports Ray and Temporal use by default."""
    low, high = _PICK_FROM, _ephemeral_range()[0] - 1
    if high - low < 1000:  # an ephemeral range that starts low: take what the kernel gives
        return _kernel_ports(n)
    rng = random.SystemRandom()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randint(low, high)
        if port not in _AVOID_PORTS and port not in ports and _is_free(port):
            ports.append(port)
    return ports


def _kernel_ports(n: int) -> list[int]:
    socks: list = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port not in _AVOID_PORTS and port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def _env_port(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ServiceError(f"{name} must be a TCP port number, got {raw!r}") from None


NODES_ENV, NODE_CPUS_ENV, WORKER_NODES_ENV = "RATCHET_NODES", "RATCHET_NODE_CPUS", "RATCHET_WORKER_NODES"
MAX_NODES = 16


def _env_number(name: str, default, kind):
    raw = (os.environ.get(name) or "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ServiceError(f"{name} must be a number, got {raw!r}") from None


MLFLOW_UI_PORT_ENV = "RATCHET_MLFLOW_UI_PORT"
DEFAULT_MLFLOW_UI_PORT = 5000


def _mlflow_ui_port() -> int | None:
    """RATCHET_MLFLOW_UI_PORT: a port, or 0 / off for no MLflow UI; default 5000."""
    raw = (os.environ.get(MLFLOW_UI_PORT_ENV) or "").strip().lower()
    if raw in ("0", "off", "false", "no", "none"):
        return None
    return _env_port(MLFLOW_UI_PORT_ENV, DEFAULT_MLFLOW_UI_PORT)


def _under_state_dir(*parts: str) -> property:
    return property(lambda self: self.state_dir.joinpath(*parts), doc=f"<state_dir>/{'/'.join(parts)}")


@dataclass
class ServiceSettings:
    """Where the embedded services live and which ports they use."""

    state_dir: Path = field(default_factory=lambda: DEFAULT_STATE_DIR)
    temporal_port: int = 7233
    temporal_ui_port: int = 8233
    # Ray's GCS port. Not Ray's default (6379), to stay clear of a user's own cluster.
    ray_port: int = 6380
    host: str = "127.0.0.1"
    namespace: str = "default"
    start_timeout_s: float = 30.0
    stop_timeout_s: float = 10.0
    # The MLflow UI (services/mlflow_ui.py). None: not started, the default for settings
    # built in code (tests); `from_env`, which the CLI uses, asks for 5000.
    mlflow_ui_port: int | None = None
    # Extra Ray nodes on this machine, each with its own ratchet worker (ray_nodes.py);
    # with any, the head keeps no CPUs for actors.
    nodes: int = 0
    node_cpus: float = 2.0
    # Whether each of those nodes runs a ratchet worker; and nodes with no CPUs that only
    # run one (a worker beside a Ray node of its own, as deploy/ runs it).
    node_workers: bool = True
    worker_nodes: int = 0

    def __post_init__(self) -> None:
        # Absolute, so that the recorded paths do not depend on a later cwd.
        self.state_dir = Path(os.path.abspath(Path(self.state_dir).expanduser()))
        for name in PORT_ENV:
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 < value < 65536:
                raise ServiceError(f"{name} must be a TCP port in 1..65535, got {value!r}")
        if self.mlflow_ui_port is not None and (
            isinstance(self.mlflow_ui_port, bool) or not isinstance(self.mlflow_ui_port, int) or not 0 < self.mlflow_ui_port < 65536
        ):
            raise ServiceError(f"mlflow_ui_port must be a TCP port in 1..65535 or None (no MLflow UI), got {self.mlflow_ui_port!r}")
        if self.mlflow_ui_port in (self.temporal_port, self.temporal_ui_port, self.ray_port):
            raise ServiceError(f"mlflow_ui_port {self.mlflow_ui_port} is already taken by another service; set {MLFLOW_UI_PORT_ENV}=<port>")
        for name, env in (("nodes", NODES_ENV), ("worker_nodes", WORKER_NODES_ENV)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_NODES:
                raise ServiceError(
                    f"{name} must be a whole number in 0..{MAX_NODES} (extra Ray nodes on this machine), got {value!r}; set {env}=<n>"
                )
        if self.nodes + self.worker_nodes > MAX_NODES:
            raise ServiceError(
                f"nodes + worker_nodes is {self.nodes + self.worker_nodes}; at most {MAX_NODES} extra nodes run on one machine"
            )
        if not self.node_cpus > 0:
            raise ServiceError(
                f"node_cpus must be > 0 (the Ray CPUs each extra node offers), got {self.node_cpus!r}; set {NODE_CPUS_ENV}=<cpus>"
            )
        ports = [self.temporal_port, self.temporal_ui_port, self.ray_port]
        if len(set(ports)) != len(ports):
            raise ServiceError(
                "temporal_port, temporal_ui_port and ray_port must differ, got "
                f"{self.temporal_port}, {self.temporal_ui_port}, {self.ray_port}"
            )

    @classmethod
    def from_env(cls, **overrides: Any) -> "ServiceSettings":
        """Settings from RATCHET_STATE_DIR, RATCHET_TEMPORAL_PORT, RATCHET_TEMPORAL_UI_PORT,
        RATCHET_RAY_PORT, RATCHET_NODES, RATCHET_NODE_CPUS and RATCHET_WORKER_NODES; keyword
        overrides win."""
        values: dict[str, Any] = {
            "state_dir": Path(os.environ.get("RATCHET_STATE_DIR") or DEFAULT_STATE_DIR),
            "temporal_port": _env_port(PORT_ENV["temporal_port"], 7233),
            "temporal_ui_port": _env_port(PORT_ENV["temporal_ui_port"], 8233),
            "ray_port": _env_port(PORT_ENV["ray_port"], 6380),
            "mlflow_ui_port": _mlflow_ui_port(),
            "nodes": _env_number(NODES_ENV, 0, int),
            "node_cpus": _env_number(NODE_CPUS_ENV, 2.0, float),
            "worker_nodes": _env_number(WORKER_NODES_ENV, 0, int),
        }
        values.update(overrides)
        return cls(**values)

    def ensure_state_dir(self) -> Path:
        """The state folder, created 0700 and checked like the model cache: it holds the
        Ray token, the databases, the logs and the runs (weights, prompts, responses), so it
        must be yours and closed to others (one that others can only read is narrowed; one
        that others can write or own is refused)."""
        try:
            return ensure_private_dir(self.state_dir, "set RATCHET_STATE_DIR to a folder of your own")
        except UnsafeLocalDir as exc:
            raise ServiceError(f"state folder: {exc}") from None

    def ensure_private_subdir(self, path: Path) -> Path:
        """`path` (under the state folder) and its missing parents, created 0700."""
        self.ensure_state_dir()
        return make_private_dirs(path)

    # paths under the state folder
    state_file = _under_state_dir(STATE_FILE)
    logs_dir = _under_state_dir("logs")
    temporal_db = _under_state_dir("temporal.db")
    temporal_log = _under_state_dir("logs", "temporal.log")
    ray_log = _under_state_dir("logs", "ray.log")
    ray_token_file = _under_state_dir(RAY_TOKEN_FILE)
    mlflow_ui_log = _under_state_dir("logs", "mlflow-ui.log")


def temporal_address(settings: ServiceSettings) -> str:
    """``host:port`` of the Temporal frontend these settings point at."""
    return f"{settings.host}:{settings.temporal_port}"


def temporal_ui_url(settings: ServiceSettings) -> str:
    return f"http://{settings.host}:{settings.temporal_ui_port}"


def mlflow_ui_url(settings: ServiceSettings) -> str | None:
    return f"http://{settings.host}:{settings.mlflow_ui_port}" if settings.mlflow_ui_port else None


def ray_address(settings: ServiceSettings) -> str:
    """``host:port`` of the Ray GCS, as passed to ``ray.init(address=...)``."""
    return f"{settings.host}:{settings.ray_port}"


def object_store_root(settings: ServiceSettings) -> Path:
    return settings.state_dir / "runs"
