"""Hugging Face model folders in the object store.

A model is saved to a local temporary folder with `save_pretrained` (safetensors), each
file is uploaded, and `manifest.json` (names, sizes, sha256: a `ratchet.storage.manifest`
of kind MODEL) is written last: a model folder without a manifest is incomplete and is
never loaded.

A remote model is cached per user (`local_paths.models_dir()`, private, mode 0700): it is
downloaded into a fresh `mkdtemp` folder next to the cache entry, every file is checked
against the manifest's sha256, and the folder is renamed into place in one step. Several
actors of a node (trainer, rollout, reward) asking at once each download, and the first
rename wins; the others find a verified folder and discard their copy. On every use the
cached folder is checked again against the store's current manifest: by sha256 for
models up to `VERIFY_SHA256_MAX_BYTES` (hashing runs at about 1.6 GB/s here: 3 ms for the
4 MB tiny model, 31 ms for 50 MB, so about 1.3 s at the limit), and above it by size plus
the (size, mtime) of each file recorded when it was verified, any change of which brings
a full sha256 check. A mismatch means a fresh download. Manifest entries must be plain
file names: a name such as `../evil` is refused before it becomes a path.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from ratchet.storage.object_store import ObjectStore
from ratchet.storage.manifest import MODEL, BadManifest, FileEntry, Manifest

from .local_paths import ensure_private_dir, models_dir

log = logging.getLogger(__name__)

MANIFEST = MODEL.file_name
STAMP = ".verified.json"  # (size, mtime_ns, sha256) of each file when it was last hashed
VERIFY_SHA256_MAX_BYTES = 2 << 30
STALE_DOWNLOAD_S = 3600.0  # a `.download-` folder older than this belongs to a killed process


class CorruptModel(ValueError):
    """A stored model's bytes, or its manifest, do not match what the manifest promises."""


def write_hf_folder(model, tokenizer, out: Path) -> None:
    """A model and its tokenizer as a local Hugging Face folder (safetensors, no manifest)."""
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def upload_hf_folder(local: Path, store: ObjectStore, key: str) -> str:
    """Upload a local model folder's files to `key`, then its manifest (last); the uri."""
    files = {}
    for path in sorted(local.iterdir()):
        data = path.read_bytes()
        store.put_bytes(f"{key}/{path.name}", data)
        files[path.name] = FileEntry.of_bytes(data)
    store.put_json(f"{key}/{MANIFEST}", Manifest(files).to_json(MODEL))
    return store.uri(key)


def save_hf(model, tokenizer, store: ObjectStore, key: str) -> str:
    """A model and its tokenizer as a model folder at `key` in `store`; the uri."""
    with tempfile.TemporaryDirectory(prefix="ratchet-hf-") as tmp:
        write_hf_folder(model, tokenizer, Path(tmp))
        return upload_hf_folder(Path(tmp), store, key)


def local_hf_path(uri: str, cache_dir: str | None = None) -> str:
    """A local folder holding the model at `uri`; remote models are downloaded once into a
    private cache, checked, and checked again on every use (see the module docstring)."""
    store = ObjectStore(uri)
    if store.protocol == "file":
        if Path(store.root).joinpath("config.json").is_file():
            return store.root
        raise FileNotFoundError(f"no Hugging Face model at {uri}")
    raw = store.get_bytes(MANIFEST)
    manifest = read_manifest(uri, raw)
    base = ensure_private_dir(cache_dir) if cache_dir else models_dir()
    target = base / hashlib.sha256(uri.encode()).hexdigest()[:32]
    if cached_ok(target, manifest):
        return str(target)
    _remove_stale_downloads(base)
    fresh = Path(tempfile.mkdtemp(prefix=".download-", dir=base))
    try:
        _download(store, uri, manifest, raw, fresh)
        _install(fresh, target, manifest)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)  # gone after a rename; a loser's copy otherwise
    return str(target)


def read_manifest(uri: str, raw: bytes) -> Manifest:
    """The manifest of the model at `uri`, every name a plain file name; CorruptModel else."""
    try:
        manifest = Manifest.parse(raw, MODEL)
    except BadManifest as exc:
        raise CorruptModel(f"{uri}/{MANIFEST}: not a usable model manifest: {exc}") from None
    for name in manifest.files:
        if name == STAMP or name.startswith(".download-"):
            raise CorruptModel(f"{uri}/{MANIFEST}: file name {name!r} is reserved for the model cache")
    return manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(1 << 20):
            digest.update(data)
    return digest.hexdigest()


def cached_ok(folder: Path, manifest: Manifest | Mapping[str, Any]) -> bool:
    """Whether `folder` holds exactly the bytes `manifest` (or its `files` object, as
    stored) describes (see the module docstring for how much is read)."""
    if not isinstance(manifest, Manifest):
        manifest = Manifest(Manifest.parse_files(manifest, MODEL))
    if not (folder / MANIFEST).is_file():
        return False
    try:
        stamp = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        stamp = {}
    full = manifest.total_bytes <= VERIFY_SHA256_MAX_BYTES
    for name, want in manifest.files.items():
        try:
            st = (folder / name).stat()
        except OSError:
            return False
        if manifest.problem(name, st.st_size):
            return False
        seen = stamp.get(name) if isinstance(stamp, dict) else None
        if not full and seen == [st.st_size, st.st_mtime_ns, want.sha256]:
            continue
        if manifest.problem(name, st.st_size, _sha256(folder / name)):
            log.warning("cached model file %s differs from its manifest; downloading the model again", folder / name)
            return False
    return True


def _download(store: ObjectStore, uri: str, manifest: Manifest, raw: bytes, out: Path) -> None:
    stamp = {}
    for name in manifest.files:
        t = store.get_file(name, out / name)  # streamed, sha256 computed on the way
        if manifest.problem(name, t.size, t.sha256):
            want = manifest.files[name]
            raise CorruptModel(
                f"{uri}/{name}: sha256 does not match the manifest (stored {t.size} bytes, {t.sha256[:12]}...; "
                f"manifest {want.size} bytes, {want.sha256[:12]}...); export the model again"
            )
        st = (out / name).stat()
        stamp[name] = [st.st_size, st.st_mtime_ns, t.sha256]
    (out / STAMP).write_text(json.dumps(stamp))
    (out / MANIFEST).write_bytes(raw)  # last: a folder without it is never used


def _install(fresh: Path, target: Path, manifest: Manifest) -> None:
    """Rename `fresh` into place atomically. When another process got there first with a
    good copy, keep theirs; a bad copy in the way is moved aside and removed first."""
    for _ in range(3):
        try:
            os.rename(fresh, target)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if cached_ok(target, manifest):
            return
        aside = Path(tempfile.mkdtemp(prefix=".download-stale-", dir=target.parent))
        try:
            os.rename(target, aside / "old")
        except FileNotFoundError:
            pass
        shutil.rmtree(aside, ignore_errors=True)
    raise OSError(f"could not put the downloaded model in place at {target}: it kept changing under this process")


def _remove_stale_downloads(base: Path) -> None:
    """Download folders of processes killed mid-download (never one in progress: those
    are younger than STALE_DOWNLOAD_S)."""
    cutoff = time.time() - STALE_DOWNLOAD_S
    for folder in base.glob(".download-*"):
        try:
            if folder.stat().st_mtime < cutoff:
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            continue
