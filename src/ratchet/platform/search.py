"""Find runs by their search attributes: a visibility query on the Temporal server.

    runs = await find_runs(temporal_client, "ratchet_reward > 0.3 AND ratchet_status = 'running'")

The query is Temporal's list filter (SQL-like: `=`, `!=`, `<`, `>=`, `AND`, `OR`,
`BETWEEN`, `IN`, `STARTS_WITH`, parentheses, quoted strings) over ratchet's attributes
(`ratchet.workflows.search_attributes`) and Temporal's own (PascalCase: `WorkflowId`,
`StartTime`, `ExecutionStatus`, ...). It is checked here before it is sent, so a typo
(`ratchet_rewards`, or `reward` without the prefix) is refused naming the attributes there
are, instead of coming back as the server's terse error or as an empty list; an error the
server still finds is turned into the same kind of message (`InvalidQuery`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ratchet.workflows import search_attributes as sa

logger = logging.getLogger(__name__)

WORKFLOW_TYPE = "TrainingWorkflow"

# Words of the query language, not attribute names.
_WORDS = {
    "and", "or", "not", "in", "between", "is", "null", "like", "starts_with", "order", "by", "asc", "desc",
    "true", "false", "group",
}  # fmt: skip
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|`(?:[^`\\]|\\.)*`")
_NAME = re.compile(r"(?<![\w.])[A-Za-z_]\w*")
_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)


class InvalidQuery(ValueError):
    """A run query the checks or the server refused; the message names the attributes."""


@dataclass(frozen=True)
class RunListing:
    """One training run as the visibility store has it."""

    run_id: str
    workflow_status: str  # Temporal's: RUNNING, COMPLETED, FAILED, ...
    status: str | None  # ratchet_status: running, paused, completed, stopped, failed, cancelled
    experiment: str | None
    algorithm: str | None
    loop_mode: str | None
    model: str | None
    step: int | None
    reward: float | None
    eval_reward: float | None
    sweep: str | None
    parent: str | None
    start_time: datetime | None
    close_time: datetime | None


def attribute_help() -> str:
    """ratchet's attributes with their types and meanings, one per line."""
    return "\n".join(f"  {k.name} ({sa.type_name(k)}): {sa.MEANING[k.name]}" for k in sa.ALL_KEYS)


def _invalid(where: str, why: str) -> InvalidQuery:
    return InvalidQuery(
        f"invalid run query {where!r}: {why}.\nratchet's search attributes:\n{attribute_help()}\n"
        "and Temporal's own (WorkflowId, StartTime, CloseTime, ExecutionStatus, ...). "
        "Example: ratchet_reward > 0.3 AND ratchet_status = 'running'"
    )


def check_query(where: str) -> str:
    """The query stripped, or InvalidQuery: empty, unbalanced quotes or parentheses, a
    `ratchet_` name that is not one of ratchet's attributes, or a lower-case name that is no
    attribute at all (Temporal's own are PascalCase)."""
    where = (where or "").strip()
    if not where:
        raise _invalid(where, "it is empty")
    bare = _STRING.sub("''", where)
    if any(q in bare.replace("''", "") for q in "'\"`"):
        raise _invalid(where, "a quote is not closed")
    depth = 0
    for ch in bare:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            break
    if depth != 0:
        raise _invalid(where, "its parentheses do not match")
    if ";" in bare:
        raise _invalid(where, "';' is not part of a run query")
    known = {k.name for k in sa.ALL_KEYS}
    for name in _NAME.findall(bare):
        if name.lower() in _WORDS or name in known:
            continue
        if name.startswith("ratchet_"):
            raise _invalid(where, f"{name!r} is not one of ratchet's search attributes")
        if name[0].islower():
            hint = f" (did you mean 'ratchet_{name}'?)" if f"ratchet_{name}" in known else ""
            raise _invalid(where, f"{name!r} is not a search attribute{hint}; put text values in quotes")
    return where


