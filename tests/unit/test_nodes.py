"""Settings of the extra nodes (`ratchet up --nodes`) and naming a node to drain (refused
with the field and the fix before anything starts), and the worker's periodic sweep of the
actors of closed runs."""

from __future__ import annotations

import pytest

from ratchet.platform.services import ServiceError, ServiceSettings
from ratchet.workers.actors.evacuation import pick_node

NODES = [
    {"NodeID": "aa11" + "0" * 52, "NodeName": "node-1", "NodeManagerAddress": "10.0.0.1", "Alive": True},
    {"NodeID": "aa22" + "0" * 52, "NodeName": "node-2", "NodeManagerAddress": "10.0.0.2", "Alive": True},
    {"NodeID": "bb33" + "0" * 52, "NodeName": "node-3", "NodeManagerAddress": "10.0.0.2", "Alive": True},
    {"NodeID": "cc44" + "0" * 52, "NodeName": "node-4", "NodeManagerAddress": "10.0.0.4", "Alive": False},
]


def test_a_node_is_found_by_name_id_prefix_or_unique_address():
    assert pick_node("node-2", NODES) == NODES[1]["NodeID"]
    assert pick_node(NODES[2]["NodeID"], NODES) == NODES[2]["NodeID"]
    assert pick_node("bb3", NODES) == NODES[2]["NodeID"]
    assert pick_node("10.0.0.1", NODES) == NODES[0]["NodeID"]


@pytest.mark.parametrize("spec", ["node-9", "aa", "10.0.0.2", "node-4", ""])
def test_an_unknown_ambiguous_or_dead_node_is_refused_listing_the_live_ones(spec):
    with pytest.raises(ValueError) as info:
        pick_node(spec, NODES)
    text = str(info.value)
    assert f"no single live Ray node matches {spec!r}" in text
    assert "node-1 (aa1100000000, 10.0.0.1)" in text and "node-4 (" not in text  # dead: not listed


@pytest.mark.parametrize(
    "field, value, env",
    [("nodes", -1, "RATCHET_NODES"), ("nodes", 17, "RATCHET_NODES"), ("nodes", True, "RATCHET_NODES"),
     ("worker_nodes", 2.5, "RATCHET_WORKER_NODES"), ("node_cpus", 0, "RATCHET_NODE_CPUS")],
)  # fmt: skip
def test_bad_node_settings_name_the_field_and_the_variable(tmp_path, field, value, env):
    with pytest.raises(ServiceError) as info:
        ServiceSettings(state_dir=tmp_path, **{field: value})
    assert field in str(info.value) and env in str(info.value)


def test_too_many_nodes_in_all_are_refused(tmp_path):
    with pytest.raises(ServiceError, match="nodes \\+ worker_nodes is 17"):
        ServiceSettings(state_dir=tmp_path, nodes=10, worker_nodes=7)


def test_node_settings_come_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RATCHET_NODES", "3")
    monkeypatch.setenv("RATCHET_NODE_CPUS", "1.5")
    monkeypatch.setenv("RATCHET_WORKER_NODES", "2")
    s = ServiceSettings.from_env(state_dir=tmp_path)
    assert (s.nodes, s.node_cpus, s.worker_nodes) == (3, 1.5, 2)
    monkeypatch.setenv("RATCHET_NODES", "three")
    with pytest.raises(ServiceError, match="RATCHET_NODES must be a number, got 'three'"):
        ServiceSettings.from_env(state_dir=tmp_path)


def test_the_worker_sweeps_closed_runs_now_and_then_until_it_stops(monkeypatch):
    """Actors a terminated run's last activity rebuilt after the run closed are swept
    within `sweep_every_seconds`, not only when a worker starts."""
    import asyncio

    from ratchet.platform import worker

    calls = []

    async def sweep(client):
        calls.append(client)

    monkeypatch.setattr(worker, "_sweep_leftover_actors", sweep)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.ensure_future(worker._sweep_every("client", 0.05, stop))
        await asyncio.sleep(0.4)
        stop.set()
        await asyncio.wait_for(task, 1.0)  # returns once stopped
        swept = len(calls)
        await asyncio.sleep(0.2)
        assert len(calls) == swept  # nothing after the stop

    asyncio.run(main())
    assert len(calls) >= 3 and set(calls) == {"client"}
