"""Trainer worker (a Ray actor, one per rank): runs `PolicyTrainer` on stored batches and
hands out its weights for the rollout engines. Ranks > 1 form a gloo process group and
the policy is sharded with FSDP2."""

from __future__ import annotations

import os
import socket
import time

import numpy as np

from ratchet.config.schema import RunConfig
from ratchet.storage import BatchStore, ObjectStore

from .batch import load_step
from .hf_io import local_hf_path, save_hf
from .policy_update import PolicyTrainer
from .runtime import configure_worker_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrainerWorker:
    def __init__(self, cfg: RunConfig, policy_path: str, run_uri: str, rank: int, world_size: int):
        configure_worker_process(cfg.resources.torch_threads)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.policy_path = local_hf_path(policy_path)
        self.run = ObjectStore(run_uri)
        self.trainer: PolicyTrainer | None = None
        self._last = None  # ((step, version it trained), StepResult) of the latest update

    def rendezvous_port(self) -> int:
        return free_port()

    def setup(self, master_port: int) -> int:
        """Join the process group (all ranks at once) and load the policy; returns parameter count."""
        if self.world_size > 1:
            import torch.distributed as dist

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
            dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size)
        self.trainer = PolicyTrainer(self.policy_path, self.cfg, rank=self.rank, world_size=self.world_size)
        return self.trainer.num_parameters()

    def policy_version(self) -> int:
        return self.trainer.version

    def train(self, step: int, policy_version: int, kl_coef: float, parts: int = 1) -> dict:
        """Update policy v`policy_version` on `step`. A retried activity whose first attempt
        already updated the policy gets that update's result instead of a second update."""
        t0 = time.perf_counter()
        store = BatchStore(self.run)
        if self._last is not None and self._last[0] == (step, policy_version) and self.trainer.version == policy_version + 1:
            result = self._last[1]
        else:
            if policy_version != self.trainer.version:
                raise RuntimeError(f"trainer holds policy v{self.trainer.version}, asked to train v{policy_version}")
            data = load_step(store, step, parts)
            values = store.read(step, "values")[0]["values"] if store.has(step, "values") else None
            result = self.trainer.train_step(data, kl_coef=kl_coef, values=values)
            self._last = ((step, policy_version), result)
        if self.rank == 0:
            store.write(step, "advantages", {"advantages": result.advantages, "returns": result.returns}, {})
        result.metrics["train_seconds"] = time.perf_counter() - t0
        return {"policy_version": self.trainer.version, "metrics": result.metrics, "kl_coef": result.kl_coef}

    def save_state(self, local_dir: str, extra: dict) -> dict:
        """Write the trainer state (weights, AdamW state, version, RNG; sharded, with
        torch.distributed.checkpoint) into `local_dir`. Every rank calls (a collective)."""
        from .checkpointing import checkpoint_bytes, save_trainer_state

        t0 = time.perf_counter()
        save_trainer_state(self.trainer, local_dir, extra)
        return {"version": self.trainer.version, "seconds": time.perf_counter() - t0, "bytes": checkpoint_bytes(local_dir)}

    def load_state(self, local_dir: str) -> dict:
        """Restore a state `save_state` wrote, with any world size. Every rank calls."""
        from .checkpointing import checkpoint_bytes, load_trainer_state

        t0 = time.perf_counter()
        extra = load_trainer_state(self.trainer, local_dir)
        self._last = None  # a retry cache of the replaced state must not answer for the new one
        return {
            "version": self.trainer.version,
            "seconds": time.perf_counter() - t0,
            "bytes": checkpoint_bytes(local_dir),
            "extra": extra,
        }

    def weights(self) -> dict[str, np.ndarray] | None:
        """Full weights on rank 0 (every rank must call: unsharding is a collective)."""
        state = self.trainer.state_numpy()
        return state if self.rank == 0 else None

    def export(self, key: str) -> str | None:
        """Save the policy in Hugging Face format under the run folder (rank 0 writes)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        state = self.trainer.full_state()
        if self.rank != 0:
            return None
        model = AutoModelForCausalLM.from_pretrained(self.policy_path)
        model.load_state_dict(state, strict=False)
        return save_hf(model, AutoTokenizer.from_pretrained(self.policy_path), self.run, key)
