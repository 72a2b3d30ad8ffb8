"""One manifest format for every folder committed as a whole: a checkpoint and a model.

A manifest lists each file of the folder with its size and sha256, and is written after
the last file: a folder without one is incomplete and is never read (docs/design.md, rule 3).
`Manifest` is that list plus whatever else the writer records at the top level (a
checkpoint's format tag, name, step, timestamp and caller's metadata). It is built from
the bytes or transfers of the uploaded files, serialised for one `Kind`, parsed with the
file names checked (a name that could leave the folder is refused before it becomes an
object key or a local path), and checks a stored file's size and sha256.

Two kinds, one format. They differ only where older readers would notice:

| kind | file | a file's length is stored as | names |
| --- | --- | --- | --- |
| `CHECKPOINT` | `checkpoints/<name>/MANIFEST.json` | `"size"` | relative paths (`trainer/…`, `hf/…`) |
| `MODEL` | `<model folder>/manifest.json` | `"bytes"` | plain file names |

Both are written exactly as before: an older ratchet (a worker of the previous release,
a resume with an older install) reads `"bytes"` from a model manifest and checks a
checkpoint manifest's `format` and `"size"`, so renaming either key would make it refuse
new folders. `Manifest.parse` accepts either key in either kind, so the writers can move
to one key once no older reader is left; that is a change of `Kind.size_key` alone.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from .keys import UnsafeKey, check_file_name, check_key
from .layout import RunLayout

SIZE_KEYS = ("size", "bytes")  # a file's length, as the two kinds store it


class BadManifest(ValueError):
    """A manifest that is not valid JSON, lacks its file list, or names a file that could
    leave its folder. `problems` lists each finding."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class Kind:
    """How one kind of folder stores its manifest (see the module docstring's table)."""

    file_name: str  # the manifest's own name inside the folder
    size_key: str  # the key a file's length is written under
    folder: str  # "checkpoint" or "model", in messages
    flat: bool  # True: plain file names only; False: relative paths


CHECKPOINT = Kind(RunLayout.CHECKPOINT_MANIFEST, "size", "checkpoint", flat=False)
MODEL = Kind(RunLayout.MODEL_MANIFEST, "bytes", "model", flat=True)


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str

    @classmethod
    def of_bytes(cls, data: bytes) -> "FileEntry":
        return cls(len(data), hashlib.sha256(data).hexdigest())


@dataclass(frozen=True)
class Manifest:
    """`files`: each file's relative name -> its size and sha256; `fields`: the other
    top-level keys of the manifest, kept as they were read or given."""

    files: Mapping[str, FileEntry]
    fields: Mapping[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files.values())

    # ------------------------------------------------------------------ write

    def to_json(self, kind: Kind) -> dict[str, Any]:
        """The manifest as `kind` stores it (a JSON object)."""
        files = {rel: {kind.size_key: e.size, "sha256": e.sha256} for rel, e in self.files.items()}
        return {**self.fields, "files": files}

    def files_json(self, kind: Kind) -> dict[str, dict[str, Any]]:
        """Just the file list, as `kind` stores it."""
        return self.to_json(kind)["files"]

    # ------------------------------------------------------------------ read

    @classmethod
    def parse(cls, raw: bytes | str | Mapping[str, Any], kind: Kind) -> "Manifest":
        """A stored manifest (its bytes, or the decoded object), of either stored shape;
        BadManifest naming every problem found."""
        if isinstance(raw, (bytes, str)):
            try:
                raw = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                raise BadManifest([f"{kind.file_name} is not valid JSON ({exc})"]) from None
        if not isinstance(raw, Mapping):
            raise BadManifest([f"{kind.file_name} is not a JSON object"])
        if "files" not in raw:
            raise BadManifest([f"{kind.file_name} lacks a field ('files')"])
        files = cls.parse_files(raw["files"], kind)
        return cls(files, {k: v for k, v in raw.items() if k != "files"})

    @staticmethod
    def parse_files(files: object, kind: Kind) -> dict[str, FileEntry]:
        """A manifest's `files` object, each name checked against `kind`'s rule."""
        if not isinstance(files, Mapping):
            raise BadManifest([f"{kind.file_name}: 'files' is not a mapping"])
        out, problems = {}, []
        for rel, want in files.items():
            why = _name_problem(rel, kind)
            if why:
                problems.append(why)
                continue
            entry = _entry(want)
            if entry is None:
                problems.append(f"{rel}: manifest entry lacks an integer 'size' (or 'bytes') and a 'sha256'")
                continue
            out[rel] = entry
        if problems:
            raise BadManifest(problems)
        return out

    # ------------------------------------------------------------------ verify

    def problem(self, rel: str, size: int, sha256: str | None = None) -> str | None:
        """What is wrong with stored file `rel` of `size` bytes (and `sha256`, when it was
        computed) against this manifest; None when it matches."""
        want = self.files.get(rel)
        if want is None:
            return f"{rel}: not in the manifest"
        if size != want.size:
            return f"{rel}: {size} bytes, manifest says {want.size}"
        if sha256 is not None and sha256 != want.sha256:
            return f"{rel}: sha256 {sha256[:12]}... differs from the manifest's {want.sha256[:12]}..."
        return None

    def problem_of_bytes(self, rel: str, data: bytes) -> str | None:
        return self.problem(rel, len(data), hashlib.sha256(data).hexdigest())


def _name_problem(rel: object, kind: Kind) -> str | None:
    try:
        if kind.flat:
            check_file_name(rel, f"{kind.folder} manifest file name")
        else:
            check_key(rel, allow_empty=False, what="manifest file name")
    except UnsafeKey as exc:
        return f"manifest path {rel!r} is refused: it could point outside the {kind.folder} folder ({exc})"
    if rel == kind.file_name:
        return f"manifest path {rel!r} is the manifest itself"
    return None


def _entry(want: object) -> FileEntry | None:
    if not isinstance(want, Mapping) or not isinstance(want.get("sha256"), str):
        return None
    sizes = [want[k] for k in SIZE_KEYS if k in want]
    if len(sizes) < 1 or len(set(map(repr, sizes))) != 1:  # none, or two that disagree
        return None
    size = sizes[0]
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return None
    return FileEntry(size, want["sha256"])


__all__ = ["CHECKPOINT", "MODEL", "BadManifest", "FileEntry", "Kind", "Manifest"]
