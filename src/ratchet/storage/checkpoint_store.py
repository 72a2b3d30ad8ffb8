"""Checkpoints in object storage: folders of files committed by a manifest.

`checkpoints/{name}/` holds the files of a local checkpoint folder (relative paths kept)
and `checkpoints/{name}/MANIFEST.json` (a `manifest.Manifest` of kind CHECKPOINT), written
last, with each file's size and sha256, the caller's metadata and a timestamp. The keys
are `RunLayout`'s. A checkpoint without a manifest does not exist
(docs/design.md, rule 3): a writer that dies mid-upload leaves only invisible leftovers, which
`apply_retention` removes later. Readers that must not trust storage blindly (a restore
after a crash) use `latest()` / `download(verify=True)`, which check every byte against the
manifest and fall back to the previous good checkpoint.

One writer commits a local folder with `commit`. A checkpoint written from several nodes
(the trainer ranks, each with its own disk) is committed in three parts: the sealing
writer `begin`s (which says where this attempt writes), then every writer `upload`s its own
folder there, and once all have, the sealing writer `seal`s with every writer's file list:
the stored bytes are read back and checked against the hashes the writers computed as they
sent them, and only then is the manifest, still written last, put in place.

A retry never unmakes a committed checkpoint. The first attempt at a name writes its files
at `checkpoints/{name}/{rel}` (format `ratchet-checkpoint/1`, the layout every ratchet
reads). When a manifest (or a retired one) is already there, the new attempt writes under
`checkpoints/{name}/attempt-1/{rel}` (or `attempt-2`, whichever the committed one does not
use) instead, and its manifest (format `ratchet-checkpoint/2`, naming the attempt folder in
`"attempt"`) replaces the old one in one atomic put: until then readers see the old
checkpoint whole; after, the new one, and the old files are deleted. Readers resolve a file's key from the manifest
(`CheckpointInfo.attempt`), so both layouts read the same.

Over 500 lines, one job: the checkpoint format. Writing (begin, upload, seal, commit),
reading (latest, newest_good, download, read_files) and retention all resolve the same
layout, manifest and attempt folders, and must change together; split apart, each half
would re-derive the other's key rules.
"""

from __future__ import annotations

import builtins
import enum
import json
import logging
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from ratchet.ids import check_id, is_valid_id

from .keys import check_key
from .layout import RunLayout
from .manifest import CHECKPOINT, BadManifest, FileEntry, Manifest
from .object_store import LEFTOVER_AGE_S, ObjectStore

T = TypeVar("T")

log = logging.getLogger(__name__)


class _Failed(enum.Enum):
    FAILED = "failed"


_FAILED = _Failed.FAILED  # what `_tidy` returns for a step of retention that failed

MANIFEST = RunLayout.CHECKPOINT_MANIFEST
RETIRED = RunLayout.CHECKPOINT_RETIRED  # a retired checkpoint's manifest (`retire`)
FORMAT = "ratchet-checkpoint/1"  # files at checkpoints/{name}/{rel}
FORMAT_ATTEMPT = "ratchet-checkpoint/2"  # files at checkpoints/{name}/{attempt}/{rel}; the manifest names `attempt`
ATTEMPT_PREFIX = "attempt-"
# The two folders a checkpoint taken again alternates between: never the committed one's.
ATTEMPTS = (f"{ATTEMPT_PREFIX}1", f"{ATTEMPT_PREFIX}2")
# A seal that finds stored bytes other than those written re-uploads them (`commit`) this
# many times in all before it gives up; nothing is committed on the way.
SEAL_TRIES = 3


class SealMismatch(OSError):
    """The stored bytes of an uploaded checkpoint differ from the bytes its writers sent
    (or a file is gone): the checkpoint is not committed. `rels` names the files to upload
    again."""

    def __init__(self, name: str, problems: list[str], rels: list[str]):
        self.name, self.problems, self.rels = name, problems, rels
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        super().__init__(
            f"checkpoint {name!r} not committed: the stored bytes differ from the bytes written ({shown}); "
            "the storage changed or lost them after the upload: check storage.root (space, other writers, the object store)"
        )


