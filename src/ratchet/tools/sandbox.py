"""Run model-written Python in isolation: bubblewrap namespaces plus one control group per call.

What the code sees and may do (docs/multi_turn.md, "The code runner"):

- its own user, pid, mount, network, IPC, UTS and cgroup namespaces (`bwrap --unshare-all`):
  uid 65534, a fresh /proc that shows only its own processes, no network but a loopback of
  its own, no way to signal or trace anything outside;
- a file system of a read-only /usr/lib (the C libraries), the interpreter and its standard
  library read-only, a minimal /dev, and one writable folder, `/box` (a size-capped tmpfs,
  its working directory, holding `main.py`); the worker's home, state folder, run folder,
  datasets, /tmp and every site-packages (the worker's venv's, the interpreter's own) are
  not there, nor is a shell or any other program;
- an environment of PATH, LANG, HOME and TMPDIR only (`--clearenv`);
- a control group of its own (cgroup.py): processes, memory (+ swap) and CPU of the whole
  tree; the parent adds the wall clock and the tree's CPU seconds, and kills every process
  of the group on every way out;
- its stdout and stderr go to a memfd the parent made (RLIMIT_FSIZE caps it) and the parent
  reads at most the cap from its own descriptor: nothing the child names or replaces.

`check()` says what is missing on this machine (no bwrap, no user namespaces, no writable
cgroups), once per process, so the code runner refuses to be built without it.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from .cgroup import CallCgroup, CgroupUnavailable, TreeLimits
from .cgroup import probe as probe_cgroup

BOX = "/box"  # the child's one writable folder, its cwd
SANDBOX_UID = 65534  # nobody
# The launcher joins the call's control group (every pid file before `--`), then becomes bwrap:
# every process of the sandbox is born inside the group. Exit 125 without running anything when
# a join fails.
_LAUNCH = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
# Inside: per-process limits (a single allocation past the limit is a MemoryError, not a kill;
# the output memfd is capped by RLIMIT_FSIZE), then the program itself.
_BOOT = (
    "import os,resource as r,sys\n"
    "c,m,f=map(int,sys.argv[1:4])\n"
    "for k,v in ((r.RLIMIT_CPU,(c,c+1)),(r.RLIMIT_AS,(m,m)),(r.RLIMIT_FSIZE,(f,f)),(r.RLIMIT_NOFILE,(64,64)),(r.RLIMIT_CORE,(0,0))):\n"
    " r.setrlimit(k,v)\n"
    "os.environ.pop('PWD',None)\n"
    "os.execv(sys.executable,[sys.executable,*sys.argv[4:]])"
)
_LAYOUT = (
    "import json,os,sys,sysconfig as s\n"
    "p=s.get_paths();v=s.get_config_var\n"
    "print(json.dumps({'executable':os.path.realpath(sys.executable),'prefix':sys.prefix,'stdlib':p['stdlib'],"
    "'platstdlib':p['platstdlib'],'purelib':p['purelib'],'platlib':p['platlib'],"
    "'libdir':v('LIBDIR') if v('Py_ENABLE_SHARED') else None}))"
)


class SandboxUnavailable(RuntimeError):
    """Isolation cannot be had on this machine; the message names the missing piece and the fix."""


@dataclass(frozen=True)
class Interpreter:
    """The Python the sandbox runs: where it is and what of the file system it needs."""

    executable: str  # the path run inside (the same path as outside)
    binds: tuple[str, ...]  # bound read-only
    masks: tuple[str, ...]  # hidden under an empty read-only tmpfs (site-packages)
    flags: tuple[str, ...]  # -I (isolated), -S (no site-packages) for the worker's own interpreter
    links: tuple[tuple[str, str], ...] = ()  # (target, link): the symlinks from `executable` to the real file


@dataclass(frozen=True)
class Limits:
    wall_s: float
    cpu_s: int  # CPU seconds of the whole tree (and of each process)
    memory_mb: int  # the whole tree's memory (and each process's address space)
    processes: int  # processes and threads of the whole tree, the sandbox's own two included
    output_bytes: int  # stdout + stderr
    scratch_mb: int  # the size of /box


@dataclass(frozen=True)
class Finished:
    returncode: int  # the program's exit code, or -signal
    output: bytes  # at most Limits.output_bytes
    reason: str | None  # the parent's: "wall" | "cpu" | "memory" | "processes" | None
    cpu_s: float  # the tree's CPU time


def _nest(paths) -> tuple[str, ...]:
    """Existing paths, without any that lies inside another."""
    kept: list[str] = []
    for p in sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)}):
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(p)
    return tuple(kept)


@functools.lru_cache(maxsize=8)
def interpreter(python: str = "") -> Interpreter:
    """The worker's own interpreter without any site-packages (python=''), or the interpreter
    at `python` (a venv's python for model code: its site-packages are visible, read-only)."""
    own = not python
    exe = os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable) if own else os.path.abspath(python)
    try:
        out = subprocess.run([exe, "-I", "-S" if own else "-I", "-c", _LAYOUT], capture_output=True, text=True, timeout=30,
                             env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, check=True).stdout  # fmt: skip
        layout = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        raise SandboxUnavailable(f"the interpreter {exe} does not run ({e}); set the code runner's python to one that does")
    binds = [layout["executable"], layout["stdlib"], layout["platstdlib"], layout["libdir"]]
    if own:
        site = {layout["purelib"], layout["platlib"], "/usr/lib/python3/dist-packages"}
        masks = tuple(p for p in sorted(site) if os.path.isdir(p) and any(p.startswith(b + "/") for b in _nest(binds + ["/usr/lib"])))
        return Interpreter(layout["executable"], _nest(binds), masks, ("-I", "-S"))
    binds += [layout["prefix"], layout["purelib"], layout["platlib"]]
    links: list[tuple[str, str]] = []
    link = exe
    while os.path.islink(link) and len(links) < 16:  # a venv's bin/python -> python3 -> the base interpreter
        target = os.readlink(link)
        links.append((target, link))
        link = os.path.normpath(os.path.join(os.path.dirname(link), target))
    return Interpreter(exe, _nest(binds), (), ("-I",), tuple(links))


