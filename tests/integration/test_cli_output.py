"""What the CLI shows, run as a real subprocess at 80 columns with no terminal (as under CI
or in a pipe): no key, name, id, path or link is cut or broken across lines; `ratchet
schema SECTION`; `ratchet status` with the runs in flight, or why it cannot list them;
`ratchet train`'s summary with the run's wall time and its Temporal UI link; Ctrl-C on
`ratchet train` leaves the run going and `ratchet watch` re-attaches to it."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ratchet.platform.client import RECIPE_PATH

RATCHET = [sys.executable, "-m", "ratchet.platform.cli"]
NARROW = {"COLUMNS": "80"}
# Variables of the developer's shell that would point the CLI elsewhere.
_POINTERS = ("RATCHET_TEMPORAL_ADDRESS", "RATCHET_TEMPORAL_PORT", "RATCHET_TEMPORAL_UI_PORT", "RATCHET_TEMPORAL_UI_URL", "RATCHET_RAY_PORT")


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _POINTERS}
    return {**env, **NARROW, **(extra or {})}


def run_cli(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*RATCHET, *args], capture_output=True, text=True, timeout=timeout, env=_env(env))


def popen_cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    # SIGINT as a shell gives it: a pytest-xdist worker ignores SIGINT, and a child would
    # inherit that (Python installs no KeyboardInterrupt handler then).
    return subprocess.Popen(
        [*RATCHET, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


def read_until(proc: subprocess.Popen, needle: str) -> str:
    """stdout lines up to the first that contains `needle` (the process may print more)."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"{needle!r} never printed; stdout: {''.join(seen)!r}; stderr: {proc.stderr.read()!r}")


def whole(text: str, fact: str) -> bool:
    """`fact` on one line of `text`, not run into a longer word (a key, a name, an id)."""
    return re.search(rf"(?<![\w.\-/]){re.escape(fact)}(?![\w.\-/])", text) is not None


def schema_keys() -> list[str]:
    from ratchet.config.schema import RunConfig
    from ratchet.platform.cli import _fields

    return [key for key, *_ in _fields(RunConfig)]


# -- nothing running ------------------------------------------------------------------


def test_schema_at_80_columns_cuts_no_key():
    out = run_cli("schema")
    assert out.returncode == 0, out.stderr
    assert "…" not in out.stdout
    keys = schema_keys()
    missing = [k for k in keys if not whole(out.stdout, k)]
    assert not missing and whole(out.stdout, "resources.rollout_cpus"), missing
    assert "'auto' | 'object_store' | 'cuda_ipc' | 'nccl'" in out.stdout  # a type, whole


def test_schema_section_shows_only_its_keys():
    out = run_cli("schema", "trainer")
    assert out.returncode == 0, out.stderr
    trainer = [k for k in schema_keys() if k.startswith("trainer.")]
    headed = [line for line in out.stdout.splitlines() if line in schema_keys()]  # each key heads its lines
    assert headed == trainer and len(trainer) >= 10
    nested = run_cli("schema", "rollout.vllm")
    assert [line for line in nested.stdout.splitlines() if line in schema_keys()] == [
        k for k in schema_keys() if k.startswith("rollout.vllm.")
    ]


def test_schema_unknown_section_names_the_sections():
    out = run_cli("schema", "trainr")
    sections = ", ".join(sorted({k.split(".")[0] for k in schema_keys()}))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == f"no config section 'trainr' (did you mean 'trainer'?); the sections are: {sections}"


def test_checkpoint_names_stay_whole_at_80_columns(tmp_path):
    from ratchet.storage.checkpoint_store import CheckpointStore
    from ratchet.storage.object_store import ObjectStore

    run_id = "a-rather-long-experiment-name-20261202-054448-ab12"
    local = tmp_path / "local"
    local.mkdir()
    (local / "model.safetensors").write_bytes(b"x" * 2_000_000)
    store = CheckpointStore(ObjectStore(str(tmp_path / "runs")).child(run_id))
    names = ["step-00000010", "step-00000020"]
    for i, name in enumerate(names):
        store.commit(name, local, {"step": 10 * (i + 1), "policy_version": 10 * (i + 1), "world_size": 1})
    out = run_cli("checkpoints", run_id, "--root", str(tmp_path / "runs"))
    assert out.returncode == 0, out.stderr
    assert "…" not in out.stdout and all(whole(out.stdout, n) for n in names), out.stdout
    assert whole(out.stdout, run_id) and "2.0" in out.stdout  # MB


def test_summary_keeps_paths_and_the_link_whole():
    """The summary at 80 columns: paths and the run's UI link each whole on one line; on a
    wide terminal the same facts as a table."""
    from rich.console import Console

    from ratchet.platform.tables import show
    from ratchet.platform.watch import summary_table
    from ratchet.types import RunSummary

    run_id = "copy-grpo-with-a-long-name-20261202-054448-ab12"
    root = "/tmp/a/deep/folder/for/the/object/store/of/this/machine/runs"
    summary = RunSummary(run_id, f"{root}/{run_id}", 30, 30, f"{root}/{run_id}/final/hf", 0.1, 0.9, {"30": 0.8}, 2.0, 0.5)
    link = f"http://127.0.0.1:8233/namespaces/research/workflows/{run_id}"
    for width in (80, 250):
        buf = io.StringIO()
        show(Console(file=buf, width=width, force_terminal=False), summary_table(summary, 12.34, "http://127.0.0.1:8233", "research"))
        text = buf.getvalue()
        for fact in (f"{root}/{run_id}/final/hf", f"{root}/{run_id}/metrics.jsonl", link):
            assert whole(text, fact), (width, text)
        assert re.search(r"wall time\W+12\.3 s", text) and "…" not in text
        assert ("│" in text) == (width == 250)  # a table only where it fits


