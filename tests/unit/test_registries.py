"""The extension points' registries: rollout engines, storage schemes, loop modes, trackers.

Each is one torch-free table that both the config schema and the code that builds the
thing read, so an entry added there is accepted by `load_config` and used by the workers;
these tests add one (and take it out again) to show that no second place needs an edit.
The advantage-estimator catalog has its own check in tests/unit/algorithms/test_catalog.py.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import torch

from ratchet.config.schema import RunConfig
from ratchet.catalog import registry
from ratchet.catalog import storage_schemes as schemes
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.fsspec_backend import FsspecBackend, open_fsspec
from ratchet.tasks.generate import write_task_parquet
from ratchet.workers.engines import ENGINES
from ratchet.workers.engines.base import Engine
from ratchet.workers.engines.hf import HFEngine
from ratchet.catalog.loop_modes import LOOP_MODES

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def copy_data(tmp_path_factory) -> Path:
    return write_task_parquet(tmp_path_factory.mktemp("data") / "copy.parquet", "copy", 8, seed=0, min_len=3, max_len=3)


def make_cfg(model: Path, data: Path, root: Path | str, **rollout) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"path": str(model)},
            "data": {"train_files": str(data)},
            "rollout": {"n": 2, "max_response_length": 4, **rollout},
            "loop": {"prompts_per_step": 2},
            "trainer": {"micro_batch_size": 4},
            "storage": {"root": str(root)},
        }
    )


# --------------------------------------------------------------------------- rollout engines


class CountingEngine(HFEngine):
    """The HF engine under another name; counts how often the registry built it."""

    built = 0

    def __init__(self, model_path: str, *, dtype: str = "float32"):
        super().__init__(model_path, dtype=dtype)
        type(self).built += 1


@pytest.fixture
def counting_engine():
    ENGINES.register("counting", CountingEngine)
    CountingEngine.built = 0
    yield "counting"
    del ENGINES.entries["counting"]


def protocol_members(protocol: type) -> set[str]:
    """The attributes and methods a Protocol class declares (its own, not `object`'s)."""
    declared = set(getattr(protocol, "__annotations__", {}))
    declared |= {name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")}
    return declared


def test_engine_protocol_declares_what_the_rollout_uses():
    """rollout.py and local_loop.py read `tokenizer` and `pad_id` from an engine."""
    assert {"generate", "load_weights", "supports_partial_rollout", "tokenizer", "pad_id"} <= protocol_members(Engine)


def test_each_engine_options_section_is_a_rollout_section_the_engine_takes():
    """ENGINE_OPTIONS names, for an engine, a `Section` field of RolloutConfig; its fields
    are what engine_options() gives, and an engine without an entry gets none."""
    from ratchet.catalog.engines import ENGINE_OPTIONS
    from ratchet.config.schema import RolloutConfig, Section

    assert set(ENGINE_OPTIONS) <= set(ENGINES.names())
    for engine, section in ENGINE_OPTIONS.items():
        field = RolloutConfig.model_fields[section]
        assert isinstance(field.annotation, type) and issubclass(field.annotation, Section), (engine, section)
        assert RolloutConfig(engine=engine).engine_options() == getattr(RolloutConfig(), section).model_dump()
    assert RolloutConfig(engine="hf").engine_options() == {}


def test_every_engine_entry_imports_and_fulfils_the_protocol(tiny_model):
    """Every entry imports; those that run here (not SGLang without CUDA; vLLM's own tests
    start it, so it is not started twice) are built and checked against the protocol."""
    assert ENGINES.names() == ["hf", "sglang", "vllm"]
    for name in ENGINES.names():
        cls = ENGINES.get(name)
        assert callable(cls.generate) and callable(cls.load_weights), name
        if name != "hf":
            continue  # tests/unit/test_engine_vllm.py and test_engine_sglang.py build those
        engine = cls(str(tiny_model), dtype="float32")
        missing = [member for member in protocol_members(Engine) if not hasattr(engine, member)]
        assert not missing, f"engine {name!r} lacks {missing} of the Engine protocol (workers/engines/base.py)"
        assert isinstance(engine.pad_id, int)
        assert engine.tokenizer.decode(engine.tokenizer.encode("12")).strip() == "12"


def test_schema_accepts_exactly_the_registered_engines(tiny_model, copy_data, tmp_path, counting_engine):
    assert make_cfg(tiny_model, copy_data, tmp_path, engine=counting_engine).rollout.engine == counting_engine
    with pytest.raises(ValueError, match=r"unknown rollout engine 'nope'; registered: counting, hf, sglang, vllm"):
        make_cfg(tiny_model, copy_data, tmp_path, engine="nope")


def test_rollout_worker_and_local_loop_build_the_configured_engine(tiny_model, copy_data, tmp_path, counting_engine):
    from ratchet.workers.local_loop import LocalLoop
    from ratchet.workers.rollout import RolloutWorker

    cfg = make_cfg(tiny_model, copy_data, tmp_path, engine=counting_engine)
    assert isinstance(RolloutWorker(cfg, str(tiny_model), str(tmp_path)).engine, CountingEngine)
    loop = LocalLoop(cfg)
    assert isinstance(loop.engine, CountingEngine) and CountingEngine.built == 2
    metrics = loop.step(0)  # the loop works through the protocol alone
    assert 0.0 <= metrics["reward_mean"] <= 1.0


# --------------------------------------------------------------------------- storage schemes


def test_every_scheme_opener_imports():
    for name, scheme in schemes.SCHEMES.objects():
        assert callable(scheme.open), name
    assert list(schemes.SCHEMES)[:2] == ["file", "s3"]  # the order error messages list them in


@pytest.mark.parametrize(
    ("url", "scheme"),
    [("runs", "file"), ("/abs/runs", "file"), ("file:///abs", "file"), ("S3://b/p", "s3"), ("minio://b", "minio"),
     ("memory://x", "memory"), ("runs/a://b", "file"), ("C:/runs", "file")],
)  # fmt: skip
def test_scheme_of_a_url(url, scheme):
    assert schemes.scheme_of(url) == scheme


def test_object_store_refuses_a_scheme_not_in_the_table():
    with pytest.raises(schemes.UnknownScheme, match=r"unknown storage scheme 'gs://' in 'gs://b/runs'; supported: a local folder, file://"):
        ObjectStore("gs://b/runs")


def test_a_scheme_added_to_the_table_is_used_by_the_store_and_accepted_by_the_schema(tiny_model, copy_data):
    """The table is the one place: a new scheme (here fsspec's memory filesystem under
    another name, opened through a function of this module) reaches both."""
    opened = []
    schemes.SCHEMES.register("testmem", schemes.Scheme(f"{__name__}:_open_testmem", "a test scheme", needs_bucket=True))
    globals()["_open_testmem"] = lambda url, **kw: (opened.append(url), open_fsspec("memory://" + url.split("://", 1)[1], **kw))[1]
    try:
        store = ObjectStore("testmem://bucket/runs")
        assert isinstance(store._backend, FsspecBackend) and opened == ["testmem://bucket/runs"]
        store.put_bytes("a/b", b"x")
        assert store.get_bytes("a/b") == b"x"
        assert make_cfg(tiny_model, copy_data, "testmem://bucket/runs").storage.root == "testmem://bucket/runs"
        with pytest.raises(ValueError, match="names no bucket; use testmem://bucket"):
            make_cfg(tiny_model, copy_data, "testmem://")
    finally:
        schemes.SCHEMES.entries.pop("testmem")
        globals().pop("_open_testmem")
        registry._load.cache_clear()  # the entry's opener, imported once


# --------------------------------------------------------------------------- loop modes


def test_schema_loop_modes_are_the_table():
    from ratchet.config.schema import LoopConfig

    assert list(LoopConfig.model_fields["mode"].annotation.__args__) == list(LOOP_MODES)


def test_each_loop_mode_is_a_module_with_a_run_function_and_the_workflow_dispatches_through_the_table():
    """Every catalog entry resolves to `run(parts, state, plan)` in a module of its own under
    workflows/training/loops/, every module there is in the table, and the workflow picks
    the loop from the table (a loop mode is one module and one catalog line)."""
    import pkgutil

    from ratchet.workflows.training import loops, workflow

    modules = {m.name for m in pkgutil.iter_modules(loops.__path__)}
    targets = {}
    for name, mode in LOOP_MODES.objects():
        fn = mode.loop()
        assert inspect.iscoroutinefunction(fn), f"loop mode {name}: {mode.run} is not a coroutine function"
        assert list(inspect.signature(fn).parameters) == ["parts", "state", "plan"], (name, mode.run)
        targets[name] = fn.__module__.rsplit(".", 1)[-1]
    assert set(targets.values()) == modules, ("catalog/loop_modes.py LOOP_MODES and workflows/training/loops/ differ", targets, modules)
    assert workflow.LOOPS == {name: mode.loop() for name, mode in LOOP_MODES.objects()}
    assert "LOOPS[LOOP_MODES.check(plan.mode)]" in inspect.getsource(workflow.TrainingWorkflow._run)


def test_each_patch_marker_is_in_the_workflow_and_its_history_replays_the_old_branch():
    """Every `workflow.patched` marker is listed in patches.py (with why and since when), and
    the recorded history named for it exists and does not carry it (so replaying it takes
    the old branch, which is what keeps such runs alive until the marker is retired)."""
    import base64
    import gzip
    import json
    import re
    from pathlib import Path

    from ratchet.workflows import training
    from ratchet.workflows.training.patches import PATCHES

    package = Path(training.__file__).parent
    used = set()
    for path in package.rglob("*.py"):
        used |= set(re.findall(r"workflow\.patched\((\w+)\.name\)", path.read_text()))
    assert used == {name for name, value in vars(training.patches).items() if value in PATCHES}, used
    assert 'workflow.patched("' not in "".join(p.read_text() for p in package.rglob("*.py")), "a marker outside patches.py"
    tests = Path(__file__).resolve().parents[1]
    for patch in PATCHES:
        if patch.history is None:
            continue
        events = json.loads(gzip.decompress((tests / patch.history).read_bytes()))["events"]
        recorded = set()
        for e in events:
            marker = e.get("markerRecordedEventAttributes") or {}
            if marker.get("markerName") == "core_patch":
                for payloads in marker["details"].values():
                    recorded |= {json.loads(base64.b64decode(p["data"]))["id"] for p in payloads["payloads"]}
        assert patch.name not in recorded, f"{patch.history} carries {patch.name!r}: it does not replay the old branch"


# --------------------------------------------------------------------------- trackers


class ProbeTracker:
    """A tracker backend written against `Tracker` alone, as a new one would be: it keeps
    what it is given in memory (class-level, so a test sees every instance's calls)."""

    name = "probe"
    saves_last_step = True
    calls: list[tuple] = []

    def __init__(self, tracking):
        self.experiment = tracking.experiment
        self.last: int | None = None

    def start_or_continue(self, run, saved):
        self.last = saved.get("last_step")
        self.calls.append(("start", run.run_id, self.experiment, self.last))
        return {"continued": self.last is not None, "last_step": self.last}

    def last_step(self):
        return self.last

    def log_config(self, config):
        self.calls.append(("config", config["tracking"]["tags"]))

    def log_step(self, step, metrics, time_unix=None):
        self.calls.append(("step", step, dict(metrics)))
        self.last = step

    def log_summary(self, summary):
        self.calls.append(("summary", dict(summary)))

    def close(self, failed=False):
        self.calls.append(("close", failed))


def test_every_tracker_entry_resolves_to_a_builder_of_one_tracking_section():
    from ratchet.config.schema import TrackingConfig
    from ratchet.tracking import Tracker
    from ratchet.catalog.trackers import TRACKERS

    assert TRACKERS.names() == ["mlflow", "wandb"]
    defaults = TrackingConfig()
    assert {n: TRACKERS.get(n).enabled(defaults) for n in TRACKERS.names()} == {"mlflow": True, "wandb": False}
    for name in TRACKERS.names():
        builder = TRACKERS.get(name).builder()
        assert list(inspect.signature(builder).parameters) == ["tracking"], name
    wandb = TRACKERS.get("wandb").builder()(TrackingConfig.model_validate({"wandb": {"enabled": True, "project": "p"}}))
    assert isinstance(wandb, Tracker) and wandb.name == "wandb" and wandb.project == "p" and wandb.saves_last_step


def test_a_tracker_added_to_the_catalog_is_built_fed_and_continued(tmp_path):
    """One catalog line and a module: a run whose config turns the backend on (here: the
    tag `probe`) logs to it, each step once, and a later process continues it from
    tracking.json."""
    from ratchet.tracking import RunTracking
    from ratchet.catalog.trackers import TRACKERS, TrackerEntry

    TRACKERS.register("probe", TrackerEntry(f"{__name__}:ProbeTracker", lambda t: "probe" in t.tags, "a test's tracker"))
    ProbeTracker.calls.clear()
    config = {"tracking": {"mlflow": False, "experiment": "exp", "tags": ["probe"]}}
    try:
        first = RunTracking.open("run-1", str(tmp_path), config=config)
        assert first.start() == ["probe"]
        first.log_step(0, {"step": 0, "reward_mean": 0.5, "note": "text"})
        first.log_step(0, {"step": 0, "reward_mean": 0.5})  # a retried record_step: no second point
        first.log_step(1, {"step": 1, "reward_mean": 0.75})
        first.close()
        second = RunTracking.open("run-1", str(tmp_path), config=config)  # another worker process
        assert second.start() == ["probe"]
        second.finish({"steps": 2.0})
        second.close(failed=True)
        off = RunTracking.open("run-2", str(tmp_path / "other"), config={"tracking": {"mlflow": False}})
        assert off.start() == []
    finally:
        TRACKERS.entries.pop("probe")
    assert ProbeTracker.calls == [
        ("start", "run-1", "exp", None), ("config", ["probe"]),
        ("step", 0, {"reward_mean": 0.5}), ("step", 1, {"reward_mean": 0.75}), ("close", False),
        ("start", "run-1", "exp", 1), ("config", ["probe"]), ("summary", {"steps": 2.0}), ("close", True),
    ]  # fmt: skip


# --------------------------------------------------------------------------- the catalog package


def test_the_catalog_tables_load_no_heavy_library():
    """Every table of `ratchet.catalog` is read by the config schema in a client or CLI
    process: importing all of them (and reading every name) loads none of the libraries
    behind the entries."""
    import subprocess
    import sys
    import textwrap

    heavy = ("torch", "numpy", "transformers", "ray", "temporalio", "mlflow", "wandb", "fsspec", "s3fs", "minio", "optuna", "sqlalchemy")
    code = textwrap.dedent(
        f"""\
        import importlib, pkgutil, sys
        import ratchet.catalog as catalog
        from ratchet.catalog.registry import Registry
        tables = 0
        for info in pkgutil.iter_modules(catalog.__path__):
            module = importlib.import_module(f"ratchet.catalog.{{info.name}}")
            for value in vars(module).values():
                if isinstance(value, Registry):
                    assert value.names(), value.kind
                    tables += 1
        loaded = [name for name in {heavy!r} if name in sys.modules]
        assert not loaded, loaded
        print(tables)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # algorithms (adv, policy loss, kl, loss aggregation, off-policy, preference), engines,
    # storage schemes, loop modes, trackers, tool classes, weight transports
    assert int(out.stdout) >= 12, out.stdout


# --------------------------------------------------------------------------- weight transports


def test_the_weight_transports_are_the_configs_and_each_has_every_side():
    """`trainer.sync_transport` accepts `auto` and exactly the catalog's transports, the
    placement rules (config/sync_transport.py) know each one, and each entry has the driver's,
    the trainer rank's and the replica's side of the WeightTransport interface under its own name."""
    import typing

    from ratchet.catalog.weight_transports import WEIGHT_TRANSPORTS
    from ratchet.config.schema import TrainerConfig
    from ratchet.config.sync_transport import Transport

    allowed = set(typing.get_args(TrainerConfig.model_fields["sync_transport"].annotation))
    assert allowed == {"auto", *WEIGHT_TRANSPORTS}, "trainer.sync_transport's Literal and catalog/weight_transports.py differ"
    assert {t.value for t in Transport} == set(WEIGHT_TRANSPORTS), "give config/sync_transport.py a rule for each transport"
    for name, transport in WEIGHT_TRANSPORTS.objects():
        assert transport.name == name
        for method in ("serving", "prepare", "open_relay", "send", "source"):
            assert callable(getattr(transport, method, None)), f"{name} has no {method}"


def test_config_imports_nothing_from_workers_or_workflows():
    """The config layer sits under the workers and the workflows: it reads their tables
    from `ratchet.catalog`, never their modules (not even inside a function)."""
    import ast

    config = Path(__file__).resolve().parents[2] / "src" / "ratchet" / "config"
    found = []
    for path in sorted(config.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{path.name}: {n}" for n in names if n.startswith(("ratchet.workers", "ratchet.workflows"))]
    assert found == [], found


def test_the_activities_send_no_ray_calls_of_their_own():
    """Activities call the worker layer's typed operations (RunActors and its groups); no
    `.remote(` call, ObjectRef or actor handle is theirs. The supervised stage's chunk is the
    one Ray task still launched from its activity (activities/supervised.py)."""
    import ast

    activities = Path(__file__).resolve().parents[2] / "src" / "ratchet" / "activities"
    found = []
    for path in sorted(activities.glob("*.py")):
        if path.name == "supervised.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("remote", "options"):
                found.append(f"{path.name}:{node.lineno}")
    assert found == [], f"Ray calls in activities (move them into src/ratchet/workers/actors/): {found}"
