"""Rich tables that never cut what a user copies into the next command.

Keys, names, ids, paths and links go in fact columns (`fact_column`): never wrapped, never
shortened with an ellipsis. Only free text wraps (`text_column`). A table that cannot fit
the console that way (a narrow terminal, or none at all: Rich then assumes 80 columns) is
printed by `show` as `header: value` lines instead, each fact whole on one line: a
terminal may fold a long line on screen, but copying it gives the whole string back,
which a cell cut to `resources.rollou…` or a link broken across two lines never does.
"""

from __future__ import annotations

import io
import textwrap
from typing import Iterator

from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

# A free-text column is never squeezed below this (or its longest cell, if shorter), nor
# below its longest word (text names keys and paths too): a table that only fits by
# wrapping text a word or two a line is shown as lines instead.
TEXT_MIN_WIDTH = 24
_GAP = "   "


def fact_column(table: Table, header: str, **options) -> None:
    """A column of keys, names, ids, paths or links: each cell whole, on one line."""
    table.add_column(header, no_wrap=True, overflow="ignore", **options)


def text_column(table: Table, header: str, **options) -> None:
    """A column of free text or short values: may wrap at spaces (its header too)."""
    table.add_column(header, overflow="fold", **options)


def _text(cell: RenderableType) -> Text | None:
    if isinstance(cell, Text):
        return cell
    if isinstance(cell, str):
        return Text.from_markup(cell)
    return None  # another renderable: not a value to list


def _floor_text_columns(table: Table) -> None:
    for column in table.columns:
        if column.no_wrap or column.min_width is not None:
            continue
        texts = [t.plain for cell in column.cells if (t := _text(cell)) is not None]
        longest = max((len(line) for t in texts for line in t.splitlines()), default=1)
        header = column.header.split() if isinstance(column.header, str) else []
        word = max((len(w) for w in [*header, *(w for t in texts for w in t.split())]), default=1)
        column.min_width = max(min(longest, TEXT_MIN_WIDTH), word)


def fits(table: Table, width: int) -> bool:
    """Whether `table` drawn `width` columns wide keeps within them and shows every cell
    of its fact columns whole on one line."""
    _floor_text_columns(table)
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False, legacy_windows=False).print(table, crop=False)
    lines = buf.getvalue().splitlines()
    if any(len(line) > width for line in lines):
        return False
    for column in table.columns:
        if not column.no_wrap:
            continue
        for cell in column.cells:
            t = _text(cell)
            if t is not None and t.plain and not any(t.plain in line for line in lines):
                return False
    return True


def records(table: Table, width: int) -> Iterator[RenderableType]:
    """The table's rows as lines: a key/value table (no header) as `key: value`; any other
    row as its first cell (after its header unless it is a fact), then its other cells as
    `header: value` packed into lines of at most `width` (a fact longer than that alone on
    its line, never broken), and long free text as an indented paragraph wrapped at spaces."""
    if table.title:
        yield Text.from_markup(str(table.title), style="bold") if isinstance(table.title, str) else table.title
    columns = table.columns
    rows = list(zip(*[list(c.cells) for c in columns])) if columns else []
    headers = [c.header if isinstance(c.header, str) else "" for c in columns]
    if not table.show_header and len(columns) == 2:
        for key, value in rows:
            k, v = _text(key), _text(value)
            if k is not None and v is not None:
                yield Text.assemble(Text(f"{k.plain}: ", style="bold"), v)
        return
    for row in rows:
        first = _text(row[0])
        if first is not None:  # an id stands alone; anything else says what it is ("trial 3")
            yield first if columns[0].no_wrap or not headers[0] else Text.assemble(f"{headers[0]} ", first)
        line = Text("  ")
        paragraphs = []
        for column, header, cell in zip(columns[1:], headers[1:], row[1:]):
            value = _text(cell)
            if value is None or not value.plain:
                continue
            field = Text.assemble(Text(f"{header}: ", style="dim"), value)
            if not column.no_wrap and len(field) > width // 2:
                paragraphs.append(field)
                continue
            if len(line) > 2 and len(line) + len(_GAP) + len(field) > width:
                yield line
                line = Text("  ")
            if len(line) > 2:
                line.append(_GAP)
            line.append_text(field)
        if len(line) > 2:
            yield line
        for field in paragraphs:  # wrapped at spaces only: a long word (a path) stays whole
            for i, part in enumerate(textwrap.wrap(field.plain, width - 2, break_long_words=False, break_on_hyphens=False)):
                if i == 0 and ": " in part:
                    head, rest = part.split(": ", 1)
                    yield Text.assemble("  ", (f"{head}: ", "dim"), rest)
                else:
                    yield Text("  " + part)


def show(console: Console, table: Table) -> None:
    """Print `table` if it fits the console's width, else `records(table)`."""
    if fits(table, console.width):
        console.print(table)
        return
    for item in records(table, console.width):
        console.print(item, soft_wrap=True)  # no line break inserted into a fact: a terminal folds it on screen only


__all__ = ["TEXT_MIN_WIDTH", "fact_column", "fits", "records", "show", "text_column"]