@pytest.mark.slow
def test_status_without_services_says_so(tmp_path):
    from ratchet.platform.services import free_ports

    t, ui, r = free_ports(3)
    ports = {"RATCHET_TEMPORAL_PORT": str(t), "RATCHET_TEMPORAL_UI_PORT": str(ui), "RATCHET_RAY_PORT": str(r)}
    out = run_cli("status", "--state-dir", str(tmp_path), env=ports)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"services (state folder {tmp_path}, namespace default)"
    assert f"  temporal     not running  127.0.0.1:{t}  start it with `ratchet up`" in lines
    assert f"  Temporal UI  not running  http://127.0.0.1:{ui}" in lines
    assert (
        lines[-1] == f"runs in flight: unknown: Temporal does not answer at 127.0.0.1:{t} (connection refused): start it with `ratchet up`"
    )
    data = json.loads(run_cli("status", "--json", "--state-dir", str(tmp_path), env=ports).stdout)
    assert data["temporal_address"] == f"127.0.0.1:{t}" and data["temporal"]["running"] is False
    assert data["runs_in_flight"] is None and "connection refused" in data["runs_unknown"] and "started" not in data


# -- on the session platform (Temporal, Ray, a worker) ------------------------------


def _platform_env(platform) -> dict:
    from ratchet.platform.services import temporal_address

    # The state folder: the UI link comes from its services.json.
    return {"RATCHET_TEMPORAL_ADDRESS": temporal_address(platform.settings), "RATCHET_STATE_DIR": str(platform.settings.state_dir)}


def _tiny(platform, name: str, steps: int) -> list[str]:
    return platform.overrides(f"loop.steps={steps}", "warmup.steps=0", "data.eval_files=null", f"tracking.name={name}")


def _wall_time(text: str) -> float:
    found = re.findall(r"wall time\W+(\d+\.\d) s", text)
    assert len(found) == 1, text
    return float(found[0])


@pytest.mark.integration
def test_watch_unknown_run(platform):
    out = run_cli("watch", "no-such-run", env=_platform_env(platform))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (
        "no run 'no-such-run' on the Temporal server (namespace 'default'): `ratchet status` lists the runs in flight, "
        "`ratchet runs` the runs the registry knows"
    )


@pytest.mark.integration
def test_ctrl_c_leaves_the_run_going_and_watch_reattaches(platform):
    """Ctrl-C on `ratchet train` leaves the run going; `ratchet watch` follows it to its end
    and shows the summary. (A `train` that follows a run to its end runs the same code; a
    run of its own for it cost a run's actor starts.)"""
    env = _platform_env(platform)
    steps = 4
    train = popen_cli("train", str(RECIPE_PATH), *_tiny(platform, "ctrlc", steps), env=env)
    run_id = read_until(train, "submitted run ").split("submitted run ")[1].split()[0]
    read_until(train, f"following run {run_id}")
    train.send_signal(signal.SIGINT)
    _, err = train.communicate(timeout=60)
    assert train.returncode == 130, err
    assert err.strip() == f"the run goes on without you: follow it with `ratchet watch {run_id}`, stop it with `ratchet stop {run_id}`"

    handle = platform.client.get(run_id)
    handle.pause()  # held open, so that `watch` below surely finds it running
    status = run_cli("status", "--state-dir", str(platform.settings.state_dir), env=env)
    assert status.returncode == 0, status.stderr
    assert whole(status.stdout, run_id) and re.search(rf"\b\d+/{steps}\b", status.stdout), status.stdout
    assert f"http://127.0.0.1:{platform.settings.temporal_ui_port}" in status.stdout

    watch = popen_cli("watch", run_id, env=env)
    read_until(watch, f"following run {run_id}")
    handle.resume()
    out, err = watch.communicate(timeout=240)
    assert watch.returncode == 0, err
    summary = handle.result()
    assert summary.steps == steps
    # The bar's end, then the summary (what `train` shows when it follows a run to its end:
    # the same code, platform/cli.py `_follow`), with the facts a user looks for.
    assert f"{steps}/{steps}" in out and "sampled reward, last 10 steps" in out
    assert (Path(summary.run_uri) / "metrics.jsonl").read_text().count("\n") == steps
    link = f"http://127.0.0.1:{platform.settings.temporal_ui_port}/namespaces/default/workflows/{run_id}"
    for fact in (link, summary.final_policy_uri, f"{summary.run_uri}/metrics.jsonl"):
        assert whole(out, fact), out
    wall = _wall_time(out)
    assert wall > 0 and "…" not in out
    # `watch` on the finished run: no bar, the same summary and the same (recorded) wall time.
    again = run_cli("watch", run_id, env=env)
    assert again.returncode == 0, again.stderr
    assert "following run" not in again.stdout and whole(again.stdout, link) and _wall_time(again.stdout) == wall
