"""A small key-value view of an fsspec filesystem, rooted at a URL.

Writes go to a temporary key first and are then moved into place, so a reader never sees
a half-written object and a retried writer simply overwrites its own output (DESIGN.md,
rule 2). Local folders and any fsspec protocol work; `file://` is the default.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import fsspec


class ObjectStore:
    def __init__(self, root: str):
        self.fs, path = fsspec.core.url_to_fs(root)
        self.root = path.rstrip("/")
        self.protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]

    @property
    def url(self) -> str:
        return self.root if self.protocol == "file" else f"{self.protocol}://{self.root}"

    def child(self, key: str) -> "ObjectStore":
        return ObjectStore(self.uri(key))

    def path(self, key: str) -> str:
        return f"{self.root}/{key.lstrip('/')}"

    def uri(self, key: str) -> str:
        path = self.path(key)
        return path if self.protocol == "file" else f"{self.protocol}://{path}"

    def put_bytes(self, key: str, data: bytes) -> str:
        final = self.path(key)
        tmp = f"{final}.tmp-{uuid.uuid4().hex}"
        self.fs.makedirs(final.rpartition("/")[0], exist_ok=True)
        try:
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            self.fs.mv(tmp, final)
        except BaseException:
            # Leave nothing behind: the previous object (if any) is still the visible one.
            try:
                self.fs.rm(tmp)
            except (FileNotFoundError, OSError):
                pass
            raise
        return self.uri(key)

    def get_bytes(self, key: str) -> bytes:
        with self.fs.open(self.path(key), "rb") as f:
            return f.read()

    def put_json(self, key: str, obj: Any) -> str:
        return self.put_bytes(key, json.dumps(obj, indent=1, sort_keys=True).encode())

    def get_json(self, key: str) -> Any:
        return json.loads(self.get_bytes(key))

    def exists(self, key: str) -> bool:
        return self.fs.exists(self.path(key))

    def list(self, prefix: str = "") -> list[str]:
        """Keys under `prefix`, relative to the root, sorted."""
        base = self.path(prefix).rstrip("/")
        if not self.fs.exists(base):
            return []
        keys = [p[len(self.root) + 1 :] for p in self.fs.find(base)]
        return sorted(k for k in keys if ".tmp-" not in k)

    def delete(self, key: str) -> None:
        path = self.path(key)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)
