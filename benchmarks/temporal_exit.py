"""How often a short script that calls Temporal crashes on its way out.

The Temporal SDK hands each result to Python from a Tokio thread, and a script that ends
right after its last call can finalize the interpreter under that thread:
`Fatal Python error: PyGILState_Release` (exit 134) or a segfault, after the work is done
(temporalio/sdk-python#300; ratchet's README walkthrough hit it on CI). ratchet's clients
wait for those threads at exit (`ratchet.platform.temporal_exit`). This starts a Temporal
dev server of its own, keeps `--busy` processes spinning (the crash needs a thread kept off
the CPU for a moment, as on a loaded CI machine), and runs each kind of script `--runs`
times. Prints one table: runs and crashes per script.

    .venv/bin/python benchmarks/temporal_exit.py [--runs 150] [--busy 3]
    .venv/bin/python benchmarks/temporal_exit.py --smoke   # that it still runs
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

# One call, then the end of the script: the SDK's thread may still be in its callback.
SCRIPTS = {
    "SDK client alone": """
import asyncio, sys
from temporalio.client import Client
loop = asyncio.new_event_loop()
client = loop.run_until_complete(Client.connect(sys.argv[1]))
loop.run_until_complete(client.count_workflows())
""",
    "SDK client, ratchet's exit guard": """
import asyncio, sys
from temporalio.client import Client
from ratchet.platform.temporal_exit import guard_interpreter_exit
guard_interpreter_exit()
loop = asyncio.new_event_loop()
client = loop.run_until_complete(Client.connect(sys.argv[1]))
loop.run_until_complete(client.count_workflows())
""",
    "ratchet.Client": """
import sys
import ratchet
client = ratchet.Client.connect(sys.argv[1], payload_key_file=sys.argv[2])
client.workflow_status("no-such-run")
""",
}


def crashes(script: str, runs: int, address: str, key_file: Path) -> tuple[int, str]:
    """(runs that exited non-zero, the first one's last stderr line)."""
    failed, first = 0, ""
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-c", script, address, str(key_file)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            failed += 1
            lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
            first = first or next((line for line in lines if "Fatal Python error" in line), lines[-1])
    return failed, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=150)
    parser.add_argument("--busy", type=int, default=3, help="processes spinning on the CPUs meanwhile")
    parser.add_argument("--smoke", action="store_true", help="3 runs each, no busy processes")
    args = parser.parse_args()
    runs, busy = (3, 0) if args.smoke else (args.runs, args.busy)

    from ratchet.platform.payload_key import key_file_path
    from ratchet.platform.services import ServiceSettings, free_ports, temporal_address
    from ratchet.platform.services import temporal_server

    with tempfile.TemporaryDirectory(prefix="ratchet-temporal-exit-") as work:
        port, ui_port = free_ports(2)
        settings = ServiceSettings(state_dir=Path(work), temporal_port=port, temporal_ui_port=ui_port, start_timeout_s=60)
        record = temporal_server.start(settings)
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            rows = {
                name: crashes(script, runs, temporal_address(settings), key_file_path(settings.state_dir))
                for name, script in SCRIPTS.items()
            }
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
            temporal_server.stop(record, 10.0)

    table = Table(title=f"crashes at exit: one Temporal call, then the end of the script ({busy} busy processes, {os.cpu_count()} CPUs)")
    for column in ("script", "runs", "crashed", "first crash"):
        table.add_column(column)
    for name, (failed, first) in rows.items():
        table.add_row(name, str(runs), str(failed), first or "-")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
