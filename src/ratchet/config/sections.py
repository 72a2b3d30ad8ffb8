"""Which config section a field holds: the one answer the loader's messages, `ratchet
schema` and the sweep spec's key check all need, so an optional section (`X | None`) or a
list of sections (`list[X]`) is walked the same way everywhere."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel


def section_in(annotation: Any) -> type[BaseModel] | None:
    """The section class a field of this annotation holds: X for `X` or `X | None`; None
    for a plain value or a union of several sections."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None


def item_section(annotation: Any) -> type[BaseModel] | None:
    """The section class of each item of a `list[X]` field (also `list[X] | None`), else None."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        found = [item_section(a) for a in typing.get_args(annotation) if a is not type(None)]
        return found[0] if len(found) == 1 else None
    if typing.get_origin(annotation) in (list, tuple):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return section_in(args[0]) if len(args) == 1 else None
    return None


def section_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The section that `loc` (pydantic's error location: keys, and list positions as ints)
    points at under `root`, or None when it points at a plain value."""
    model: type[BaseModel] | None = root
    items: type[BaseModel] | None = None  # set right after a list-of-sections field
    for part in loc:
        if isinstance(part, int):
            model, items = items, None
            continue
        field = model.model_fields.get(part) if model is not None and items is None else None
        if field is None:
            return None
        model = section_in(field.annotation)
        items = item_section(field.annotation) if model is None else None
    return None if items is not None else model
