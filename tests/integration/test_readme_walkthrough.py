"""The README's "Using it" section, pasted as it is into a fresh shell, works.

A newcomer copies those lines after `make demo`: every line must run without an error,
the run must complete, and nothing may need a command the README does not give. The
section's shell blocks and its Python block are taken from README.md itself, so the test
follows the README when it changes. What the test adds is bookkeeping around the pasted
lines (private ports, a folder of its own, the worker's exit); it never edits them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ratchet.platform.services import free_ports

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def using_it_blocks() -> list[tuple[str, str]]:
    """(language, code) of each fenced block in the README's "Using it" section."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Using it\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(bash|python)\n(.*?)```", section, flags=re.S)


def test_the_section_has_the_commands_a_newcomer_needs():
    """Without a running test: the section activates the virtualenv first, runs each
    command on its own line (no `a | b`, which once stopped everything), and ends with
    `ratchet down`."""
    blocks = using_it_blocks()
    assert [lang for lang, _ in blocks] == ["bash", "python", "bash"]
    lines = [line.split("#")[0].strip() for lang, code in blocks if lang == "bash" for line in code.splitlines()]
    lines = [line for line in lines if line]
    assert lines[0] == "source .venv/bin/activate"
    assert not any("|" in line for line in lines), lines
    assert lines[-1] == "ratchet down"
    assert "../" not in (REPO / "README.md").read_text(), "the README links outside the repository"


def test_the_package_is_not_shadowed_by_a_folder_named_ratchet(tmp_path):
    """The README's Python run from the folder that holds the clone (a folder named
    `ratchet/` with no `__init__.py`) once imported that folder as a namespace package:
    `module 'ratchet' has no attribute 'Client'`. With the src layout it cannot."""
    (tmp_path / "ratchet" / "src").mkdir(parents=True)
    out = subprocess.run(
        [sys.executable, "-c", "import ratchet; print(ratchet.Client.__name__, ratchet.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    name, path = out.stdout.split()
    assert name == "Client" and Path(path) == REPO / "src" / "ratchet" / "__init__.py"


def _script(blocks: list[tuple[str, str]]) -> str:
    """The pasted lines as one bash script: `set -e` stops at the first failing line, as a
    reader would. The worker's pid is noted after the line that starts it (bookkeeping)."""
    # A line that fails ends the script (set -e) with the worker still up: stop it then, so
    # its open output does not keep the test waiting for its time limit, blind.
    parts = ["set -e", 'trap \'[ $? -eq 0 ] || [ -z "${WORKER_PID:-}" ] || kill "$WORKER_PID" 2>/dev/null\' EXIT']
    for lang, code in blocks:
        if lang == "python":
            parts.append(f"python - <<'PYTHON'\n{code}PYTHON")
            continue
        for line in code.splitlines():
            parts.append(line)
            if line.split("#")[0].strip().endswith("&"):
                parts.append("WORKER_PID=$!")
    # After `ratchet down` the worker must go by itself.
    parts.append(
        textwrap.dedent(
            """
            for _ in $(seq 90); do kill -0 "$WORKER_PID" 2>/dev/null || break; sleep 1; done
            if kill -0 "$WORKER_PID" 2>/dev/null; then echo "WORKER STILL RUNNING"; kill "$WORKER_PID"; exit 3; fi
            echo "WALKTHROUGH DONE"
            """
        )
    )
    return "\n".join(parts) + "\n"


def test_using_it_works_pasted_into_a_fresh_shell(tmp_path):
    """A folder of its own holding what the README's commands expect at the top of a clone
    after `make demo` (the virtualenv and the examples), private ports, and a shell
    started without the test's environment tweaks (no RATCHET_STATE_DIR)."""
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    (tmp_path / "examples").symlink_to(REPO / "examples")
    temporal, ui, ray = free_ports(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RATCHET_", "RAY_", "VIRTUAL_ENV"))}
    env.update(
        PATH="/usr/bin:/bin", HOME=str(tmp_path / "home"), COLUMNS="120",
        RATCHET_TEMPORAL_PORT=str(temporal), RATCHET_TEMPORAL_UI_PORT=str(ui), RATCHET_RAY_PORT=str(ray),
        RATCHET_MLFLOW_UI_PORT="off", RATCHET_STICKY_TIMEOUT_S="1",
        # After `ratchet down` the worker goes once the services stay gone this long (a
        # user's default is 120 s for Temporal, 55 s for the Ray head): the test waits less.
        RATCHET_WORKER_LOST_SERVER_S="10",
    )  # fmt: skip
    script = _script(using_it_blocks())
    try:
        out = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    except subprocess.TimeoutExpired as exc:
        text = [(b or b"").decode(errors="replace") if isinstance(b, bytes) else (b or "") for b in (exc.stdout, exc.stderr)]
        pytest.fail(f"timed out after 540 s\n--- stdout\n{text[0][-6000:]}\n--- stderr\n{text[1][-6000:]}")
    finally:
        subprocess.run([str(Path(sys.prefix) / "bin" / "ratchet"), "down"], cwd=tmp_path, env=env, capture_output=True, timeout=120)
    shown = f"exit {out.returncode}\n--- stdout\n{out.stdout[-6000:]}\n--- stderr\n{out.stderr[-6000:]}"
    assert out.returncode == 0 and "WALKTHROUGH DONE" in out.stdout, shown
    assert "Traceback" not in out.stdout + out.stderr, shown
    run_ids = re.findall(r"submitted run (\S+)", out.stdout)
    assert len(run_ids) == 1, shown
    assert "10/10" in out.stdout, shown  # the progress bar's last state
    # `ratchet runs` lists the CLI's run too; the Python block's run completed its 5 steps.
    assert out.stdout.count(run_ids[0]) >= 2, shown
    steps = {p.parent.name: p.read_text().count("\n") for p in (tmp_path / ".ratchet" / "runs").glob("*/metrics.jsonl")}
    assert steps.pop(run_ids[0]) == 10 and list(steps.values()) == [5], (steps, shown)
