"""Process set-up shared by every worker actor."""

from __future__ import annotations

import logging
import os


def configure_worker_process(torch_threads: int, deterministic_seed: int | None = None) -> None:
    """One torch thread per process on small CPUs: two threads per process thrash and run
    5-10x slower on a 2-core machine. Also silence per-call progress bars of transformers.
    With `deterministic_seed`, deterministic torch kernels and seeded generators."""
    import torch

    if deterministic_seed is not None:
        from .checkpointing import enable_determinism

        enable_determinism(deterministic_seed)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(torch_threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


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


def join_process_group(device, rank: int, world_size: int, master_port: int | None = None) -> str:
    """Initialise torch.distributed for a trainer rank: NCCL on CUDA, gloo on CPU. One rank
    alone (FSDP2 on one GPU still needs a group) uses an in-process store: no port. Returns
    the backend."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return backend
    if master_port is None:
        raise ValueError("a process group of more than one rank needs the rendezvous port")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    return backend
