"""`ratchet up`'s MLflow UI as a service, without starting Temporal or Ray: its settings,
and a port taken by another process reported by `status` instead of failing `up`."""

from __future__ import annotations

import json
import socket

import pytest

from ratchet.platform import services as svc
from ratchet.platform.services import ServiceError, ServiceSettings, mlflow_ui
from ratchet.platform.services.state import load_state, locked


def test_settings(monkeypatch, tmp_path):
    monkeypatch.delenv("RATCHET_MLFLOW_UI_PORT", raising=False)
    assert ServiceSettings().mlflow_ui_port is None  # built in code: no UI unless asked
    assert ServiceSettings.from_env().mlflow_ui_port == 5000  # the CLI's `ratchet up`: on
    monkeypatch.setenv("RATCHET_MLFLOW_UI_PORT", "off")
    assert ServiceSettings.from_env().mlflow_ui_port is None
    monkeypatch.setenv("RATCHET_MLFLOW_UI_PORT", "5055")
    s = ServiceSettings.from_env(state_dir=tmp_path)
    assert svc.mlflow_ui_url(s) == "http://127.0.0.1:5055"
    assert mlflow_ui.command(s)[-6:] == ["--host", "127.0.0.1", "--port", "5055", "--workers", "1"]
    assert mlflow_ui.command(s)[1:4] == ["-m", "ratchet.platform.services.mlflow_ui", str(tmp_path / "mlflow.db")]
    assert f"sqlite:///{tmp_path}/mlflow.db" in mlflow_ui.command(s)
    monkeypatch.setenv("RATCHET_MLFLOW_UI_PORT", "web")
    with pytest.raises(ServiceError, match="RATCHET_MLFLOW_UI_PORT"):
        ServiceSettings.from_env()
    with pytest.raises(ServiceError, match="mlflow_ui_port 7233 is already taken"):
        ServiceSettings(mlflow_ui_port=7233)
    with pytest.raises(ServiceError, match="mlflow_ui_port must be a TCP port"):
        ServiceSettings(mlflow_ui_port=70000)


def test_a_taken_port_is_reported_and_up_carries_on(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = ServiceSettings(state_dir=tmp_path, mlflow_ui_port=port)
        started: list[str] = []
        with locked(settings):
            state = load_state(settings)
            mlflow_ui.ensure(settings, state, started)  # what `up` calls; must not raise
        assert started == []
        rec = json.loads(settings.state_file.read_text())["services"]["mlflow_ui"]
        assert "pid" not in rec
        st = svc.status(settings).mlflow_ui
        assert (st.running, st.managed) == (False, False)
        assert f"port {port} is in use" in st.detail and "RATCHET_MLFLOW_UI_PORT" in st.detail
        assert svc.status(settings).mlflow_ui_url == f"http://127.0.0.1:{port}"
    assert svc.down(settings) == []  # nothing of ours ran; the record goes
    assert "mlflow_ui" not in json.loads(settings.state_file.read_text())["services"]
