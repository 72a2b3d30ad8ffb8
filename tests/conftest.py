"""Session fixtures: the demo assets, and a real platform (Temporal dev server, Ray head,
a `ratchet worker` process) started the way `ratchet demo` starts it."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from .configs import NO_TRACKER

# Nothing of ratchet at the top: tests/gpu is collected on the GPU machine, which has
# torch and transformers but no pydantic, Ray or Temporal (benchmarks/gpu_machine.py).

# One thread per process on these small machines (two thrash); torch reads these when it
# is imported, so tests that need no torch (the scheduling and loop-mode tests) do not
# load it here.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Activities run in the test process default their registry and MLflow store to the state
# folder: a private one per session, never the checkout's ./.ratchet.
if "RATCHET_STATE_DIR" not in os.environ:
    os.environ["RATCHET_STATE_DIR"] = tempfile.mkdtemp(prefix="rt-state-")
    atexit.register(shutil.rmtree, os.environ["RATCHET_STATE_DIR"], ignore_errors=True)
# One Temporal payload key for the session (platform/payload_codec.py): the platforms
# tests start keep their state in folders of their own, while this process's clients read
# the variable, so every client, worker and codec server must be told the same file.
os.environ.setdefault("RATCHET_PAYLOAD_KEY_FILE", os.path.join(os.environ["RATCHET_STATE_DIR"], "payload.key"))
# The tests' workers sweep closed runs' actors at start-up only: many tests create actors
# with no workflow behind them, which a periodic sweep would take for leftovers.
os.environ.setdefault("RATCHET_SWEEP_EVERY_S", "0")

# Fixtures that start real services with Ray (the platform, the chaos and S3 platforms,
# `ratchet up` itself): every test that uses one is an integration test, so that
# `make test-fast` (-m "not integration") runs the rest in a few minutes.
_RAY_FIXTURES = {"platform", "chaos", "s3_platform", "running", "ray_driver"}


# The longest modules first: `make test` hands whole modules to two processes in
# collection order (--dist loadfile --no-loadscope-reorder: by default xdist sorts modules
# by their number of tests, which put the long platform modules, with one to three tests
# each, last, side by side), and a long module started last leaves one process idle while
# it runs alone. The seconds are recorded, not kept by hand: tests/record_durations.py
# writes them from a whole-suite report. A module not yet recorded counts as
# UNRECORDED_S, about what a module that starts one platform run takes.
MODULE_SECONDS: dict[str, float] = json.loads((Path(__file__).with_name("module_seconds.json")).read_text())
UNRECORDED_S = 30.0


def _longest_first(item) -> float:
    return -MODULE_SECONDS.get(item.nodeid.split("::", 1)[0], UNRECORDED_S)


def pytest_collection_modifyitems(items):
    items.sort(key=_longest_first)  # stable: the rest keep their order
    gpu_skip = None
    for item in items:
        if _RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("gpu") is not None:
            if gpu_skip is None:
                gpu_skip = _gpu_skip()
            if gpu_skip is not False:
                item.add_marker(gpu_skip)


def _gpu_skip():
    """`gpu`-marked tests need a CUDA device; without one they are skipped, not failed
    (torch is imported only when such a test is collected)."""
    import torch

    return False if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device (gpu marker)")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The ~1M-parameter Llama-config model the unit tests train and sample (read-only)."""
    from ratchet.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    from ratchet.platform.assets import prepare_assets

    return prepare_assets(tmp_path_factory.mktemp("assets"), tasks=("copy",))


@dataclass
class Platform:
    settings: object
    client: object
    runs_root: Path
    assets: object

    def overrides(self, *extra: str) -> list[str]:
        """The demo recipe pointed at the test assets and storage, without MLflow
        (`configs.NO_TRACKER` says why), plus `extra`."""
        train, evals = self.assets.data["copy"]
        return [
            f"model.path={self.assets.model}",
            f"data.train_files={train}",
            f"data.eval_files={evals}",
            f"storage.root={self.runs_root}",
            NO_TRACKER,
            *extra,
        ]


@pytest.fixture(scope="session")
def platform(assets):
    from ratchet.platform.client import Client
    from ratchet.platform.demo import start_worker_process, stop_worker_process, wait_until_serving
    from ratchet.platform.services import ServiceSettings, down, free_ports, temporal_address, up

    # Short path: Ray's unix socket paths must stay under 107 characters.
    state = Path(tempfile.mkdtemp(dir="/tmp", prefix="rt-"))
    t, ui, r = free_ports(3)
    settings = ServiceSettings(state_dir=state, temporal_port=t, temporal_ui_port=ui, ray_port=r, start_timeout_s=60.0)
    up(settings)
    # A killed worker stalls its workflow for the sticky timeout; keep it short in tests.
    os.environ["RATCHET_STICKY_TIMEOUT_S"] = "1"
    worker = start_worker_process(settings)
    wait_until_serving(settings, worker)  # its start-up sweep is over: test actors are safe
    client = Client.connect(temporal_address(settings))
    try:
        yield Platform(settings=settings, client=client, runs_root=state / "runs", assets=assets)
    finally:
        stop_worker_process(worker)
        down(settings)
        if not os.environ.get("RATCHET_KEEP_TEST_STATE"):  # keep logs for debugging when set
            shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_driver(platform):
    """This test process as a driver of the platform's Ray (namespace `ratchet`), for the
    tests that call the run's actors directly."""
    import ray

    from ratchet.platform.services import ray_address, ray_auth_env
    from ratchet.platform.services.ray_auth import APPLIED_VAR, RAY_AUTH_VARS
    from ratchet.platform.worker import connect_ray

    before = {k: os.environ.get(k) for k in (*RAY_AUTH_VARS, APPLIED_VAR)}
    connect_ray(ray_address(platform.settings), ray_auth_env(platform.settings))
    yield ray
    ray.shutdown()
    for k, v in before.items():  # later tests start Ray heads of their own
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
