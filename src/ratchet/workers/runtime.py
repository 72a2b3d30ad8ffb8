"""Process set-up shared by every worker actor."""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import sys

log = logging.getLogger(__name__)

# glibc's malloc hands freed memory back to the kernel (trims the heap, unmaps large
# blocks) while an actor waits for the next phase of the step, so every generation and
# update page-faults its working memory back in: 7,000 faults and +10-15% on a tiny model's
# CPU generation (benchmarks/step_overhead.py). A process that does one phase after the
# other, like the in-process loop, never idles long enough to lose it. Blocks up to 32 MiB
# (glibc's own dynamic ceiling) come from the heap, and up to 256 MiB of free heap is kept:
# a worker holds on to its previous step's peak, which it reaches again in the next step.
# Larger blocks (weight-sync buckets, whole tensors of big models) are still mapped and
# unmapped. Set through mallopt, as glibc's MALLOC_*_ environment variables would at the
# process's start (an actor then needs no runtime_env: see actors/placement.actor_env); a
# value of those variables in the process's environment wins.
# variable -> (mallopt's parameter for it: glibc's M_MMAP_THRESHOLD, M_TRIM_THRESHOLD; value)
MALLOC_THRESHOLDS = {"MALLOC_MMAP_THRESHOLD_": (-3, 32 << 20), "MALLOC_TRIM_THRESHOLD_": (-1, 256 << 20)}


def configure_worker_process(torch_threads: int, deterministic_seed: int | None = None) -> None:
    """One torch thread per process on small CPUs: two threads per process thrash and run
    5-10x slower on a 2-core machine. Also silence per-call progress bars of transformers.
    With `deterministic_seed`, deterministic torch kernels and seeded generators."""
    import torch

    if deterministic_seed is not None:
        enable_determinism(deterministic_seed)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(torch_threads)
    keep_freed_memory()
    from ratchet.hf_imports import hide_sklearn_and_scipy

    hide_sklearn_and_scipy()  # before anything imports transformers' models: seconds at every actor's start
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def keep_freed_memory() -> None:
    """Apply `MALLOC_THRESHOLDS` to this process's malloc, except where the C library is not
    glibc or the environment set the variable already (glibc read it at the start)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): their defaults stay
        return
    for name, (param, value) in MALLOC_THRESHOLDS.items():
        if name not in os.environ and mallopt(param, value) != 1:
            log.warning("mallopt refused %s=%d; glibc's default stays", name, value)


def enable_determinism(seed: int) -> None:
    """Deterministic kernels and seeded generators (Python, numpy, torch); safe on CPU.
    `CUBLAS_WORKSPACE_CONFIG` is set for CUDA, which needs it before the first cuBLAS call."""
    import random

    import numpy as np
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    deterministic_kernels()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def deterministic_kernels() -> None:
    """`torch.use_deterministic_algorithms(True)` without importing Inductor's config for
    it, which that function does to set the config's `deterministic` flag: 2 CPU-s in a
    process that has no other use for Inductor (the reward worker, at every start of a
    deterministic run's). The config reads TORCHINDUCTOR_DETERMINISTIC when it is first
    imported, so a later import gets the flag too; one imported already is set directly."""
    import torch

    set_flag = getattr(torch._C, "_set_deterministic_algorithms", None)
    if set_flag is None:  # a torch without it: the public call, import and all
        torch.use_deterministic_algorithms(True)
        return
    os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        setattr(inductor, "deterministic", True)  # a config module: its fields are set as attributes
    set_flag(True, warn_only=False)


def resolve_device(requested: str, rank: int = 0):
    """The torch device a trainer rank computes on (`trainer.device`): `auto` is CUDA when
    this process sees a GPU. A CUDA rank takes GPU `LOCAL_RANK` (or rank modulo the GPUs it
    sees: one under Ray, which gives each actor its own `CUDA_VISIBLE_DEVICES`) and makes
    it current, so NCCL and FSDP2 pick the same one."""
    import torch

    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"trainer.device={requested!r}; use auto, cpu or cuda")
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "trainer.device=cuda but this process sees no GPU (torch.cuda.is_available() is False); "
            "give the trainer a GPU or set trainer.device=auto"
        )
    index = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


LOOPBACK = "127.0.0.1"
GLOO_IFNAME_VAR = "GLOO_SOCKET_IFNAME"


def node_address() -> str:
    """The address this process's node has in the Ray cluster (where the other nodes
    reach it); 127.0.0.1 outside Ray. On one machine started by ratchet that is
    127.0.0.1 too (`ray start --node-ip-address 127.0.0.1`)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else LOOPBACK


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on `host` now (the address that will listen on it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost (a host name other than localhost is not)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds `address` (eth0), or None."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def join_process_group(
    device, rank: int, world_size: int, master_port: int | None = None, master_addr: str = LOOPBACK, local_addr: str | None = None
) -> str:
    """Initialise torch.distributed for a trainer rank: NCCL on CUDA, gloo on CPU. One rank
    alone (FSDP2 on one GPU still needs a group) uses an in-process store: no port. Returns
    the backend.

    `master_addr`: the address of rank 0's node (its TCPStore listens there); ranks on
    other nodes reach it by that address, so it is never 127.0.0.1 on a cluster.
    `local_addr`: this rank's own node address. Gloo picks the address its pairs listen
    on from the host name, which often resolves to 127.0.0.1 (it does here): ranks on
    another node could not connect. So when the rendezvous is not on the loopback, gloo
    is pinned to the interface that holds `local_addr` (unless $GLOO_SOCKET_IFNAME is
    already set)."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return backend
    if master_port is None:
        raise ValueError("a process group of more than one rank needs the rendezvous port")
    if not master_addr:
        raise ValueError("a process group of more than one rank needs rank 0's address (master_addr)")
    if not is_loopback(master_addr) and local_addr and GLOO_IFNAME_VAR not in os.environ:
        interface = interface_of(local_addr)
        if interface is not None:
            os.environ[GLOO_IFNAME_VAR] = interface  # also the checkpoint group's (a gloo group)
        else:
            logging.getLogger(__name__).warning("no network interface holds %s; gloo picks one by the host name", local_addr)
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    return backend
