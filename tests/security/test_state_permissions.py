"""The state folder and everything ratchet creates in it are its user's alone.

Before: with the usual umask 022 the state folder was 0755, and services.json, the lock,
the logs, the registry and MLflow databases, runs/ (weights, prompts, responses) and what
the services wrote (Temporal's database, Ray's session files) were world-readable. Now the
state folder is created 0700 and checked like the model cache (refused when another user
owns or can write it), ratchet creates its own files 0600 and folders 0700 whatever the
umask, and the services it starts run with umask 077. Every test here runs under umask
022, as a user's shell does. The walk over a folder that real services wrote is in
test_ray_auth.py (its `head` fixture already runs `up()`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import stat
from pathlib import Path

import pytest

from ratchet.platform.services import ServiceError, ServiceSettings, processes
from ratchet.platform.services.state import LOCK_FILE, locked, save_state
from ratchet.storage.object_store import ObjectStore


@pytest.fixture(autouse=True)
def usual_umask():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def open_to_others(root: Path) -> list[str]:
    """Every file or folder under `root` (itself included) with a group or other bit,
    as 'mode path'; links are skipped (their own mode means nothing)."""
    found = []
    for path in [root, *root.rglob("*")]:
        st = os.lstat(path)
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
            found.append(f"{stat.S_IMODE(st.st_mode):o} {path}")
    return found


@pytest.fixture
def state(tmp_path) -> ServiceSettings:
    parent = tmp_path / "shared"
    parent.mkdir(mode=0o755)
    os.chmod(parent, 0o755)
    return ServiceSettings(state_dir=parent / "state")


def test_state_folder_services_json_and_lock_are_private(state):
    with locked(state):
        save_state(state, {"services": {}})
    assert stat.S_IMODE(os.stat(state.state_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(state.state_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(state.state_dir / LOCK_FILE).st_mode) == 0o600
    assert open_to_others(state.state_dir) == []


def test_state_folder_of_before_is_narrowed_and_one_others_can_write_is_refused(state):
    state.state_dir.mkdir(mode=0o755)
    os.chmod(state.state_dir, 0o755)  # what an older ratchet made
    with locked(state):
        pass
    assert stat.S_IMODE(os.stat(state.state_dir).st_mode) == 0o700
    os.chmod(state.state_dir, 0o777)
    with pytest.raises(ServiceError, match=r"state folder: .*writable by other users \(mode 777\).*RATCHET_STATE_DIR"):
        with locked(state):
            pass
    assert not state.state_file.exists()
    os.chmod(state.state_dir, 0o700)
    if os.getuid() == 0:  # only root can give a folder away
        os.chown(state.state_dir, 12345, -1)
        with pytest.raises(ServiceError, match="owned by uid 12345"):
            with locked(state):
                pass
        os.chown(state.state_dir, 0, -1)


def test_services_start_with_a_private_log_and_umask(state):
    """What Temporal, Ray, MLflow and the node workers create is private: they inherit
    umask 077 from `spawn_logged`, and their log is 0600 in a 0700 folder."""
    with locked(state):
        pass
    made = state.state_dir / "made"
    proc = processes.spawn_logged(["sh", "-c", f"echo hi > {made}.txt && mkdir {made}"], state.logs_dir / "x.log", state.state_dir, "now")
    assert proc.wait(timeout=30) == 0
    assert stat.S_IMODE(os.stat(f"{made}.txt").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(state.logs_dir / "x.log").st_mode) == 0o600
    assert open_to_others(state.state_dir) == []


def test_local_object_store_writes_private_files_and_folders(tmp_path):
    root = tmp_path / "runs"
    store = ObjectStore(str(root))
    store.put_bytes("run-1/batches/000001/rollout.safetensors", b"weights")
    store.put_bytes("run-1/run.json", b"{}")
    got = store.get_file("run-1/run.json", tmp_path / "down" / "sub" / "run.json")
    assert got.size == 2
    assert open_to_others(root) == []
    assert open_to_others(tmp_path / "down") == []
    assert stat.S_IMODE(os.stat(root / "run-1" / "run.json").st_mode) == 0o600


def test_registry_database_is_private(tmp_path):
    from ratchet.registry.db import Registry

    folder = tmp_path / "state"
    with Registry.open(f"sqlite:///{folder / 'registry.db'}"):
        pass
    assert open_to_others(folder) == []
    assert (folder / "registry.db").stat().st_size > 0  # migrated: a real database, not the empty file


def test_mlflow_store_is_private(tmp_path):
    from ratchet.tracking.mlflow_tracker import create_sqlite_store

    create_sqlite_store(tmp_path / "state" / "mlflow.db")
    assert open_to_others(tmp_path / "state") == []


def test_make_private_dirs_makes_every_level_0700(tmp_path):
    from ratchet.private_paths import ensure_private_dir, make_private_dirs

    leaf = make_private_dirs(tmp_path / "a" / "b" / "c")
    assert leaf.is_dir() and open_to_others(tmp_path / "a") == []
    with pytest.raises(PermissionError, match="fix it"):
        os.chmod(leaf, 0o770)
        ensure_private_dir(leaf, "fix it")


def test_state_under_a_long_path_puts_ray_temp_in_an_unpredictable_private_folder(tmp_path):
    """The fallback was `/tmp/ratchet-<uid>-<sha1 of the state path>`, taken with
    mkdir(exist_ok=True): another user could compute it and create it first (and Ray makes
    its temp folder 0777). Now Ray's folder is `r` inside a private folder whose name also
    hashes a random key kept in the (private) state folder, and that folder is checked."""
    import hashlib

    from ratchet.platform.services import ray_head

    settings = ServiceSettings(state_dir=tmp_path / ("x" * 80))
    old_name = Path("/tmp") / f"ratchet-{os.getuid()}-{hashlib.sha1(str(settings.state_dir).encode()).hexdigest()[:10]}"
    temp = ray_head.temp_dir(settings)
    private = temp.parent
    try:
        assert temp.name == "r" and private != old_name and private.parent == Path("/tmp")
        assert len(str(temp)) <= ray_head.RAY_TEMP_DIR_MAX_LEN
        assert ray_head.temp_dir(settings) == temp  # stable for this state folder
        other = ServiceSettings(state_dir=tmp_path / ("y" * 80))
        assert ray_head.temp_dir(other).parent != private
        os.rmdir(ray_head.temp_dir(other).parent)
        key = settings.state_dir / ray_head.TEMP_KEY_FILE
        assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
        assert stat.S_IMODE(os.stat(private).st_mode) == 0o700 and os.stat(private).st_uid == os.getuid()
        os.chmod(private, 0o777)  # someone else could have put sockets or files there
        with pytest.raises(ServiceError, match=r"Ray temp folder: .*writable by other users"):
            ray_head.temp_dir(settings)
        os.chmod(private, 0o700)
        if os.getuid() == 0:
            os.chown(private, 12345, -1)
            with pytest.raises(ServiceError, match="owned by uid 12345"):
                ray_head.temp_dir(settings)
            os.chown(private, 0, -1)
        os.rmdir(private)
        private.symlink_to(tmp_path)
        with pytest.raises(ServiceError, match="link"):
            ray_head.temp_dir(settings)
    finally:
        if private.is_symlink():
            private.unlink()
        elif private.exists():
            os.rmdir(private)
    short = Path(tempfile.mkdtemp(dir="/tmp", prefix="rt-"))
    try:
        assert ray_head.temp_dir(ServiceSettings(state_dir=short)) == short / "ray"
        assert stat.S_IMODE(os.stat(short).st_mode) == 0o700
    finally:
        shutil.rmtree(short)


def test_spawned_process_really_had_umask_077(state):
    with locked(state):
        pass
    proc = processes.spawn_logged(["sh", "-c", "umask"], state.logs_dir / "u.log", state.state_dir, "now")
    assert proc.wait(timeout=30) == 0
    assert (state.logs_dir / "u.log").read_text().splitlines()[-1].strip() == "0077"
