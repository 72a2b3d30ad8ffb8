"""The code runner runs model code in a real sandbox (bubblewrap + a control group per call).

Before: `python -I` in a temporary folder with rlimits. Model code read the worker's secrets
from /proc/<ppid>/environ, read any file of the worker (state folder, Ray token, data with
the ground truths, the reward's source), wrote outside its folder, connected to services on
127.0.0.1, ran /bin/sh, imported the worker's site-packages, killed its parent; a forked
child outlived the call, limits were per process (no process-count limit at all), and the
parent read `output.txt` by a path the child could replace. Each test here runs the real
isolation (the security tests' CI installs bubblewrap: Makefile) and fails on that code.
"""

from __future__ import annotations

import glob
import logging
import os
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import psutil
import pytest

from ratchet.tools import cgroup, sandbox
from ratchet.tools.code_runner import CodeRunner
from ratchet.tools.config import tool_issues
from ratchet.workflows import search_attributes as sa


def runner(**config) -> CodeRunner:
    return CodeRunner({"timeout_s": 20.0, "cpu_s": 5, "memory_mb": 256, "max_output_chars": 4000, **config})


def run(code: str, **config) -> str:
    return runner(**config)({"code": textwrap.dedent(code)})


def leftovers(marker: str) -> list[int]:
    """Host pids whose command line carries `marker`."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in p.info["cmdline"] or []):
            out.append(p.pid)
    return out


def own_groups() -> list[str]:
    return glob.glob(f"/sys/fs/cgroup/**/ratchet-sandbox-{os.getpid()}-*", recursive=True)


# -- what it can see ------------------------------------------------------------------------


def test_the_workers_secrets_are_not_readable(monkeypatch):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("RATCHET_TEST_SECRET", secret)
    monkeypatch.setenv("WANDB_API_KEY", secret)
    out = run("""
        import os
        print("pids", sorted(p for p in os.listdir("/proc") if p.isdigit()))
        for pid in [os.getppid(), 1, *[p for p in os.listdir("/proc") if p.isdigit()]]:
            try:
                print(pid, open(f"/proc/{pid}/environ", "rb").read())
            except OSError as e:
                print(pid, type(e).__name__)
        print("env", sorted(os.environ))
    """)
    assert secret not in out
    assert "env ['HOME', 'LANG', 'PATH', 'TMPDIR']" in out
    # A pid namespace of its own: bubblewrap's init (1) and the program (2), nothing of the host's.
    assert "pids ['1', '2']" in out


def test_the_workers_files_are_not_visible(tmp_path):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    state = tmp_path / ".ratchet"
    state.mkdir()
    (state / "ray_auth_token").write_text(secret)  # the Ray token file under the state folder
    (tmp_path / "train.jsonl").write_text(f'{{"ground_truth": "{secret}"}}\n')  # a dataset
    import numpy
    import ratchet.tasks.tool_tasks as reward_source

    paths = [state / "ray_auth_token", tmp_path / "train.jsonl", Path(reward_source.__file__), Path(numpy.__file__),
             Path(sys.prefix) / "pyvenv.cfg", Path(os.environ["RATCHET_STATE_DIR"]), Path("/etc/passwd"), Path.home() / ".bashrc"]  # fmt: skip
    out = run(f"""
        import os
        for p in {[str(p) for p in paths]!r}:
            try:
                print("READ", p, open(p).read()[:200] if os.path.isfile(p) else os.listdir(p))
            except OSError as e:
                print("DENIED", p, type(e).__name__)
        try:
            print("HOME", sorted(os.listdir({str(Path.home())!r})))
        except OSError as e:
            print("HOME", type(e).__name__)
    """)
    assert "READ" not in out and secret not in out
    assert out.count("DENIED") == len(paths)
    # The home folder shows at most the path down to the interpreter (bound read-only).
    home_line = next(line for line in out.splitlines() if line.startswith("HOME"))
    interp = sandbox.interpreter("")
    allowed = {Path(b).relative_to(Path.home()).parts[0] for b in interp.binds if Path(b).is_relative_to(Path.home())}
    assert home_line == "HOME FileNotFoundError" or set(eval(home_line[5:])) <= allowed, home_line


def test_writes_stay_in_its_own_folder(tmp_path):
    name = f"written-{uuid.uuid4().hex}"
    interp = sandbox.interpreter("")
    targets = [str(tmp_path), "/tmp", str(Path.home()), "/", "/usr/lib", "/dev", os.path.dirname(interp.binds[-1]), *interp.masks]
    out = run(f"""
        import os
        for d in {targets!r} + ["."]:
            try:
                with open(os.path.join(d, {name!r}), "w") as f:
                    f.write("x")
                print("WROTE", d)
            except OSError as e:
                print("DENIED", d, type(e).__name__)
    """)
    assert [line for line in out.splitlines() if line.startswith("WROTE")] == ["WROTE ."]
    assert not [t for t in targets if os.path.exists(os.path.join(t, name))]


def test_no_network_not_even_the_workers_loopback():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    try:
        out = run(f"""
            import socket
            for host in ("127.0.0.1", "10.0.0.1", "1.1.1.1"):
                try:
                    socket.create_connection((host, {port}), timeout=2).close()
                    print("CONNECTED", host)
                except OSError as e:
                    print("REFUSED", host, type(e).__name__)
        """)
        listener.settimeout(0)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody came
    finally:
        listener.close()
    assert "CONNECTED" not in out and out.count("REFUSED") == 3


def test_no_shell_and_no_other_program():
    out = run("""
        import os, shutil, subprocess
        print("which", [shutil.which(p) for p in ("sh", "bash", "curl", "env")])
        for argv in (["/bin/sh", "-c", "echo ran-$((6*7))"], ["/usr/bin/env"], ["sh", "-c", "echo ran-$((6*7))"]):
            try:
                subprocess.run(argv)
            except OSError as e:
                print("NO", argv[0], type(e).__name__)
        print("system", os.system("echo ran-$((6*7))"))
    """)
    assert "ran-42" not in out
    assert "which [None, None, None, None]" in out and out.count("NO ") == 3


def test_the_workers_site_packages_are_not_importable():
    import numpy

    site = os.path.dirname(os.path.dirname(numpy.__file__))
    out = run(f"""
        import sys
        for attempt in ("plain", "path"):
            if attempt == "path":
                sys.path.append({site!r})
            try:
                import numpy
                print("IMPORTED", attempt)
            except ImportError as e:
                print("NO", attempt, type(e).__name__)
    """)
    assert "IMPORTED" not in out and "NO plain ModuleNotFoundError" in out and "NO path ModuleNotFoundError" in out


# -- what it can do to the worker -----------------------------------------------------------


def test_killing_its_parent_leaves_the_worker_alive():
    # The worker is a process of its own here: on the old code this killed it (rc -9).
    # Only the parent: never kill(-1) here, which on a broken sandbox would kill every process of the machine.
    code = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('still here')"
    worker = subprocess.run(
        [sys.executable, "-c", f"from ratchet.tools.code_runner import CodeRunner\nprint(repr(CodeRunner()({{'code': {code!r}}})))"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert worker.returncode == 0, worker.stderr
    assert worker.stdout.strip() == "'still here\\n'", worker.stdout


def test_no_process_outlives_the_call():
    marker = f"ratchet-leftover-{uuid.uuid4().hex}"
    body = textwrap.dedent(f"""
        import os, sys
        def sleeper():
            os.execv(sys.executable, [sys.executable, "-S", "-c", "import time; time.sleep(120)", {marker!r}])
        if os.fork() == 0:
            sleeper()  # a plain child
        if os.fork() == 0:  # a double-forked daemon in a session of its own
            os.setsid()
            if os.fork() == 0:
                sleeper()
            os._exit(0)
        print("forked", flush=True)
    """)
    out = run(body)  # normal exit
    assert out.strip() == "forked"
    assert leftovers(marker) == [] and own_groups() == []
    out = run(body + "\nimport time\ntime.sleep(60)", timeout_s=1.0)  # the wall clock
    assert out.endswith("[time limit of 1 s exceeded]")
    assert leftovers(marker) == [] and own_groups() == []
    out = run(body + "\nraise SystemExit(3)")  # an error
    assert out.endswith("[exit code 3]") and leftovers(marker) == [] and own_groups() == []


def test_a_fork_bomb_stops_at_the_process_limit():
    out = run("""
        import os, time
        n = 0
        for _ in range(300):
            try:
                if os.fork() == 0:
                    time.sleep(30)  # killed at the call's end
                    os._exit(0)
                n += 1
            except OSError:
                break
        print("forked", n)
    """, processes=16)  # fmt: skip
    n = int(out.split()[1])
    assert n < 16 and out.endswith("[process limit of 16 reached]"), out
    assert own_groups() == []


def test_memory_limit_covers_the_whole_tree():
    # Three children of 60 MiB each: each is under the per-process limit, the tree is not.
    # Each holds its block until told to go, so "resident 3" means all three blocks were
    # in memory at once. (Counting reports alone is not enough: the kernel may kill a
    # child after it reported, then let the next one allocate in the freed room.)
    out = run("""
        import os, select
        done, wait = os.pipe(), os.pipe()
        kids = []
        for _ in range(3):
            pid = os.fork()
            if pid == 0:
                block = b"x" * (60 << 20)
                os.write(done[1], b"1")
                os.read(wait[0], 1)
                os._exit(0)
            kids.append(pid)
        got = 0
        while got < 3:
            if select.select([done[0]], [], [], 0.05)[0]:
                got += len(os.read(done[0], 3))
            elif any(os.waitpid(k, os.WNOHANG)[0] for k in kids):
                break  # one was killed
        alive = [k for k in kids if os.waitpid(k, os.WNOHANG)[0] == 0]
        print("resident", len(alive) if got == 3 else got, flush=True)
    """, memory_mb=128)  # fmt: skip
    assert "resident 3" not in out and out.endswith("[memory limit of 128 MB exceeded]"), out


def test_cpu_limit_covers_the_whole_tree():
    # Three children of 0.9 CPU-s each: each is under the per-process limit, the tree is not
    # (two finishing would take the tree 0.8 CPU-s past the limit before the worker looked).
    out = run("""
        import os, time
        for _ in range(3):
            if os.fork() == 0:
                t = time.process_time()
                while time.process_time() - t < 0.9:
                    pass
                print("done", flush=True)
                os._exit(0)
        for _ in range(3):
            os.wait()
        print("all done")
    """, cpu_s=1)  # fmt: skip
    assert "all done" not in out and out.count("done") <= 1 and out.endswith("[CPU time limit of 1 s exceeded]"), out


def test_output_is_read_through_the_parents_descriptor_and_capped():
    out = run("""
        import os
        os.symlink("/dev/zero", "output.txt")  # what the parent read by path before
        try:
            with open("big.bin", "wb") as f:
                f.write(b"y" * (64 << 20))
        except OSError as e:
            print("scratch full", type(e).__name__)
        print("hi", flush=True)
        os.write(1, b"z" * (64 << 20))
    """, max_output_chars=100)  # fmt: skip
    assert out.startswith("scratch full OSError\nhi\nzzz") and out.endswith("[output cut at 100 characters]")
    assert len(out) < 200


# -- when isolation cannot be had -----------------------------------------------------------


@pytest.fixture
def fresh_check():
    sandbox._check_once.cache_clear()
    yield
    sandbox._check_once.cache_clear()


def test_refused_without_bubblewrap_unless_unsafe_local_is_explicit(fresh_check, monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    with pytest.raises(ValueError, match=r"bubblewrap \(bwrap\) is not installed; install it .*unsafe_local: true"):
        CodeRunner()
    tools = [{"class_name": "code_runner", "tool_schema": {"type": "function", "function": {"name": "py"}}}]
    [(field, message)] = tool_issues(tools)
    assert field == "rollout.multi_turn.tools[0].config" and "bubblewrap" in message
    with caplog.at_level(logging.WARNING):
        unsafe = CodeRunner({"unsafe_local": True})
    assert "WITHOUT isolation" in caplog.text
    assert unsafe({"code": "print(6 * 7)"}).strip() == "42"
    # The run says so: the summary line and details in the Temporal UI, and the result.
    config = {"rollout": {"multi_turn": {"enabled": True, "tools": [{**tools[0], "config": {"unsafe_local": True}}]}}}
    assert sa.unsafe_tools(config) == ["py"]
    assert sa.static_summary("r1", config).endswith("· UNSAFE: model code runs unsandboxed (py)")
    assert "**UNSAFE**" in sa.static_details("r1", config)


def test_refused_without_writable_control_groups(fresh_check, monkeypatch, tmp_path):
    monkeypatch.setattr(cgroup, "ROOT", tmp_path)  # no controllers mounted there
    with pytest.raises(ValueError, match="cgroup v2: cannot enable pids, memory, cpu .*RATCHET_SANDBOX_CGROUP"):
        CodeRunner()