def _system_args() -> list[str]:
    """The C libraries, at the paths the host has them (merged /usr or not), read-only."""
    args: list[str] = []
    for d in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32"):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    return args


def bwrap_path() -> str | None:
    return shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.access(p, os.X_OK)), None)


def _bwrap_argv(bwrap: str, interp: Interpreter, limits: Limits, code_fd: int) -> list[str]:
    argv = [
        bwrap, "--unshare-all", "--die-with-parent", "--new-session",
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
        "--clearenv", "--setenv", "PATH", os.path.dirname(interp.executable), "--setenv", "LANG", "C.UTF-8",
        "--setenv", "HOME", BOX, "--setenv", "TMPDIR", BOX,
        "--proc", "/proc", "--dev", "/dev",
    ]  # fmt: skip
    argv += _system_args()
    for path in interp.binds:
        argv += ["--ro-bind", path, path]
    for target, link in interp.links:
        if not any(link.startswith(b.rstrip("/") + "/") for b in interp.binds):
            argv += ["--symlink", target, link]
    for path in interp.masks:
        argv += ["--tmpfs", path, "--remount-ro", path]
    argv += ["--size", str(limits.scratch_mb << 20), "--perms", "0700", "--tmpfs", BOX]
    argv += ["--perms", "0600", "--file", str(code_fd), f"{BOX}/main.py", "--chdir", BOX]
    argv += ["--remount-ro", "/dev", "--remount-ro", "/"]
    argv += [interp.executable, "-I", "-S", "-c", _BOOT, str(limits.cpu_s), str(limits.memory_mb << 20),
             str(limits.output_bytes), *interp.flags, "-X", "utf8", "main.py"]  # fmt: skip
    return argv


@functools.lru_cache(maxsize=1)
def _check_once() -> str | None:
    bwrap = bwrap_path()
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed; install it (Debian/Ubuntu: apt-get install bubblewrap)"
    try:
        probe_cgroup()
    except CgroupUnavailable as e:
        return str(e)
    try:
        interp = interpreter("")
    except SandboxUnavailable as e:
        return str(e)
    # The namespaces bwrap needs (user, pid, net, mount) and the interpreter inside them.
    done = run(b"print('ok')", interp, Limits(wall_s=30, cpu_s=10, memory_mb=256, processes=16, output_bytes=4096, scratch_mb=1))
    if done.returncode != 0 or done.output.strip() != b"ok":
        text = done.output.decode("utf-8", "replace").strip().splitlines()
        return (
            f"bubblewrap cannot make the sandbox here ({text[-1] if text else f'exit code {done.returncode}'}); it needs "
            "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0; "
            "in a container: a seccomp/AppArmor profile that allows unshare and mount)"
        )
    return None


def check() -> None:
    """SandboxUnavailable naming what this machine lacks for the sandbox, or None (cached)."""
    problem = _check_once()
    if problem is not None:
        raise SandboxUnavailable(f"the code sandbox cannot run here: {problem}")


def run(code: bytes, interp: Interpreter, limits: Limits) -> Finished:
    """Run `code` as /box/main.py in the sandbox; every process of it is gone on return."""
    bwrap = bwrap_path()
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed")
    group = CallCgroup(TreeLimits(pids=limits.processes, memory_bytes=limits.memory_mb << 20)).create()
    code_fd = os.memfd_create("ratchet-code-main")  # close-on-exec: pass_fds gives it to the launcher only
    out_fd = os.memfd_create("ratchet-code-output")
    proc = None
    reason = None
    try:
        os.write(code_fd, code)
        os.lseek(code_fd, 0, os.SEEK_SET)
        argv = ["/bin/sh", "-c", _LAUNCH, "ratchet-sandbox", *group.procs_files, "--", *_bwrap_argv(bwrap, interp, limits, code_fd)]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out_fd, stderr=out_fd, pass_fds=(code_fd,),
                                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True)  # fmt: skip
        os.close(code_fd)
        code_fd = -1
        deadline = time.monotonic() + limits.wall_s
        while True:
            left = deadline - time.monotonic()
            try:
                rc = proc.wait(timeout=max(0.0, min(0.05, left)))
                break
            except subprocess.TimeoutExpired:
                if group.cpu_seconds() > limits.cpu_s:
                    reason = "cpu"
                elif left <= 0:
                    reason = "wall"
                if reason:
                    group.kill(remove=False)
                    rc = proc.wait()
                    break
        cpu = group.cpu_seconds()
        if reason is None and group.memory_exceeded():
            reason = "memory"
        if reason is None and group.pids_exceeded():
            reason = "processes"
        output = os.pread(out_fd, limits.output_bytes, 0)
        if rc == 125 and not output and cpu < 0.005:  # no interpreter ever ran: the launcher's own exit
            raise SandboxUnavailable("the sandbox's launcher could not join its control group")
        return Finished(128 - rc if 128 < rc < 160 else rc, output, reason, cpu)  # bwrap reports signal N as 128 + N
    finally:
        group.kill()  # every process the call made, whatever it did to leave its group or session
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for fd in (code_fd, out_fd):
            if fd >= 0:
                os.close(fd)
