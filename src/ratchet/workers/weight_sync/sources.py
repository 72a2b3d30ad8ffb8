"""Where a receiver's weights come from: one interface (`WeightSource`) over weights in
memory, gathered in-process, read from safetensors files, or streamed bucket by bucket
from the trainer (ray_transport.py), so the rollout worker loads them all alike.

A source is consumed once. Its manifest comes first (names and sizes, before any
weight), so a receiver refuses a mismatch before it touches its engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Mapping

import numpy as np

from .buckets import Manifest, TensorSpec, WeightBucket, decode, gather_buckets, mapping_manifest, numpy_dtype_name


class WeightSource:
    """Buckets of one policy version, in manifest order. Subclasses give `manifest` and
    `_buckets`; this class counts what was received and tells whether any was."""

    nbytes: int = 0  # wire bytes received so far
    buckets_received: int = 0

    def manifest(self) -> Manifest:
        raise NotImplementedError

    def _buckets(self) -> Iterator[WeightBucket]:
        raise NotImplementedError

    def pairs(self) -> Iterator[tuple[str, np.ndarray]]:
        """(name, array) pairs for `Engine.load_weights`, tied aliases included."""
        return pairs(self.buckets(), self.manifest().aliases)

    def buckets(self) -> Iterator[WeightBucket]:
        for bucket in self._buckets():
            self.nbytes += bucket.nbytes
            self.buckets_received += 1
            yield bucket

    @property
    def started(self) -> bool:
        """Whether any weight was handed out (a receiver that fails after this point holds
        a mix of two versions)."""
        return self.buckets_received > 0

    def close(self, error: str | None = None) -> None:
        """The receiver stops here (done, or failed with `error`): a producer waiting for
        it may go on. Nothing to do for sources in memory."""


def pairs(buckets: Iterable[WeightBucket], aliases: Iterable[tuple[str, str]] = ()) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) pairs for `Engine.load_weights`, one bucket held at a time; a tied
    weight's array is handed again under each alias (no bytes sent for it)."""
    also: dict[str, list[str]] = {}
    for alias, name in aliases:
        also.setdefault(name, []).append(alias)
    for bucket in buckets:
        for name, array in bucket.pairs():
            yield name, array
            for alias in also.get(name, ()):
                yield alias, array
        del bucket  # the next bucket arrives only after this one is let go


class MappingSource(WeightSource):
    """Weights whole in memory (a dict of arrays): tests, and the old full-state path."""

    def __init__(self, weights: Mapping[str, np.ndarray], version: int = 0):
        self.weights = {k: np.asarray(v) for k, v in weights.items()}
        self._manifest = mapping_manifest(self.weights, version)

    def manifest(self) -> Manifest:
        return self._manifest

    def _buckets(self) -> Iterator[WeightBucket]:
        yield WeightBucket(index=0, specs=self._manifest.specs, arrays=list(self.weights.values()))


class ModelSource(WeightSource):
    """A model in this process (the in-process loop): each bucket gathered as it is sent."""

    def __init__(self, entries, manifest: Manifest):
        self.entries, self._manifest = entries, manifest

    def manifest(self) -> Manifest:
        return self._manifest

    def _buckets(self) -> Iterator[WeightBucket]:
        return gather_buckets(self.entries, self._manifest)


class BucketListSource(WeightSource):
    """Buckets already at hand (tests, and a stand-in for a transport)."""

    def __init__(self, manifest: Manifest, buckets: Iterable[WeightBucket]):
        self._manifest, self._items = manifest, buckets

    def manifest(self) -> Manifest:
        return self._manifest

    def _buckets(self) -> Iterator[WeightBucket]:
        yield from self._items


class SafetensorsSource(WeightSource):
    """safetensors files (a Hugging Face folder, or a policy-log file), one tensor read at a
    time: serving a logged version costs one tensor of memory, not a model copy."""

    def __init__(self, files: Iterable[str | Path], version: int = 0, aliases: Iterable[tuple[str, str]] = ()):
        import json

        from safetensors import safe_open

        self.files = [str(f) for f in files]
        specs = []
        aliases = list(aliases)
        for f in self.files:
            with safe_open(f, framework="pt") as st:
                aliases += [tuple(a) for a in json.loads((st.metadata() or {}).get(ALIASES_KEY, "[]"))]
                for k in st.keys():
                    sl = st.get_slice(k)
                    specs.append(TensorSpec(k, _st_dtype(sl.get_dtype()), tuple(sl.get_shape())))
        present = {s.name for s in specs}
        aliases = tuple(dict.fromkeys((a, n) for a, n in aliases if a not in present and n in present))
        self._manifest = Manifest(
            version=version, specs=tuple(specs), buckets=tuple((i,) for i in range(len(specs))), bound_bytes=0, aliases=aliases
        )

    def manifest(self) -> Manifest:
        return self._manifest

    def _buckets(self) -> Iterator[WeightBucket]:
        import torch
        from safetensors import safe_open

        index = 0
        for f in self.files:
            with safe_open(f, framework="pt") as st:
                for k in st.keys():
                    spec = self._manifest.specs[index]
                    t = st.get_tensor(k)
                    array = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
                    yield WeightBucket(index=index, specs=(spec,), arrays=[array])
                    index += 1


# The safetensors metadata entry that keeps a logged version's tied aliases.
ALIASES_KEY = "ratchet.aliases"

_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
              "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}  # fmt: skip
_ST_CODES = {v: k for k, v in _ST_DTYPES.items()}


def _st_dtype(code: str) -> str:
    return _ST_DTYPES[code]


class SafetensorsWriter:
    """Writes a manifest's tensors into one safetensors file as they stream past (the
    header is laid out from the manifest first), so logging a synced version needs no
    copy of the model in memory."""

    def __init__(self, manifest: Manifest, path: str | Path):
        import json

        header: dict = {"__metadata__": {ALIASES_KEY: json.dumps([list(a) for a in manifest.aliases])}}
        offset = 0
        for spec in manifest.specs:
            header[spec.name] = {"dtype": _ST_CODES[spec.dtype], "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = Path(path)
        self._file = open(self.path, "wb")
        self._file.write(len(raw).to_bytes(8, "little") + raw)
        self._expected = [s.name for s in manifest.specs]
        self._written = 0

    def tee(self, buckets: Iterable[WeightBucket]) -> Iterator[WeightBucket]:
        for bucket in buckets:
            for spec, array in zip(bucket.specs, bucket.arrays):
                if spec.name != self._expected[self._written]:
                    raise ValueError(f"stream order: got {spec.name}, expected {self._expected[self._written]}")
                if not isinstance(array, np.ndarray):  # a device transport's tensor: its bytes on the host
                    from .buckets import to_wire

                    array = to_wire(array, spec)
                self._file.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
                self._written += 1
            yield bucket

    def finish(self) -> Path:
        self._file.close()
        if self._written != len(self._expected):
            raise ValueError(f"the stream ended after {self._written} of {len(self._expected)} tensors")
        return self.path

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


def as_source(weights, version: int | None = None) -> WeightSource:
    """A `WeightSource` as is; a mapping of arrays wrapped."""
    if isinstance(weights, WeightSource):
        return weights
    if isinstance(weights, Mapping):
        return MappingSource(weights, version or 0)
    raise TypeError(f"cannot load weights from a {type(weights).__name__}: pass a WeightSource or a dict of arrays")


__all__ = [
    "BucketListSource", "MappingSource", "ModelSource", "SafetensorsSource", "SafetensorsWriter", "WeightSource", "as_source",
    "decode", "numpy_dtype_name", "pairs",
]  # fmt: skip
