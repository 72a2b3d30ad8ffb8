"""Where trackers write by default, and URIs made safe to print.

The default MLflow store is a SQLite file in the embedded services' state folder
(`sqlite:///<state dir>/mlflow.db`), the same file the MLflow UI that `ratchet up` starts
reads. The state folder is `$RATCHET_STATE_DIR`, else `./.ratchet`, as for `ratchet up`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

DEFAULT_STATE_DIR = ".ratchet"
MLFLOW_DB = "mlflow.db"
MLFLOW_ARTIFACTS = "mlflow-artifacts"
WANDB_DIR = "wandb"
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)([^/@\s]*@)")
_SECRET_QUERY = re.compile(r"(?i)([?&](?:password|pass|pwd|token|secret|key|access_token|api_key)=)[^&]*")


def state_dir() -> Path:
    return Path(os.path.abspath(os.path.expanduser(os.environ.get("RATCHET_STATE_DIR") or DEFAULT_STATE_DIR)))


def default_mlflow_uri(state: Path | None = None) -> str:
    return f"sqlite:///{(state or state_dir()) / MLFLOW_DB}"


def mlflow_artifacts_dir(state: Path | None = None) -> Path:
    return (state or state_dir()) / MLFLOW_ARTIFACTS


def mlflow_uri(configured: str | None) -> str:
    """The run's MLflow store: the config's `tracking.mlflow_uri`, else
    `$MLFLOW_TRACKING_URI`, else the state folder's SQLite file. A plain folder path
    becomes a `file:` store, as MLflow itself reads one."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or default_mlflow_uri()
    if "://" not in uri and not uri.startswith("databricks"):
        uri = Path(os.path.abspath(os.path.expanduser(uri))).as_uri()
    return uri


def redact(uri: str) -> str:
    """The URI with any user/password and secret-looking query values replaced by ***."""
    out = _USERINFO.sub(lambda m: m.group(1) + "***@", uri)
    return _SECRET_QUERY.sub(lambda m: m.group(1) + "***", out)