def full_query(where: str) -> str:
    """`where` limited to training runs (an ORDER BY stays at the end)."""
    where = check_query(where)
    m = _ORDER_BY.search(_STRING.sub(lambda s: "x" * len(s.group()), where))
    order = ""
    if m:
        where, order = where[: m.start()].strip(), " " + where[m.start() :].strip()
        if not where:
            return f"WorkflowType = '{WORKFLOW_TYPE}'{order}"
    return f"WorkflowType = '{WORKFLOW_TYPE}' AND ({where}){order}"


async def registered_attributes(temporal_client) -> dict[str, int]:
    """The namespace's custom search attributes (name -> IndexedValueType)."""
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest

    resp = await temporal_client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=temporal_client.namespace))
    return dict(resp.custom_attributes)


async def attributes_available(temporal_client) -> bool:
    """Whether the namespace has all of ratchet's attributes with their types. False (and a
    warning naming the fix) when some are missing or the server will not say (an account
    without operator rights): runs then start without them, which always works."""
    try:
        missing = sa.missing_from(await registered_attributes(temporal_client))
    except Exception as exc:  # noqa: BLE001 - any failure here must not stop a submit
        logger.warning("could not list the namespace's search attributes (%s); runs start without them", exc)
        return False
    if missing:
        logger.warning(
            "namespace %r lacks ratchet's search attributes %s: runs start without them (not searchable in the "
            "Temporal UI). Create them with `temporal operator search-attribute create` (docs/temporal_ui.md).",
            temporal_client.namespace,
            ", ".join(missing),
        )
        return False
    return True


def _value(attrs, key) -> Any:
    return attrs.get(key) if attrs is not None else None


def listing(execution) -> RunListing:
    """A `temporalio.client.WorkflowExecution` as a RunListing."""
    attrs = execution.typed_search_attributes
    return RunListing(
        run_id=execution.id,
        workflow_status=execution.status.name if execution.status else "UNKNOWN",
        status=_value(attrs, sa.STATUS),
        experiment=_value(attrs, sa.EXPERIMENT),
        algorithm=_value(attrs, sa.ALGORITHM),
        loop_mode=_value(attrs, sa.LOOP_MODE),
        model=_value(attrs, sa.MODEL),
        step=_value(attrs, sa.STEP),
        reward=_value(attrs, sa.REWARD),
        eval_reward=_value(attrs, sa.EVAL_REWARD),
        sweep=_value(attrs, sa.SWEEP),
        parent=_value(attrs, sa.PARENT),
        start_time=execution.start_time,
        close_time=execution.close_time,
    )


async def find_runs(temporal_client, where: str, *, limit: int = 200) -> list[RunListing]:
    """The training runs matching `where`, newest first (at most `limit`). InvalidQuery
    when the query is malformed or names an attribute the namespace does not have."""
    from temporalio.service import RPCError, RPCStatusCode

    query = full_query(where)
    try:
        return [listing(w) async for w in temporal_client.list_workflows(query, limit=limit)]
    except RPCError as exc:
        if exc.status != RPCStatusCode.INVALID_ARGUMENT:
            raise
        why = f"the server refused it ({exc.message})"
        if sa.missing_from(await registered_attributes(temporal_client)):
            why += (
                f"; namespace {temporal_client.namespace!r} lacks some of ratchet's attributes: `ratchet up` creates "
                "them on the embedded server, `temporal operator search-attribute create` on a cluster"
            )
        raise _invalid(where, why) from None


async def previous_lineage(temporal_client, run_id: str):
    """The sweep and parent the run's latest workflow execution was labelled with (a resume
    starts a new execution under the same id and should keep them); None when there is none."""
    from ratchet.types import RunLineage

    try:
        desc = await temporal_client.get_workflow_handle(run_id).describe()
    except Exception:  # noqa: BLE001 - no earlier execution here: nothing to carry
        return None
    attrs = desc.typed_search_attributes
    sweep, parent = attrs.get(sa.SWEEP), attrs.get(sa.PARENT)
    if not (sweep or parent):
        return None
    return RunLineage(parent_run_id=parent, sweep_id=sweep)
