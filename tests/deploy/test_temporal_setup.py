"""deploy/images/setup_temporal.py, the one-shot job that prepares a cluster's namespace,
run as the compose service and the Kubernetes Job run it, against a real dev server: it
registers a namespace the server lacks with ratchet's search attributes, and a second run
changes nothing."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from ratchet.workflows import search_attributes as sa
from tests.faults.standins import dev_server

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "images" / "setup_temporal.py"
NAMESPACE = "ratchet-setup-test"


async def _run_script(address: str, **extra: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RATCHET_TEMPORAL_", "RATCHET_NAMESPACE"))}
    env.update(RATCHET_TEMPORAL_ADDRESS=address, RATCHET_TEMPORAL_NAMESPACE=NAMESPACE, RATCHET_SETUP_TIMEOUT_S="30", **extra)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(SCRIPT), env=env, cwd=SCRIPT.parents[2],
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, out.decode()


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="function")
async def test_setup_registers_the_namespace_and_attributes_once():
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
    from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest

    async with dev_server() as env:
        address = env.client.service_client.config.target_host
        code, out = await _run_script(address, RATCHET_TEMPORAL_RETENTION="3d")
        assert code == 0, out
        assert f"namespace {NAMESPACE} registered (retention 3 days" in out
        desc = await env.client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace=NAMESPACE))
        assert desc.config.workflow_execution_retention_ttl.ToSeconds() == 3 * 86400
        have = await env.client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=NAMESPACE))
        assert {k.name: int(k.indexed_value_type) for k in sa.ALL_KEYS} == {k.name: have.custom_attributes[k.name] for k in sa.ALL_KEYS}

        code, out = await _run_script(address)
        assert code == 0, out
        assert f"namespace {NAMESPACE} exists" in out and "search attributes added none" in out


def test_a_bad_retention_is_refused_before_connecting():
    code, out = asyncio.run(_run_script("127.0.0.1:1", RATCHET_TEMPORAL_RETENTION="a week"))
    assert code != 0 and "RATCHET_TEMPORAL_RETENTION='a week': give days or hours, e.g. 7d or 72h" in out
