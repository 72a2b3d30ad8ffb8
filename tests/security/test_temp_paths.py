"""Local caches and staging folders are private to the user, written atomically, and
checked on every use.

Before: `<tmp>/ratchet-models/<sha>` and `<tmp>/ratchet-staging/<run>/<name>` had fixed
names in the shared temp folder (anyone could create them first or read them), the model
was written file by file where three actors read it, a cached folder was trusted forever,
and a manifest could name `../evil`. Now: a 0700 base folder owned by the user (a foreign
or group/world-writable one is refused), downloads into a mkdtemp sibling renamed into
place, re-verification on each use, and manifest names that must be plain file names.
The remote model lives on the moto S3 server (s3://).
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from ratchet.ids import InvalidId
from ratchet.storage.object_store import ObjectStore
from ratchet.workers import hf_io
from ratchet.workers.hf_io import MANIFEST, CorruptModel, local_hf_path, save_hf
from ratchet.workers.local_paths import ENV_VAR, UnsafeLocalDir, models_dir, private_base, staging_dir
from tests.s3_server import moto_server, s3_env  # noqa: F401


@pytest.fixture
def base(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "private" / "ratchet"
    monkeypatch.setenv(ENV_VAR, str(path))
    return path


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_base_folder_is_private(base):
    assert private_base() == base and mode(base) == 0o700 and os.stat(base).st_uid == os.getuid()
    s = staging_dir("run-1", "step-00000002")
    assert s == base / "staging" / "run-1" / "step-00000002"
    assert mode(base / "staging") == 0o700 and mode(base / "staging" / "run-1") == 0o700
    assert models_dir() == base / "models" and mode(base / "models") == 0o700
    for bad_run, bad_name in [("../x", "step-1"), ("run-1", "../../x"), ("a/b", "c"), ("run-1", "")]:
        with pytest.raises(InvalidId):
            staging_dir(bad_run, bad_name)


def test_empty_staging_folders_of_old_runs_are_pruned(base):
    old_empty = staging_dir("old-run", "step-1").parent
    busy = staging_dir("busy-run", "step-1")
    busy.mkdir()
    (busy / "shard.bin").write_bytes(b"x")
    two_hours_ago = time.time() - 7200
    for folder in (old_empty, busy.parent):
        os.utime(folder, (two_hours_ago, two_hours_ago))
    staging_dir("new-run", "step-1")
    assert sorted(p.name for p in (base / "staging").iterdir()) == ["busy-run", "new-run"]


def test_default_base_is_under_the_home_cache(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert private_base() == tmp_path / "home" / ".cache" / "ratchet"
    assert mode(tmp_path / "home" / ".cache" / "ratchet") == 0o700
    assert not staging_dir("r", "s").is_relative_to("/tmp/ratchet-staging")


def test_unwritable_home_falls_back_to_a_private_mkdtemp(tmp_path, monkeypatch):
    from ratchet.workers import local_paths

    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    (tmp_path / "home").write_text("not a folder")  # ~/.cache cannot be made
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(local_paths, "_fallback", None)
    base = private_base()
    assert base.name.startswith("ratchet-") and mode(base) == 0o700 and private_base() == base
    os.rmdir(base)


def test_world_writable_or_linked_base_is_refused(base, tmp_path, monkeypatch):
    base.mkdir(parents=True)
    os.chmod(base, 0o777)
    (base / "planted").write_text("someone else's file")
    with pytest.raises(UnsafeLocalDir, match="writable by other users"):
        private_base()
    with pytest.raises(UnsafeLocalDir):
        staging_dir("run-1", "step-1")
    os.chmod(base, 0o755)  # readable by others, writable only by us: narrowed, then used
    assert private_base() == base and mode(base) == 0o700
    link = tmp_path / "link"
    link.symlink_to(base)
    monkeypatch.setenv(ENV_VAR, str(link))
    with pytest.raises(UnsafeLocalDir, match="link"):
        private_base()


@pytest.mark.skipif(os.getuid() != 0, reason="creating a folder owned by another user needs root")
def test_base_owned_by_another_user_is_refused(base):
    base.mkdir(parents=True, mode=0o700)
    os.chown(base, 12345, 12345)
    with pytest.raises(UnsafeLocalDir, match="owned by uid 12345"):
        private_base()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ratchet.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.fixture
def remote_model(s3_env, tiny) -> tuple[str, ObjectStore]:
    store = ObjectStore(f"s3://{s3_env.bucket}/run", retry_timeout_s=5, retry_initial_s=0.05, retry_max_s=0.2)
    return save_hf(*tiny, store, "warmup/model"), store


def entries(base: Path) -> list[str]:
    return sorted(p.name for p in (base / "models").iterdir())


def test_concurrent_downloads_end_with_one_verified_folder(base, remote_model, monkeypatch):
    uri, store = remote_model
    downloads = []
    real = hf_io._download
    start = threading.Barrier(3)

    def counted(*args):
        downloads.append(args[-1])
        return real(*args)

    monkeypatch.setattr(hf_io, "_download", counted)
    results, errors = [], []

    def worker():
        start.wait()
        try:
            results.append(local_hf_path(uri))
        except Exception as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(results)) == 1
    folder = Path(results[0])
    assert folder.parent == base / "models" and entries(base) == [folder.name]  # no download folder left
    assert 1 <= len(downloads) <= 3 and all(not d.exists() for d in downloads)  # losers discarded theirs
    manifest = json.loads((folder / MANIFEST).read_text())
    assert hf_io.cached_ok(folder, manifest["files"])
    for name in manifest["files"]:
        assert (folder / name).read_bytes() == store.get_bytes(f"warmup/model/{name}")
    downloads.clear()
    assert local_hf_path(uri) == str(folder) and downloads == []  # cached: verified, not fetched again


def test_corrupted_cache_is_detected_and_downloaded_again(base, remote_model):
    uri, store = remote_model
    folder = Path(local_hf_path(uri))
    original = (folder / "config.json").read_bytes()
    flipped = bytes([original[0] ^ 0x01]) + original[1:]  # same size, other bytes
    (folder / "config.json").write_bytes(flipped)
    assert local_hf_path(uri) == str(folder)
    assert (folder / "config.json").read_bytes() == original
    (folder / "model.safetensors").unlink()  # a missing file too
    assert local_hf_path(uri) == str(folder) and (folder / "model.safetensors").is_file()
    assert entries(base) == [folder.name]


def test_manifest_names_must_be_plain_file_names(base, remote_model, tmp_path):
    uri, store = remote_model
    good = store.get_json(f"warmup/model/{MANIFEST}")
    entry = next(iter(good["files"].values()))
    for evil in ["../evil", "../../evil", "/tmp/evil", "sub/evil", "..", "a\\evil", MANIFEST]:
        store.put_json(f"warmup/model/{MANIFEST}", {"files": {evil: entry}})
        with pytest.raises(CorruptModel, match="manifest"):
            local_hf_path(uri)
    assert not (base / "evil").exists() and not (base.parent / "evil").exists()
    assert not any(p.name == "evil" for p in tmp_path.rglob("*"))
    assert not (base / "models").exists() or entries(base) == []
