"""Read a dataset file into columns: verl's parquet, JSON Lines, or a folder written by
`datasets.Dataset.save_to_disk`, the format chosen by the path.

A saved `datasets` folder is read with pyarrow directly (its `state.json` names the Arrow
stream files, `data-NNNNN-of-NNNNN.arrow`): the `datasets` package would add pandas,
multiprocess and dill to every worker for what is one `pyarrow.ipc.open_stream` per file,
and the on-disk layout is what `datasets.load_from_disk` itself reads.

JSON Lines rows that cannot be parsed do not stop the read: they are kept as
`DatasetTable.unreadable` (row -> why) so the submit-time check reports them by row number
together with the other bad rows, and the workers refuse the file naming the first one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# What a user may hand ratchet, for error messages.
KNOWN_FORMATS = "a .parquet file (verl's layout), a .jsonl/.json file (JSON Lines), or a folder saved with datasets' save_to_disk"


class DatasetFileError(ValueError):
    """The path is not a dataset ratchet can read; the message says what it is and what to give instead."""


@dataclass(frozen=True)
class DatasetTable:
    """The columns read from one dataset file, one value per row (None where a JSON row lacks the key)."""

    path: str
    format: str
    column_names: tuple[str, ...]  # every column the file has, not only those read
    num_rows: int
    columns: dict[str, list[Any]]
    unreadable: dict[int, str] = field(default_factory=dict)  # row -> why it could not be parsed

    def rows(self) -> list[dict[str, Any]]:
        names = list(self.columns)
        return [dict(zip(names, values)) for values in zip(*self.columns.values())] if names else [{} for _ in range(self.num_rows)]


@dataclass(frozen=True)
class DatasetFormat:
    name: str
    description: str
    matches: Callable[[Path], bool]
    read: Callable[[Path, Sequence[str] | None], DatasetTable]


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (path / "state.json").is_file()


def _select(names: Sequence[str], wanted: Sequence[str] | None) -> list[str]:
    return list(names) if wanted is None else [c for c in wanted if c in names]


# --- parquet -------------------------------------------------------------------------------


def _read_parquet(path: Path, wanted: Sequence[str] | None) -> DatasetTable:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        names = tuple(parquet.schema_arrow.names)
        table = parquet.read(columns=_select(names, wanted))
    except Exception as exc:  # not a parquet file, truncated, unreadable
        raise DatasetFileError(f"cannot read {path} as parquet: {type(exc).__name__}: {_first_line(exc)}") from exc
    return DatasetTable(
        str(path), "parquet", names, parquet.metadata.num_rows, {c: table.column(c).to_pylist() for c in table.column_names}
    )


# --- JSON Lines ----------------------------------------------------------------------------


def _read_json_lines(path: Path, wanted: Sequence[str] | None) -> DatasetTable:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetFileError(f"cannot read {path} as UTF-8 text: {type(exc).__name__}: {_first_line(exc)}") from exc
    records: list[dict | None] = []
    unreadable: dict[int, str] = {}
    if path.suffix == ".json" and text.lstrip().startswith("["):
        # A .json file may also be one array of objects (what `datasets` accepts too).
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise DatasetFileError(f"cannot read {path} as a JSON array: {_first_line(exc)}") from exc
        for row, item in enumerate(items):
            records.append(item if isinstance(item, dict) else None)
            if not isinstance(item, dict):
                unreadable[row] = f"not a JSON object but {_kind(item)}"
    else:
        for line_no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline, spacing) are not rows
            row = len(records)
            try:
                item = json.loads(line)
            except ValueError as exc:
                records.append(None)
                unreadable[row] = f"line {line_no} is not valid JSON ({_first_line(exc)})"
                continue
            records.append(item if isinstance(item, dict) else None)
            if not isinstance(item, dict):
                unreadable[row] = f"line {line_no} is not a JSON object but {_kind(item)}"
    names = tuple(dict.fromkeys(key for record in records if record for key in record))
    columns = {c: [(record or {}).get(c) for record in records] for c in _select(names, wanted)}
    return DatasetTable(str(path), "jsonl", names, len(records), columns, unreadable)


# --- a folder saved with datasets' save_to_disk --------------------------------------------


def _read_saved_dataset(path: Path, wanted: Sequence[str] | None) -> DatasetTable:
    import pyarrow as pa

    try:
        state = json.loads((path / "state.json").read_text())
        files = [path / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetFileError(f"{path}/state.json does not list the dataset's Arrow files (_data_files): {_first_line(exc)}") from exc
    if not files:
        raise DatasetFileError(f"{path}/state.json lists no Arrow files (_data_files is empty)")
    try:
        tables = [_read_arrow(file) for file in files]
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        indices = state.get("_indices_data_files")
        if indices:  # older `datasets` saved a selection as an indices file instead of flattening it
            rows = pa.concat_tables([_read_arrow(path / entry["filename"]) for entry in indices]).column("indices")
            table = table.take(rows)
    except Exception as exc:  # a missing or truncated Arrow file
        raise DatasetFileError(f"cannot read the Arrow files of {path}: {type(exc).__name__}: {_first_line(exc)}") from exc
    names = tuple(table.column_names)
    return DatasetTable(str(path), "saved_dataset", names, table.num_rows, {c: table.column(c).to_pylist() for c in _select(names, wanted)})


def _read_arrow(file: Path):
    """An Arrow IPC file as a table: `datasets` writes the stream format; the file format is accepted too."""
    import pyarrow as pa

    with pa.memory_map(str(file), "r") as source:
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_file(source).read_all()


FORMATS: tuple[DatasetFormat, ...] = (
    DatasetFormat("parquet", "a .parquet file", lambda p: p.is_file() and p.suffix == ".parquet", _read_parquet),
    DatasetFormat("jsonl", "a .jsonl or .json file", lambda p: p.is_file() and p.suffix in (".jsonl", ".json"), _read_json_lines),
    DatasetFormat("saved_dataset", "a datasets save_to_disk folder", _is_saved_dataset, _read_saved_dataset),
)


def dataset_format(path: str | Path) -> DatasetFormat:
    """The format of `path`, by its suffix or folder layout; DatasetFileError saying what it is otherwise."""
    p = Path(path)
    for fmt in FORMATS:
        if fmt.matches(p):
            return fmt
    if not p.exists():
        raise DatasetFileError(f"not found: {p}")
    if p.is_dir():
        splits = p / "dataset_dict.json"
        if splits.is_file():
            try:
                names = json.loads(splits.read_text()).get("splits") or []
            except (OSError, ValueError, AttributeError):
                names = []
            example = f"{p / names[0]}" if names else f"{p}/<split>"
            return _raise(f"{p} is a DatasetDict (splits: {', '.join(names) or 'unknown'}); point at one split's folder, e.g. {example}")
        if any(p.glob("*.parquet")):
            return _raise(f"{p} is a folder of parquet files; point at one file (ratchet reads one file per data.train_files/eval_files)")
        return _raise(f"{p} is a folder without state.json, so not one saved with datasets' save_to_disk; give {KNOWN_FORMATS}")
    return _raise(f"unknown dataset format {p.suffix or '(no suffix)'!r} of {p}; give {KNOWN_FORMATS}")


def read_dataset(path: str | Path, columns: Sequence[str] | None = None) -> DatasetTable:
    """The `columns` of the dataset at `path` (those it has; all when None)."""
    p = Path(path)
    return dataset_format(p).read(p, columns)


def _raise(message: str) -> DatasetFormat:
    raise DatasetFileError(message)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    name = type(value).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
