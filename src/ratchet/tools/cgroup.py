"""One control group per code-runner call: the limits of the whole process tree (processes,
memory, CPU) and the way to kill every process of it, whatever it does to leave its
process group or session.

cgroup v1 (a hierarchy per controller, /sys/fs/cgroup/<controller>): the call's group is
made under the worker's own group in each of pids, memory, cpu, cpuacct and freezer, so
whatever limits the worker lives under (a container's, a pod's) still hold. cgroup v2 (one
hierarchy): under a group whose `cgroup.subtree_control` enables pids, memory and cpu,
`RATCHET_SANDBOX_CGROUP` or else the worker's own group (which v2 allows only when the
worker's group has no processes of its own, e.g. the root of a fresh machine).

A process joins by writing its pid to `cgroup.procs` before it runs any model code (the
sandbox's launcher does, then execs bubblewrap); its children are born inside.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("pids", "memory", "cpu", "cpuacct", "freezer")
V2_CONTROLLERS = ("pids", "memory", "cpu")
ENV_PARENT = "RATCHET_SANDBOX_CGROUP"
CPU_PERIOD_US = 100_000


class CgroupUnavailable(RuntimeError):
    """No control group can be made here; the message names what is missing and the fix."""


def _own_paths() -> dict[str, str]:
    """controller (or '' for v2) -> this process's group path, from /proc/self/cgroup."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(","):
            out[name] = path
    return out


def _is_v1() -> bool:
    return all((ROOT / c / "cgroup.procs").is_file() for c in ("pids", "memory"))


def _v1_parents() -> dict[str, Path]:
    """controller -> the folder the call's group is made in (one per distinct hierarchy)."""
    own = _own_paths()
    parents: dict[str, Path] = {}
    for c in V1_CONTROLLERS:
        mount = ROOT / c
        if not (mount / "cgroup.procs").is_file():
            raise CgroupUnavailable(f"cgroup v1 controller {c!r} is not mounted at {mount}")
        parents[c] = mount / own.get(c, "/").lstrip("/")
    return parents


def _v2_parent() -> Path:
    named = os.environ.get(ENV_PARENT)
    parent = Path(named) if named else ROOT / _own_paths().get("", "/").lstrip("/")
    wanted = set(V2_CONTROLLERS)
    try:
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        if not wanted <= enabled:
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted - enabled)))
    except OSError as e:
        raise CgroupUnavailable(
            f"cgroup v2: cannot enable {', '.join(V2_CONTROLLERS)} for child groups of {parent} ({e.strerror}); "
            f"run the worker in a delegated group and set {ENV_PARENT} to a group folder whose "
            "cgroup.subtree_control lists pids, memory and cpu"
        ) from None
    return parent


@dataclass(frozen=True)
class TreeLimits:
    pids: int  # processes and threads of the whole tree
    memory_bytes: int  # the whole tree's memory (and swap, where the kernel accounts it)
    cpus: float = 1.0  # CPU bandwidth of the whole tree, in cores


