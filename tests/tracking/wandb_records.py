"""Read a wandb offline run file (`run-<id>.wandb`) back, record by record, with wandb's
own protobuf classes.

wandb 0.31 writes the file from its Go core and ships no Python reader; the format is
LevelDB's log format behind a 7-byte header (":W&B", magic 0xBEE1, version 0): 32 KiB
blocks of records, each a CRC32C (4 bytes), a length (2, little-endian) and a type
(1: full, 2: first, 3: middle, 4: last) before its bytes; a tail shorter than a record
header is padding. Each whole record is a `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path


HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """wandb's protobuf `Record`s of a run file (wandb imported here, not at collection,
    which runs in both test processes)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:7] == HEADER, f"{path} is not a wandb run file (header {data[:7]!r})"
    out, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < 7:
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind in (FULL, FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
            pending = b""
    return out


@dataclass
class OfflineRun:
    """What one offline run folder holds."""

    run_id: str = ""
    group: str = ""
    project: str = ""
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)  # one dict per logged step, with "_step"
    summary: dict = field(default_factory=dict)


def read_offline_run(folder: Path) -> OfflineRun:
    (path,) = Path(folder).glob("run-*.wandb")
    run = OfflineRun()
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.group, run.project = rec.run.run_id, rec.run.run_group, rec.run.project
            for item in rec.run.config.update:
                run.config[item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                run.config[item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in rec.history.item}
            row["_step"] = rec.history.step.num
            run.history.append(row)
        elif kind == "summary":
            for item in rec.summary.update:
                run.summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return run
