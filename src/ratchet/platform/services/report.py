"""``status``: what runs now, from services.json and port probes, starting nothing."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import codec_server, mlflow_ui, ray_head, ray_nodes, temporal_server
from .ports import can_connect
from .settings import (
    ServiceSettings,
    object_store_root,
    mlflow_ui_url,
    ray_address,
    temporal_address,
    temporal_ui_url,
)
from .state import recorded

__all__ = ["ServiceState", "ServicesStatus", "status"]

_FOREIGN = "answered by a process ratchet did not start"


@dataclass
class ServiceState:
    """One service. ``running``: something answers at ``address``. ``managed``: it is
    the process recorded in services.json as started by ratchet (then ``pid`` is set)."""

    name: str
    running: bool
    address: str
    pid: int | None = None
    managed: bool = False
    detail: str = ""


@dataclass
class ServicesStatus:
    temporal: ServiceState
    ray: ServiceState
    temporal_address: str
    temporal_ui_url: str
    ray_address: str
    object_store_root: Path
    namespace: str
    state_dir: Path
    ray_temp_dir: str | None = None
    started: list[str] = field(default_factory=list)  # what the `up` call started
    # How the recorded Ray head authenticates ("token"; another value: no authentication)
    # and where its token lives (the path, never the token).
    ray_auth_mode: str | None = None
    ray_auth_token_path: str | None = None
    # The MLflow UI (the dashboard): None when not asked for; `detail` says why it does
    # not answer (still starting, could not start, exited).
    mlflow_ui: ServiceState | None = None
    mlflow_ui_url: str | None = None
    # Extra Ray nodes of `up --nodes N` (each with its own worker); `pid`: its supervisor.
    nodes: list[ServiceState] = field(default_factory=list)
    # The Temporal UI's codec server (codec_server.py), for a Temporal server ratchet runs.
    codec_server: ServiceState | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["object_store_root"] = str(self.object_store_root)
        d["state_dir"] = str(self.state_dir)
        return d


def _unmanaged(name: str, host: str, port: int, address: str) -> ServiceState:
    """A service ratchet has no live record of: whatever answers on its port."""
    answers = can_connect(host, port)
    return ServiceState(name, answers, address, None, False, _FOREIGN if answers else "")


def status(settings: ServiceSettings | None = None) -> ServicesStatus:
    """What runs now; starts nothing and creates nothing."""
    settings = settings or ServiceSettings.from_env()
    services = recorded(settings)

    rec = services.get("temporal")
    if temporal_server.is_ours(rec):
        t_addr = rec["address"]
        ui = rec.get("ui_url", temporal_ui_url(settings))
        answers = can_connect(rec["host"], rec["port"])
        temporal = ServiceState("temporal", answers, t_addr, rec["pid"], True)
        codec_rec = rec.get("codec_server")
        codec_answers, codec_detail = codec_server.describe(codec_rec)
        codec = ServiceState(
            "codec_server", codec_answers, codec_server.url(codec_rec) if codec_rec else "-",
            codec_rec.get("pid") if codec_rec else None, codec_server.is_ours(codec_rec), codec_detail,
        )  # fmt: skip
    else:
        t_addr, ui = temporal_address(settings), temporal_ui_url(settings)
        temporal = _unmanaged("temporal", settings.host, settings.temporal_port, t_addr)
        codec = None

    rec_r = services.get("ray")
    if ray_head.is_ours(rec_r):
        r_addr = rec_r["address"]
        answers = can_connect(rec_r["host"], rec_r["port"])
        ray = ServiceState("ray", answers, r_addr, rec_r["gcs_pid"], True)
    else:
        r_addr = ray_address(settings)
        ray = _unmanaged("ray", settings.host, settings.ray_port, r_addr)

    mlflow, mlflow_url = _mlflow_ui(settings, services.get("mlflow_ui"))
    return ServicesStatus(
        temporal=temporal,
        ray=ray,
        temporal_address=t_addr,
        temporal_ui_url=ui,
        ray_address=r_addr,
        object_store_root=object_store_root(settings),
        namespace=settings.namespace,
        state_dir=settings.state_dir,
        ray_temp_dir=rec_r.get("temp_dir") if rec_r else None,
        ray_auth_mode=rec_r.get("auth_mode") if rec_r else None,
        ray_auth_token_path=rec_r.get("auth_token_path") if rec_r else None,
        mlflow_ui=mlflow,
        mlflow_ui_url=mlflow_url,
        codec_server=codec,
        nodes=[
            ServiceState(rec["name"], bool(ray_nodes.pids(rec)), r_addr, rec["pid"], ray_nodes.is_ours(rec), f"{rec['cpus']:g} CPUs")
            for _, rec in sorted(services.get("nodes", {}).items(), key=lambda kv: int(kv[0]))
        ],
    )


def _mlflow_ui(settings: ServiceSettings, rec: dict | None) -> tuple[ServiceState | None, str | None]:
    if rec:
        answers, detail = mlflow_ui.describe(rec)
        return ServiceState("mlflow_ui", answers, rec["url"], rec.get("pid"), mlflow_ui.is_ours(rec), detail), rec["url"]
    url = mlflow_ui_url(settings)
    if url is None:
        return None, None
    return _unmanaged("mlflow_ui", settings.host, settings.mlflow_ui_port, url), url  # type: ignore[arg-type]
