"""One module per loop mode. Each is a function `run(parts, state, plan) -> bool` that trains
the steps of one run segment and returns True when the run should continue as new; the
catalog (src/ratchet/catalog/loop_modes.py) names it as "module:function", and the workflow
calls the one `loop.mode` names. Adding a mode: docs/architecture.md, "A loop mode"."""