@dataclass
class CallCgroup:
    """The call's group: `create()`, the launcher joins `procs_files`, then `kill()` on every way out."""

    limits: TreeLimits
    version: int = 0
    dirs: dict[str, Path] = field(default_factory=dict)  # controller (v2: '') -> its folder

    def create(self) -> "CallCgroup":
        name = f"ratchet-sandbox-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            if _is_v1():
                self.version = 1
                for c, parent in _v1_parents().items():
                    d = parent / name
                    d.mkdir(mode=0o755)
                    self.dirs[c] = d
                self._v1_limits()
            else:
                self.version = 2
                d = _v2_parent() / name
                d.mkdir(mode=0o755)
                self.dirs[""] = d
                self._v2_limits()
        except OSError as e:
            self.remove()
            raise CgroupUnavailable(
                f"cannot make a control group ({e.filename}: {e.strerror}); the sandbox needs write "
                "access to the cgroup file system (run the worker as root or in a delegated group)"
            ) from None
        except CgroupUnavailable:
            self.remove()
            raise
        return self

    def _v1_limits(self) -> None:
        d = self.dirs
        (d["pids"] / "pids.max").write_text(str(self.limits.pids))
        mem = str(self.limits.memory_bytes)
        (d["memory"] / "memory.limit_in_bytes").write_text(mem)
        if (d["memory"] / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no escape to swap
            (d["memory"] / "memory.memsw.limit_in_bytes").write_text(mem)
        try:  # without swap accounting: no swapping out of this group at all
            (d["memory"] / "memory.swappiness").write_text("0")
        except OSError:
            pass
        (d["cpu"] / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (d["cpu"] / "cpu.cfs_quota_us").write_text(str(int(CPU_PERIOD_US * self.limits.cpus)))

    def _v2_limits(self) -> None:
        d = self.dirs[""]
        (d / "pids.max").write_text(str(self.limits.pids))
        (d / "memory.max").write_text(str(self.limits.memory_bytes))
        if (d / "memory.swap.max").exists():
            (d / "memory.swap.max").write_text("0")
        (d / "cpu.max").write_text(f"{int(CPU_PERIOD_US * self.limits.cpus)} {CPU_PERIOD_US}")

    @property
    def procs_files(self) -> list[str]:
        """Where a process writes its pid to join every controller's group (distinct hierarchies only)."""
        seen, out = set(), []
        for d in self.dirs.values():
            real = os.path.realpath(d)
            if real not in seen:
                seen.add(real)
                out.append(str(d / "cgroup.procs"))
        return out

    def _read(self, controller: str, name: str) -> str:
        try:
            return (self.dirs[controller if self.version == 1 else ""] / name).read_text()
        except (OSError, KeyError):
            return ""

    def cpu_seconds(self) -> float:
        """CPU time the whole tree has used so far."""
        if self.version == 1:
            raw = self._read("cpuacct", "cpuacct.usage").strip()
            return int(raw) / 1e9 if raw else 0.0
        stat = dict(line.split() for line in self._read("", "cpu.stat").splitlines() if line.strip())
        return int(stat.get("usage_usec", 0)) / 1e6

    def memory_exceeded(self) -> bool:
        if self.version == 1:  # an OOM kill in the group (failcnt also counts reclaim that succeeded)
            control = dict(line.split() for line in self._read("memory", "memory.oom_control").splitlines() if line.strip())
            return int(control.get("oom_kill", 0)) > 0
        events = dict(line.split() for line in self._read("", "memory.events").splitlines() if line.strip())
        return int(events.get("max", 0)) > 0 or int(events.get("oom_kill", 0)) > 0

    def pids_exceeded(self) -> bool:
        events = dict(line.split() for line in self._read("pids", "pids.events").splitlines() if line.strip())
        return int(events.get("max", 0)) > 0

    def pids(self) -> set[int]:
        out: set[int] = set()
        for f in self.procs_files:
            try:
                out.update(int(p) for p in Path(f).read_text().split())
            except OSError:
                pass
        return out

    def kill(self, timeout_s: float = 10.0, remove: bool = True) -> None:
        """SIGKILL every process of the tree (frozen first, so none forks meanwhile), wait
        until the group is empty, remove it (unless `remove` is False: its counters are read after)."""
        if not self.dirs:
            return
        if self.version == 2 and (self.dirs[""] / "cgroup.kill").exists():
            (self.dirs[""] / "cgroup.kill").write_text("1")
        else:
            freeze = self._freeze(True)
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if freeze:
                self._freeze(False)
        deadline = time.monotonic() + timeout_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.005)
        if remove:
            self.remove()

    def _freeze(self, frozen: bool) -> bool:
        if self.version == 1:
            path, value = self.dirs["freezer"] / "freezer.state", "FROZEN" if frozen else "THAWED"
        else:
            path, value = self.dirs[""] / "cgroup.freeze", "1" if frozen else "0"
        try:
            path.write_text(value)
            deadline = time.monotonic() + 2.0
            while self.version == 1 and frozen and path.read_text().strip() != "FROZEN" and time.monotonic() < deadline:
                time.sleep(0.001)
            return True
        except OSError:
            return False

    def remove(self) -> None:
        left = []
        for d in self.dirs.values():
            for _ in range(200):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while the last process is still being torn down
                    time.sleep(0.005)
            else:
                left.append(str(d))
        if left:
            log.warning("code sandbox: control group(s) not removed (still busy): %s", ", ".join(left))
        self.dirs = {}


def probe() -> None:
    """Make and remove one group: CgroupUnavailable saying why it cannot be done here."""
    CallCgroup(TreeLimits(pids=8, memory_bytes=64 << 20)).create().remove()
