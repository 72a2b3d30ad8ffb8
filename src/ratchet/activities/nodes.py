"""The activity that moves a run off Ray nodes about to go (`ratchet drain`; the workflow
calls it at a step boundary, right after a checkpoint)."""

from __future__ import annotations

from temporalio import activity

from ratchet import types as t
from ratchet.workers.actors.evacuation import evacuate

from .training import actors_for
from .translate import temporal_errors


@activity.defn(name="evacuate_nodes")
@temporal_errors
def evacuate_nodes(inp: t.EvacuateInput) -> t.EvacuateOutput:
    """The checkpoint just taken is committed first (its writers may be on the node), then
    the run's actors there are released; the next step rebuilds them from that checkpoint."""
    actors = actors_for(inp.run)
    actors.trainer.settle_last_checkpoint()
    return t.EvacuateOutput(released=evacuate(actors, inp.node_ids))


NODE_ACTIVITIES = [evacuate_nodes]
