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
