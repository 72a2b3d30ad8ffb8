"""Prepare a Temporal cluster for ratchet, once per namespace, idempotently: wait for the
frontend, register the namespace if it is missing, and add ratchet's search attributes
(src/ratchet/workflows/search_attributes.py) it lacks.

Run from the ratchet image (the compose service `temporal-setup`, the Kubernetes Job
`ratchet-temporal-setup`): `python deploy/images/setup_temporal.py`. It reads the same
variables as every ratchet process: RATCHET_TEMPORAL_ADDRESS, RATCHET_TEMPORAL_NAMESPACE and
the TLS / API-key ones (src/ratchet/platform/temporal_connection.py); RATCHET_TEMPORAL_RETENTION
(default 7d: days, `d`, or hours, `h`) is the new namespace's history retention.
On Temporal Cloud, namespaces and search attributes are made with `tcld` or the Cloud UI
instead (docs/deploy.md).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import re
import sys

log = logging.getLogger("ratchet.setup_temporal")


def retention(raw: str) -> dt.timedelta:
    match = re.fullmatch(r"\s*(\d+)\s*([dh])\s*", raw)
    if not match:
        raise SystemExit(f"RATCHET_TEMPORAL_RETENTION={raw!r}: give days or hours, e.g. 7d or 72h")
    n, unit = int(match.group(1)), match.group(2)
    return dt.timedelta(days=n) if unit == "d" else dt.timedelta(hours=n)


async def connect(address: str, options: dict, timeout_s: float):
    """Wait out a frontend that is still starting (the compose service starts with it)."""
    from temporalio.client import Client

    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            return await Client.connect(address, **options)
        except RuntimeError as exc:  # not reachable yet
            if asyncio.get_running_loop().time() > deadline:
                raise SystemExit(f"Temporal at {address} not reachable after {timeout_s:.0f} s: {exc}") from None
            log.info("waiting for Temporal at %s", address)
            await asyncio.sleep(2)


async def main() -> int:
    from google.protobuf.duration_pb2 import Duration
    from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
    from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest, RegisterNamespaceRequest
    from temporalio.service import RPCError, RPCStatusCode

    from ratchet.platform.temporal_connection import from_env
    from ratchet.workflows import search_attributes as sa

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    address = os.environ.get("RATCHET_TEMPORAL_ADDRESS") or "127.0.0.1:7233"
    conn = from_env()
    keep = retention(os.environ.get("RATCHET_TEMPORAL_RETENTION", "7d"))
    log.info("Temporal at %s: %s", address, conn.describe())
    client = await connect(address, conn.connect_kwargs(), float(os.environ.get("RATCHET_SETUP_TIMEOUT_S", "300")))
    ns = conn.namespace

    try:
        await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace=ns))
        log.info("namespace %s exists", ns)
    except RPCError as exc:
        if exc.status != RPCStatusCode.NOT_FOUND:
            raise
        await client.workflow_service.register_namespace(
            RegisterNamespaceRequest(namespace=ns, workflow_execution_retention_period=Duration(seconds=int(keep.total_seconds())))
        )
        log.info("namespace %s registered (retention %s)", ns, keep)

    # A namespace just registered takes a moment to reach every frontend.
    for attempt in range(30):
        try:
            have = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=ns))
            break
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND or attempt == 29:
                raise
            await asyncio.sleep(1)
    wrong = [k.name for k in sa.ALL_KEYS if k.name in have.custom_attributes and have.custom_attributes[k.name] != int(k.indexed_value_type)]
    if wrong:
        raise SystemExit(f"namespace {ns}: search attributes {wrong} exist with another type; ratchet cannot use them")
    add = {k.name: int(k.indexed_value_type) for k in sa.ALL_KEYS if k.name not in have.custom_attributes}
    if add:
        await client.operator_service.add_search_attributes(AddSearchAttributesRequest(search_attributes=add, namespace=ns))
    log.info("namespace %s: search attributes added %s, present %d of %d", ns, sorted(add) or "none", len(sa.ALL_KEYS), len(sa.ALL_KEYS))
    return 0


if __name__ == "__main__":
    code = asyncio.run(main())
    logging.shutdown()
    sys.stdout.flush()
    os._exit(code)  # the SDK can crash at interpreter exit (docs/design.md)
