"""Rollout batches and their scores, as safetensors plus JSON metadata.

Keys derive from the batch index alone (`batches/step-000012/rollout.safetensors`, built by
`RunLayout.batch_part`; the folder name says `step-` as older versions wrote it), so a retried
rollout or scoring activity overwrites its own output instead of adding a second copy.
Per-sample strings (data source, ground truth, extra info) ride in the safetensors header
as JSON; nothing here is a pickle.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .keys import check_file_name
from .layout import RunLayout
from .object_store import ObjectStore


def pack_tensors(tensors: dict[str, torch.Tensor], meta: dict) -> bytes:
    # safetensors refuses tensors that share memory (e.g. advantages that are also the returns).
    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        v = v.contiguous()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return st_save(out, metadata={"meta": json.dumps(meta)})


def unpack_tensors(data: bytes) -> tuple[dict[str, torch.Tensor], dict]:
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    meta = json.loads(header.get("__metadata__", {}).get("meta", "{}"))
    return st_load(data), meta


class BatchStore:
    """The batches of one run; `store` is rooted at the run's folder. `kind` separates
    training batches from evaluation batches (`RunLayout.BATCHES`, `RunLayout.EVALS`)."""

    def __init__(self, store: ObjectStore, kind: str = RunLayout.BATCHES):
        self.store = store
        self.kind = check_file_name(kind, "batch kind")

    def batch_key(self, batch_index: int) -> str:
        """The folder of batch `batch_index` (`batches/step-000012`)."""
        return RunLayout.batch_step(self.kind, batch_index)

    def key(self, batch_index: int, name: str) -> str:
        """The key of part `name` of batch `batch_index` (`batches/step-000012/values.safetensors`)."""
        # one segment each: a name never reaches another batch's folder or above the run
        return RunLayout.batch_part(self.kind, batch_index, check_file_name(name, "batch part name"))

    def write(self, batch_index: int, name: str, tensors: dict[str, torch.Tensor], meta: dict) -> str:
        return self.store.put_bytes(self.key(batch_index, name), pack_tensors(tensors, meta))

    def read(self, batch_index: int, name: str) -> tuple[dict[str, torch.Tensor], dict]:
        return unpack_tensors(self.store.get_bytes(self.key(batch_index, name)))

    def has(self, batch_index: int, name: str) -> bool:
        return self.store.exists(self.key(batch_index, name))
