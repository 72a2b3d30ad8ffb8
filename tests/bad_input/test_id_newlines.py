"""Ids with a trailing newline are refused everywhere an id enters.

Before: the id pattern ended in `$`, which also matches before a final newline, so
`run1\\n` was a valid run id (and sweep id, schedule id, checkpoint name): an object key and
a Temporal id with a newline in them, which no later `ratchet` command could name; and a
checkpoint name `step-20\\n` was read as step-00000020. Now ids are matched whole
(`fullmatch`). The config's name patterns (tracking.name, pool names, the sweep name) are
pydantic's, whose regex engine matches `$` only at the very end: they refused it already,
and are checked here so that it stays so.
"""

from __future__ import annotations


import pytest

from ratchet.config import ConfigError, load_config
from ratchet.config.sweep_spec import SweepSpecError, load_sweep_spec
from ratchet.ids import InvalidId, check_id, is_valid_id
from ratchet.platform.fork import checkpoint_name
from ratchet.storage.object_store import ObjectStore

BASE = {"model": {"path": "/nowhere"}, "data": {"train_files": "/nowhere.parquet"}}
ENDINGS = ["\n", "\r\n", " "]


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("what", ["run id", "sweep id", "schedule id", "checkpoint name"])
def test_an_id_with_a_trailing_newline_is_invalid(what, ending):
    assert is_valid_id("run1") and not is_valid_id("run1" + ending)
    with pytest.raises(InvalidId, match=f"invalid {what} 'run1"):
        check_id("run1" + ending, what)


def test_entry_points_refuse_it_before_storage_or_temporal(offline_client, tmp_path):
    with pytest.raises(InvalidId, match="invalid run id"):
        offline_client.submit("no-such-config.yaml", run_id="run1\n")
    with pytest.raises(InvalidId, match="invalid run id"):
        offline_client.resume("run1\n", root=str(tmp_path))
    with pytest.raises(InvalidId, match="invalid sweep id"):
        offline_client.get_sweep("sweep1\n")
    with pytest.raises(InvalidId, match="invalid run id"):
        ObjectStore(str(tmp_path)).child("run1\n")
    # Read as step-00000020 before, which the fork then copied.
    assert checkpoint_name("step-20") == "step-00000020" and checkpoint_name("step-20\n") == "step-20\n"
    with pytest.raises(InvalidId, match="invalid checkpoint name 'step-20\\\\n'"):
        offline_client.fork("parent", "step-20\n", root=str(tmp_path))
    from ratchet.platform.schedules import create_schedule

    with pytest.raises(InvalidId, match="invalid schedule id"):
        create_schedule(offline_client, "nightly\n", config="unused.yaml", every="1d")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key", ["tracking.name", "tracking.experiment", "resources.pools"])
def test_config_names_refuse_it(key):
    value = [{"name": "pool\n", "cpus_per_node": 1, "roles": ["trainer", "rollout"]}] if key == "resources.pools" else "name\n"
    section, field = key.split(".")
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, [], base={**BASE, section: {field: value}}, check_files=False)
    assert any(k.startswith(key) and "must match the pattern" in why for k, why in excinfo.value.issues), excinfo.value.issues


def test_a_sweep_name_refuses_it():
    spec = {"name": "sweep\n", "base": dict(BASE), "space": {"trainer.lr": [1e-4]}}
    with pytest.raises(SweepSpecError, match="name"):
        load_sweep_spec(spec)
