"""Every table of named implementations a config can pick from, in one torch-free package:
the algorithms (`algorithms.py`), rollout engines (`engines.py`), storage URL schemes
(`storage_schemes.py`), loop modes (`loop_modes.py`), trackers (`trackers.py`) and tool
classes (`tools.py`), each a `registry.Registry`. An entry names its implementation as a
"module:attribute" string, imported on first use, so the config schema reads every table
in a client or CLI process that never loads torch, Ray, MLflow or an S3 client
(tests/unit/test_registries.py checks what importing them loads). Adding an
implementation is one module and one line in its table: docs/architecture.md,
"Extension points".

Nothing is imported here: the Temporal workflow sandbox imports `loop_modes` alone.
"""