class CorruptCheckpoint(ValueError):
    """Stored bytes do not match the checkpoint's manifest (or the manifest is unreadable)."""

    def __init__(self, name: str, problems: list[str]):
        self.name = name
        self.problems = problems
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        super().__init__(f"checkpoint {name!r} is corrupted: {shown}")


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint, as its manifest describes it. `files` maps each relative
    path to {"size": bytes, "sha256": hex}; `step` is `meta["step"]` when it is an integer."""

    name: str
    step: int | None
    files: dict[str, dict[str, Any]]
    total_bytes: int
    meta: dict[str, Any]
    created: str
    uri: str = field(default="", compare=False)
    attempt: str = ""  # the folder under the checkpoint's that holds its files ("": the checkpoint's own)


def _step_of(meta: dict) -> int | None:
    step = meta.get("step")
    if isinstance(step, bool):
        return None
    if isinstance(step, int):
        return step
    if isinstance(step, float) and step.is_integer():
        return int(step)
    return None


def _sort_key(info: CheckpointInfo) -> tuple:
    # Checkpoints with a step sort by it (after any without one, which sort by name).
    return (info.step is not None, info.step if info.step is not None else 0, info.name)


class CheckpointStore:
    def __init__(self, store: ObjectStore, prefix: str = RunLayout.CHECKPOINTS):
        self.store = store
        self.prefix = prefix.strip("/")

    def __repr__(self) -> str:
        return f"CheckpointStore({self.store.uri(self.prefix)!r})"

    def _key(self, name: str, rel: str = "") -> str:
        return f"{self.prefix}/{name}/{rel}" if rel else f"{self.prefix}/{name}"

    def _file_key(self, name: str, attempt: str, rel: str) -> str:
        """The object key of file `rel` of checkpoint `name` written by `attempt`."""
        return self._key(name, f"{attempt}/{rel}" if attempt else rel)

    def file_key(self, info: CheckpointInfo, rel: str) -> str:
        """The object key (relative to the store) of file `rel` of committed checkpoint `info`."""
        if rel not in info.files:
            raise FileNotFoundError(f"checkpoint {info.name!r} has no file {rel!r}")
        return self._file_key(info.name, info.attempt, rel)

    @staticmethod
    def _check_name(name: str) -> None:
        check_id(name, "checkpoint name")
        if ".tmp-" in name:
            raise ValueError(f"checkpoint name {name!r}: '.tmp-' marks temporary objects; use a name such as 'step-000120'")

    @staticmethod
    def _check_attempt(name: str, attempt: object) -> str:
        if attempt == "":
            return ""
        if not isinstance(attempt, str) or not attempt.startswith(ATTEMPT_PREFIX) or not is_valid_id(attempt) or ".tmp-" in attempt:
            raise ValueError(f"checkpoint {name!r}: {attempt!r} is not an attempt folder of CheckpointStore.begin")
        return attempt

    # ------------------------------------------------------------------ write

    def commit(self, name: str, local_dir: str | os.PathLike, meta: dict) -> CheckpointInfo:
        """Upload every file under `local_dir`, then the manifest: `begin`, `upload` and
        `seal` by one writer. A file whose stored bytes differ from those sent is uploaded
        again (`SEAL_TRIES` in all), then SealMismatch. Re-committing a name (a retried
        activity) writes a fresh attempt: the committed checkpoint stays whole until the
        new manifest replaces it."""
        self._check_name(name)
        self._local_files(name, local_dir)  # a bad folder is refused before anything changes
        self._check_meta(name, meta)
        attempt = self.begin(name)
        files = self.upload(name, local_dir, attempt)
        for tried in range(1, SEAL_TRIES):
            try:
                return self.seal(name, files, meta, attempt)
            except SealMismatch as exc:
                log.warning("checkpoint %s: %s; uploading %d files again (try %d of %d)", name, exc, len(exc.rels), tried + 1, SEAL_TRIES)
                files.update(self.upload(name, local_dir, attempt, only=exc.rels))
        return self.seal(name, files, meta, attempt)  # the last try: its SealMismatch is the caller's

    def begin(self, name: str) -> str:
        """Where a new attempt at checkpoint `name` writes its files: "" (the checkpoint's
        own folder, the layout older ratchet reads) when no manifest, committed or
        retired, is there; else the attempt folder that manifest does not use (one of
        `ATTEMPTS`), so that the committed checkpoint stays whole and readable until
        `seal` replaces its manifest. Nothing is deleted, and a retried retry writes the
        same keys again (rule 2). With several writers (one per trainer rank), the one
        that seals calls this and hands the answer to the others before they upload."""
        self._check_name(name)
        for marker in (MANIFEST, RETIRED):
            try:
                raw = self.store.get_bytes(self._key(name, marker))
            except FileNotFoundError:
                continue
            try:
                used = json.loads(raw).get("attempt", "")
            except (ValueError, UnicodeDecodeError, AttributeError):  # unreadable: not a good checkpoint to keep
                used = ""
            attempt = ATTEMPTS[1] if used == ATTEMPTS[0] else ATTEMPTS[0]
            log.info("checkpoint %s exists; writing a new attempt under %s", self.store.uri(self._key(name)), attempt)
            return attempt
        return ""

    def upload(
        self, name: str, local_dir: str | os.PathLike, attempt: str = "", only: builtins.list[str] | None = None
    ) -> dict[str, FileEntry]:
        """Upload every file under `local_dir` (or the relative paths `only`) into
        checkpoint `name`'s `attempt` folder (`begin`'s answer); no manifest. Returns each
        file's size and the sha256 of the bytes sent, for `seal`. Each writer of a
        checkpoint (each trainer rank, from its own node) uploads its own folder."""
        self._check_name(name)
        self._check_attempt(name, attempt)
        files: dict[str, FileEntry] = {}
        for path, rel in self._local_files(name, local_dir):
            if only is not None and rel not in only:
                continue
            t = self.store.put_file(self._file_key(name, attempt, rel), path)
            files[rel] = FileEntry(t.size, t.sha256)
        return files

    def seal(self, name: str, files: Mapping[str, FileEntry], meta: dict, attempt: str = "") -> CheckpointInfo:
        """Commit checkpoint `name` made of the uploaded `files` (every writer's `upload`
        result, merged; all in `attempt`'s folder). Every stored file is read back first
        and must have the size and sha256 its writer sent (else SealMismatch, and nothing
        is committed); then the manifest is written, listing each file. Then objects under
        the name that the manifest does not list (an earlier attempt's) are deleted."""
        self._check_name(name)
        self._check_attempt(name, attempt)
        self._check_meta(name, meta)
        for rel in files:
            self._check_rel(name, rel)
        stored = set(self.store.list(self._key(name)))
        keys = {rel: self._file_key(name, attempt, rel) for rel in sorted(files)}
        missing = sorted(rel for rel, key in keys.items() if key not in stored)
        if missing:
            raise FileNotFoundError(f"checkpoint {name!r}: cannot commit, files not uploaded: {', '.join(missing[:5])}")
        self._check_stored(name, files, keys)
        manifest_key = self._key(name, MANIFEST)
        created = datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
        header = {"format": FORMAT_ATTEMPT if attempt else FORMAT, "name": name, "step": _step_of(meta), "created": created, "meta": meta}
        if attempt:
            header["attempt"] = attempt
        entries = {rel: files[rel] for rel in sorted(files)}
        manifest = Manifest(entries, {**header, "total_bytes": sum(f.size for f in entries.values())})
        self.store.put_json(manifest_key, manifest.to_json(CHECKPOINT))
        # Files of an earlier attempt under this name that this commit no longer has (the
        # checkpoint is committed: a failure here leaves leftovers for retention, no error).
        for key in sorted(stored - set(keys.values()) - {manifest_key}):
            try:
                self.store.delete(key)
            except Exception as exc:  # noqa: BLE001 - retention removes it later
                log.warning("checkpoint %s is committed; could not delete %s of an earlier attempt: %s", name, key, exc)
        info = self._info(name, manifest)
        log.info("committed checkpoint %s (%d files, %d bytes)", info.uri, len(entries), info.total_bytes)
        return info

    def _check_stored(self, name: str, files: Mapping[str, FileEntry], keys: Mapping[str, str]) -> None:
        """SealMismatch unless every stored file has the size and sha256 of the bytes its
        writer sent (read back from storage: what a reader will get)."""
        problems, bad = [], []
        for rel, key in keys.items():
            want = files[rel]
            try:
                size = self.store.size(key)
                sha = self.store.sha256(key)[1] if size == want.size else ""
            except FileNotFoundError:
                problems.append(f"{rel}: missing")
                bad.append(rel)
                continue
            if size != want.size:
                problems.append(f"{rel}: {size} bytes stored, {want.size} written")
            elif sha != want.sha256:
                problems.append(f"{rel}: sha256 {sha[:12]}... stored, {want.sha256[:12]}... written")
            else:
                continue
            bad.append(rel)
        if problems:
            raise SealMismatch(name, problems, bad)

    @staticmethod
    def _check_meta(name: str, meta: dict) -> None:
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"checkpoint {name!r}: meta must be JSON-serializable ({exc})") from None

    @staticmethod
    def _check_rel(name: str, rel: str) -> None:
        if rel == MANIFEST:
            raise ValueError(
                f"checkpoint {name!r}: the folder already has a {MANIFEST} (a downloaded checkpoint?); "
                "CheckpointStore writes it itself, remove it from the folder"
            )
        if ".tmp-" in rel or rel.endswith(".part"):
            raise ValueError(f"checkpoint {name!r}: file name {rel!r} looks like a temporary file (.tmp-, .part); rename it")

    def _local_files(self, name: str, local_dir: str | os.PathLike) -> builtins.list[tuple[Path, str]]:
        """(path, relative path) of every file under `local_dir`, checked."""
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise NotADirectoryError(f"checkpoint {name!r}: local_dir {local_dir} is not a folder")
        paths = sorted(p for p in local_dir.rglob("*") if p.is_file())
        out = [(p, p.relative_to(local_dir).as_posix()) for p in paths]
        for _, rel in out:
            self._check_rel(name, rel)
        return out

    # ------------------------------------------------------------------ read

    def _info(self, name: str, manifest: Manifest) -> CheckpointInfo:
        """What a checkpoint manifest describes; CorruptCheckpoint if it is not a
        `FORMAT` manifest of checkpoint `name`."""
        head = manifest.fields
        if head.get("format") not in (FORMAT, FORMAT_ATTEMPT) or head.get("name") != name:
            raise CorruptCheckpoint(name, [f"{MANIFEST} is not a {FORMAT} or {FORMAT_ATTEMPT} manifest for {name!r}"])
        attempt = head.get("attempt", "") if head["format"] == FORMAT_ATTEMPT else ""
        try:
            self._check_attempt(name, attempt)
            if head["format"] == FORMAT_ATTEMPT and not attempt:
                raise ValueError("no attempt folder")
        except ValueError:
            raise CorruptCheckpoint(name, [f"{MANIFEST}: 'attempt' {attempt!r} is not an attempt folder"]) from None
        try:
            return CheckpointInfo(
                name=head["name"],
                step=head.get("step"),
                files=manifest.files_json(CHECKPOINT),
                total_bytes=head["total_bytes"],
                meta=head.get("meta", {}),
                created=head["created"],
                uri=self.store.uri(self._key(name)),
                attempt=attempt,
            )
        except KeyError as exc:
            raise CorruptCheckpoint(name, [f"{MANIFEST} lacks a field ({exc!r})"]) from None

    def _names(self) -> tuple[builtins.list[str], dict[str, list[str]]]:
        """(committed names, {uncommitted name: its keys}) under the prefix."""
        by_name: dict[str, list[str]] = {}
        for key in self.store.list(self.prefix):
            name, _, _ = key[len(self.prefix) + 1 :].partition("/")
            by_name.setdefault(name, []).append(key)
        for name in [n for n in by_name if not is_valid_id(n)]:
            # Not written by CheckpointStore (its names pass check_id): never read or deleted.
            log.warning("ignoring %s: %r is not a valid checkpoint name", self.store.uri(self.prefix), name)
            del by_name[name]
        committed = [n for n, keys in by_name.items() if self._key(n, MANIFEST) in keys]
        # Retired checkpoints are neither: kept as they are, never cleaned up as leftovers.
        retired = {n for n, keys in by_name.items() if self._key(n, RETIRED) in keys}
        return committed, {n: keys for n, keys in by_name.items() if n not in committed and n not in retired}

    def get(self, name: str) -> CheckpointInfo:
        """The committed checkpoint `name` (FileNotFoundError if it has no manifest)."""
        return self._load(name)[0]

    def _load(self, name: str) -> tuple[CheckpointInfo, bytes]:
        """The checkpoint and its manifest's bytes, read once."""
        info, _, raw = self._load_manifest(name)
        return info, raw

    def _load_manifest(self, name: str) -> tuple[CheckpointInfo, Manifest, bytes]:
        self._check_name(name)
        try:
            raw = self.store.get_bytes(self._key(name, MANIFEST))
        except FileNotFoundError:
            raise FileNotFoundError(f"no committed checkpoint {name!r} under {self.store.uri(self.prefix)}") from None
        try:
            manifest = Manifest.parse(raw, CHECKPOINT)
        except BadManifest as exc:
            raise CorruptCheckpoint(name, exc.problems) from None
        return self._info(name, manifest), manifest, raw

    def list(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints, oldest first (by `step`, else by name). An unreadable
        manifest is skipped with a warning."""
        infos = []
        for name in self._names()[0]:
            try:
                infos.append(self.get(name))
            except (CorruptCheckpoint, FileNotFoundError) as exc:  # deleted meanwhile, or broken
                log.warning("skipping checkpoint %s: %s", name, exc)
        return sorted(infos, key=_sort_key)

    def problems(self, name: str) -> builtins.list[str]:
        """What is wrong with the stored bytes of `name` (empty when it matches its manifest)."""
        try:
            info, manifest, _ = self._load_manifest(name)
        except CorruptCheckpoint as exc:
            return exc.problems
        out = []
        for rel in manifest.files:
            key = self._file_key(name, info.attempt, rel)
            try:
                problem = manifest.problem(rel, self.store.size(key))  # the size first: no read for a truncated file
                if problem is None:
                    problem = manifest.problem(rel, *self.store.sha256(key))
            except FileNotFoundError:
                problem = f"{rel}: missing"
            if problem:
                out.append(problem)
        return out

    def verify(self, name: str) -> bool:
        """True when every file is stored with the manifest's size and sha256 (reads all bytes)."""
        return not self.problems(name)

    def _newest_first(self, max_step: int | None) -> builtins.list[CheckpointInfo]:
        candidates = self.list()
        if max_step is not None:
            candidates = [c for c in candidates if c.step is not None and c.step <= max_step]
        return candidates[::-1]

    def latest(self, valid_only: bool = True, max_step: int | None = None) -> CheckpointInfo | None:
        """The newest committed checkpoint (with `step <= max_step` if given). With
        `valid_only`, a corrupted one is skipped with a warning and the one before it is
        tried, and so on."""
        for info in self._newest_first(max_step):
            if not valid_only:
                return info
            problems = self.problems(info.name)
            if not problems:
                return info
            log.warning(
                "checkpoint %s is corrupted (%s); falling back to the previous one",
                info.uri, "; ".join(problems[:3]),
            )  # fmt: skip
        return None

    def newest_good(self, fetch: Callable[[CheckpointInfo], T], max_step: int | None = None) -> tuple[CheckpointInfo, T] | None:
        """`fetch(info)` on the newest committed checkpoint (with `step <= max_step`), and on
        the one before it, and so on, while fetch raises CorruptCheckpoint: the bytes are
        read once, by the fetch that verifies them (`download`, `read_files`), not first by
        `latest()` as well. None when no checkpoint is good."""
        for info in self._newest_first(max_step):
            try:
                return info, fetch(info)
            except CorruptCheckpoint as exc:
                log.warning("checkpoint %s is corrupted (%s); falling back to the previous one", info.uri, "; ".join(exc.problems[:3]))
        return None

    def read_files(self, name: str, rels: builtins.list[str]) -> dict[str, bytes]:
        """Small files of checkpoint `name`, checked against its manifest."""
        for rel in rels:
            check_key(rel, allow_empty=False, what="checkpoint file name")
        info, manifest, _ = self._load_manifest(name)
        out, problems = {}, []
        for rel in rels:
            if rel not in manifest.files:
                problems.append(f"{rel}: not in the manifest")
                continue
            try:
                data = self.store.get_bytes(self._file_key(name, info.attempt, rel))
            except FileNotFoundError:
                problems.append(f"{rel}: missing")
                continue
            problem = manifest.problem_of_bytes(rel, data)
            if problem:
                problems.append(problem)
            out[rel] = data
        if problems:
            raise CorruptCheckpoint(name, problems)
        return out

    def download(
        self, name: str, local_dir: str | os.PathLike, verify: bool = True, progress: Callable[[str], None] | None = None,
        under: str | None = None,
    ) -> CheckpointInfo:  # fmt: skip
        """Fetch `name` into `local_dir` (files at their relative paths, `MANIFEST.json`
        last). Interrupted downloads resume. With `verify`, a file whose sha256 differs
        from the manifest is fetched once more from scratch (it may have resumed on a
        stale partial file) and then raises CorruptCheckpoint. `progress`, if given, is
        called after each file with a short text (e.g. to heartbeat an activity).

        `under` (a folder of the checkpoint, e.g. `trainer`): only the files below it, for
        a reader that needs only them (a trainer rank restoring its state does not need
        the Hugging Face export); no local `MANIFEST.json` is written then, since the
        local copy is not the whole checkpoint."""
        info, manifest, raw = self._load_manifest(name)
        local_dir = Path(local_dir)
        local_dir.mkdir(parents=True, exist_ok=True)
        (local_dir / MANIFEST).unlink(missing_ok=True)  # the local copy is incomplete until the end
        problems = []
        root = local_dir.resolve()
        done_bytes = 0
        wanted = [rel for rel in manifest.files if under is None or rel.startswith(under.strip("/") + "/")]
        if under is not None and not wanted:
            raise FileNotFoundError(f"checkpoint {name!r} has no files under {under!r}")
        total_bytes = sum(manifest.files[rel].size for rel in wanted)
        for number, rel in enumerate(wanted, 1):
            target = local_dir / rel
            if not target.resolve().is_relative_to(root):
                raise CorruptCheckpoint(name, [f"manifest path {rel!r} points outside the checkpoint folder"])
            key = self._file_key(name, info.attempt, rel)
            try:
                t = self.store.get_file(key, target, checksum=verify)
                if verify and manifest.problem(rel, t.size, t.sha256) and t.transferred < t.size:
                    target.unlink()
                    t = self.store.get_file(key, target)
            except FileNotFoundError:
                problems.append(f"{rel}: missing")
                continue
            problem = manifest.problem(rel, t.size, t.sha256 if verify else None)
            if problem:
                target.unlink()
                problems.append(problem)
            done_bytes += t.size
            if progress is not None:
                progress(f"{name}: {number}/{len(wanted)} files, {done_bytes}/{total_bytes} bytes ({rel})")
        if problems:
            raise CorruptCheckpoint(name, problems)
        if under is None:
            (local_dir / MANIFEST).write_bytes(raw)
        return info

    # ------------------------------------------------------------------ delete

    def delete(self, name: str) -> None:
        """Manifest first: a half-deleted checkpoint is an invisible leftover, not a broken one."""
        self._check_name(name)
        self.store.delete(self._key(name, MANIFEST))
        self.store.delete(self._key(name))

    def retire(self, name: str) -> None:
        """Make `name` invisible without deleting a byte: its manifest moves to
        `RETIRED.json`. A run resumed from an older checkpoint retires the newer ones (they
        belong to the abandoned continuation, and recovery must not restore them); renaming
        the file back brings one back."""
        info, manifest = self._load(name)
        self.store.put_bytes(self._key(name, RETIRED), manifest)
        self.store.delete(self._key(name, MANIFEST))
        log.info("retired checkpoint %s", info.uri)

    def apply_retention(self, keep_last: int, keep_every: int, leftover_age_s: float = LEFTOVER_AGE_S) -> builtins.list[str]:
        """Keep the newest `keep_last` committed checkpoints and every one whose step is a
        multiple of `keep_every` (0: none); delete the rest, but only those older than the
        newest checkpoint whose bytes verify against its manifest: that one, and everything
        newer, is always kept, and with no verified checkpoint nothing is deleted (a
        corrupted newest checkpoint must not take the last good one with it).

        Also deletes leftovers of uncommitted uploads all of whose objects are older than
        the newest committed manifest (a newer one may be an upload in progress), attempt
        folders of committed checkpoints that their manifest does not name (a retry that
        never sealed), equally old, and `.tmp-` objects and unfinished multipart uploads of
        interrupted writes older than `leftover_age_s` (with a local folder that held
        nothing else). Returns the deleted names (and leftover keys).

        Retention is housekeeping: a deletion that fails is logged as a warning and the
        rest goes on (the next retention tries again); it never makes a checkpoint fail."""
        if keep_last < 1:
            raise ValueError(f"apply_retention: keep_last must be >= 1 (got {keep_last}); the newest checkpoint is always kept")
        if keep_every < 0:
            raise ValueError(f"apply_retention: keep_every must be >= 0 (got {keep_every}; 0 disables it)")
        committed = self.list()
        keep = {c.name for c in committed[-keep_last:]}
        if keep_every:
            keep |= {c.name for c in committed if c.step is not None and c.step % keep_every == 0}
        doomed = self._older_than_newest_good([c for c in committed if c.name not in keep], committed)
        deleted = []
        for info in doomed:
            if self._tidy(f"deleting checkpoint {info.name}", self.delete, info.name) is not _FAILED:
                deleted.append(info.name)
        newest = (
            self._tidy("reading the newest manifest's time", self.store.modified, self._key(committed[-1].name, MANIFEST))
            if committed
            else _FAILED
        )
        if newest is not _FAILED:
            gone = {c.name for c in doomed}
            for what, step in (
                ("deleting uncommitted uploads", lambda: self._delete_uncommitted(newest)),
                ("deleting unsealed attempts", lambda: self._delete_stale_attempts([c for c in committed if c.name not in gone], newest)),
            ):
                done = self._tidy(what, step)
                deleted += done if done is not _FAILED else []
        removed = self._tidy(
            "deleting leftovers of interrupted writes", self.store.clean_leftovers, self.prefix, older_than_s=leftover_age_s
        )
        if removed is not _FAILED:
            deleted += removed
            emptied = self._tidy("removing emptied folders", self._drop_emptied, removed)
            deleted += emptied if emptied is not _FAILED else []
        if deleted:
            log.info("retention under %s deleted %s", self.store.uri(self.prefix), ", ".join(deleted))
        return deleted

    def _tidy(self, what: str, fn: Callable[..., T], *args, **kwargs) -> T | _Failed:
        """`fn(...)`, or `_FAILED` after a warning when it raised."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - retention must not fail a checkpoint
            log.warning("retention under %s: %s failed (%s: %s); the next retention tries again",
                        self.store.uri(self.prefix), what, type(exc).__name__, exc)  # fmt: skip
            return _FAILED

    def _drop_emptied(self, removed: builtins.list[str]) -> builtins.list[str]:
        """The checkpoint folders whose last files were the `.tmp-` leftovers just
        `removed`, removed in turn (a local folder outlives its files; only empty folders
        go, so a write that has just begun in one keeps it)."""
        out = []
        inside = self.prefix + "/"
        for name in sorted({k[len(inside) :].partition("/")[0] for k in removed if k.startswith(inside)}):
            if not is_valid_id(name) or self.store.list(self._key(name)):
                continue
            if self._tidy(f"removing the empty folder of {name}", self.store.remove_empty_folders, self._key(name)) is True:
                out.append(name)
        return out

    def _delete_stale_attempts(self, committed: builtins.list[CheckpointInfo], newest_manifest: datetime) -> builtins.list[str]:
        """Attempt folders under committed checkpoints that their manifest does not name,
        all of whose objects are older than the newest manifest."""
        folders: dict[tuple[str, str], list[str]] = {}
        by_name = {c.name: c for c in committed}
        for key in self.store.list(self.prefix):
            name, _, rest = key[len(self.prefix) + 1 :].partition("/")
            folder = rest.partition("/")[0]
            info = by_name.get(name)
            if info is None or not folder.startswith(ATTEMPT_PREFIX) or folder == info.attempt or "/" not in rest:
                continue
            if not info.attempt and rest in info.files:  # a file of a checkpoint in the plain layout
                continue
            folders.setdefault((name, folder), []).append(key)
        deleted = []
        for (name, folder), keys in sorted(folders.items()):
            try:
                if not all(self.store.modified(k) < newest_manifest for k in keys):
                    continue
            except FileNotFoundError:
                continue
            if self._tidy(f"deleting {name}/{folder}", self.store.delete, self._key(name, folder)) is not _FAILED:
                deleted.append(f"{name}/{folder}")
        return deleted

    def _older_than_newest_good(
        self, candidates: builtins.list[CheckpointInfo], committed: builtins.list[CheckpointInfo]
    ) -> builtins.list[CheckpointInfo]:
        """The `candidates` older than the newest checkpoint that verifies (checked newest
        first, reading every byte, and only when there is something to delete)."""
        if not candidates:
            return []
        order = {c.name: i for i, c in enumerate(committed)}
        for info in reversed(committed):
            try:
                problems = self.problems(info.name)
            except FileNotFoundError:  # deleted meanwhile (another retention): not a good one
                continue
            if not problems:
                return [c for c in candidates if order[c.name] < order[info.name]]
            log.warning(
                "retention: checkpoint %s is corrupted (%s); keeping it and every checkpoint from it back to a good one",
                info.uri, "; ".join(problems[:3]),
            )  # fmt: skip
        log.error("retention under %s: no checkpoint verifies; deleting none", self.store.uri(self.prefix))
        return []

    def _delete_uncommitted(self, newest_manifest: datetime) -> builtins.list[str]:
        deleted = []
        for name, keys in sorted(self._names()[1].items()):
            try:
                if not all(self.store.modified(k) < newest_manifest for k in keys):
                    continue
            except FileNotFoundError:  # removed meanwhile
                continue
            if self._tidy(f"deleting the uncommitted upload {name}", self.store.delete, self._key(name)) is not _FAILED:
                deleted.append(name)
        return deleted


__all__ = ["CheckpointInfo", "CheckpointStore", "CorruptCheckpoint", "MANIFEST", "SealMismatch"]
