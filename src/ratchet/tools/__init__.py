"""Tools a policy may call during a multi-turn rollout (docs/multi_turn.md): the `Tool`
protocol, the built-in tools (a calculator, a code runner in a sandbox: sandbox.py,
cgroup.py; a SandboxFusion client), the catalog that maps verl's `class_name`s to them,
the verl tool-config layout, and the call formats a model writes.

A leaf package: it imports nothing else of ratchet and no torch, so the config schema can
validate a tool config at submit time.
"""
