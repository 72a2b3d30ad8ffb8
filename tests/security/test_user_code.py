"""User code (reward, cost and filter functions, tool classes) another user could have
written is refused before it runs.

Before: `import_user_module` ran any 'path/to/file.py' or 'package.module' it was given,
so a file another user owns, or one they can write (or put in a folder they can write),
ran with the worker's rights: its files, its credentials, the Ray cluster. Now the file
and its folder must be owned by you or root and writable by nobody else (group write is
allowed only in a user-private group; a sticky folder like /tmp is allowed). The submit
check imports the same code, so the run is refused before any work starts, with the key,
the file, its owner or mode and the fix.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from ratchet.config import ConfigError, load_config
from ratchet.tasks.generate import write_task_parquet
from ratchet.catalog.tools import resolve_class
from ratchet.user_code import UserCodeError, import_user_module

ROOT_ONLY = pytest.mark.skipif(os.getuid() != 0, reason="only root can give a file to another user")
STRANGER = 12345  # a uid and gid nobody on the machine has


def _code(folder: Path, name: str, marker: Path) -> Path:
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / name
    path.write_text(
        textwrap.dedent(
            f"""\
            open({str(marker)!r}, "w").close()  # proves the module ran
            def compute_score(data_source, solution_str, ground_truth, extra_info=None):
                return 1.0
            class MyTool:
                pass
            """
        )
    )
    path.chmod(0o644)
    return path


@pytest.fixture
def code(tmp_path) -> tuple[Path, Path]:
    marker = tmp_path / "ran"
    return _code(tmp_path / "mine", "reward_code.py", marker), marker


def _refused(path: Path, marker: Path, *patterns: str) -> str:
    with pytest.raises(UserCodeError) as err:
        import_user_module(str(path), "ratchet_test_untrusted")
    message = str(err.value)
    assert str(path) in message
    for pattern in patterns:
        assert pattern in message, message
    assert not marker.exists(), "the code ran before it was refused"
    return message


def test_own_private_code_loads(code):
    path, marker = code
    assert import_user_module(str(path), "ratchet_test_untrusted").compute_score("", "", "") == 1.0
    assert marker.exists()


def test_code_others_can_write_is_refused(code):
    path, marker = code
    path.chmod(0o646)
    _refused(path, marker, "writable by other users (mode 646)", f"chmod go-w {path}")
    if os.getuid() == 0:  # group write, in a group that is not the owner's alone
        path.chmod(0o664)
        os.chown(path, -1, STRANGER)
        _refused(path, marker, "writable by other users (mode 664)")


def test_code_in_a_folder_others_can_write_is_refused_but_a_sticky_one_is_not(code):
    path, marker = code
    path.parent.chmod(0o777)
    _refused(path, marker, f"its folder {path.parent} is writable by other users (mode 777)", f"chmod go-w {path.parent}")
    path.parent.chmod(0o1777)  # like /tmp: nobody else can replace or remove your file
    import_user_module(str(path), "ratchet_test_untrusted")
    assert marker.exists()


@ROOT_ONLY
def test_code_another_user_owns_is_refused(code):
    path, marker = code
    os.chown(path, STRANGER, -1)
    _refused(path, marker, f"is owned by uid {STRANGER}, not by you or root", f"chown {os.getuid()} {path}")
    os.chown(path, 0, -1)
    os.chown(path.parent, STRANGER, -1)
    _refused(path, marker, f"its folder {path.parent} is owned by uid {STRANGER}")


def test_installed_module_others_can_write_is_refused(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    path = _code(tmp_path / "site", "ratchet_test_writable_mod.py", marker)
    monkeypatch.syspath_prepend(str(path.parent))
    path.chmod(0o666)
    with pytest.raises(UserCodeError, match="writable by other users"):
        import_user_module("ratchet_test_writable_mod")
    assert "ratchet_test_writable_mod" not in sys.modules and not marker.exists()
    with pytest.raises(ValueError, match=r"tools\[0\].class_name: user code .*writable by other users"):
        resolve_class("ratchet_test_writable_mod:MyTool", "tools[0].class_name")


def test_submit_check_refuses_the_run_before_work_starts(code, tmp_path):
    """`load_config` (what `ratchet train` and `Client.submit` run first) names each key."""
    path, marker = code
    path.chmod(0o666)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 128}')
    train = write_task_parquet(tmp_path / "train.parquet", "copy", 4, seed=0)
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(f"model:\n  path: {model}\ndata:\n  train_files: {train}\n")
    overrides = [f"reward.function={path}:compute_score", f"rollout.filter={path}:compute_score"]
    with pytest.raises(ConfigError) as err:
        load_config(yaml_path, overrides)
    issues = dict(err.value.issues)
    for key in ("reward.function", "rollout.filter"):
        assert "writable by other users (mode 666)" in issues[key] and f"chmod go-w {path}" in issues[key], issues
    assert not marker.exists()
