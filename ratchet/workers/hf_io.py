"""Hugging Face model folders in the object store.

A model is saved to a local temporary folder with `save_pretrained` (safetensors), each
file is uploaded, and `manifest.json` (names, sizes, sha256) is written last: a model
folder without a manifest is incomplete and is never loaded.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from ratchet.storage import ObjectStore

MANIFEST = "manifest.json"


def save_hf(model, tokenizer, store: ObjectStore, key: str) -> str:
    files = {}
    with tempfile.TemporaryDirectory(prefix="ratchet-hf-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for path in sorted(Path(tmp).iterdir()):
            data = path.read_bytes()
            store.put_bytes(f"{key}/{path.name}", data)
            files[path.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    store.put_json(f"{key}/{MANIFEST}", {"files": files})
    return store.uri(key)


def local_hf_path(uri: str, cache_dir: str | None = None) -> str:
    """A local folder holding the model at `uri`; remote models are downloaded once and checked."""
    store = ObjectStore(uri)
    if store.protocol == "file":
        if Path(store.root).joinpath("config.json").is_file():
            return store.root
        raise FileNotFoundError(f"no Hugging Face model at {uri}")
    manifest = store.get_json(MANIFEST)
    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    target = Path(cache_dir or tempfile.gettempdir()) / "ratchet-models" / digest
    if not (target / MANIFEST).is_file():
        target.mkdir(parents=True, exist_ok=True)
        for name, info in manifest["files"].items():
            data = store.get_bytes(name)
            if hashlib.sha256(data).hexdigest() != info["sha256"]:
                raise ValueError(f"{uri}/{name}: sha256 does not match the manifest")
            (target / name).write_bytes(data)
        (target / MANIFEST).write_text(store.get_bytes(MANIFEST).decode())
    return str(target)
