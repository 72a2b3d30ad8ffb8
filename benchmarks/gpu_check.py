"""GPU check: ratchet's CUDA paths on the lent GPU machine, in one call, at realistic sizes.

That machine (docs/gpu.md; ../shared/DESIGN.md) has one NVIDIA H200, torch + CUDA,
transformers and a few dozen other packages, and no network, no Ray, Temporal, pydantic,
omegaconf, tenacity or vLLM. So the check needs nothing beyond that machine's packages
(benchmarks/gpu_machine.py lists them): ratchet comes from the source tree (src/), the
run config from a snapshot of its validated defaults when pydantic is missing
(gpu_check_config.json; a test keeps it current), and every model is built from a config
with random weights (nothing can be downloaded there, and no weights fit in what
travels). Learning is checked with the tiny digit model, built by code.

It prints one table, each figure beside its goal, and writes it (Markdown and JSON) to
--out after every row, so that a run cut short still brings its rows back:

  imports     every ratchet module the check and tests/gpu import, in this interpreter
  generate    HFEngine tokens/s at Qwen2.5-0.5B's and 1.5B's shapes, 256 rows x 512 new
              tokens, sampled as runs sample (a seed per prompt): the baseline for vLLM
  trainer     a GRPO update by PolicyTrainer: FSDP2 at world size 1 over NCCL, bf16 mixed
              precision, activation checkpointing, 2k-token sequences: tokens/s, MFU,
              peak GPU memory (goal at 0.5B: >= 20k tokens/s)
  sync        the trainer's weights into an HF engine in another process on the same
              GPU by CUDA IPC handles, bucketed (weight_sync/colocated_process.py: the
              IPC transport's own code, a pipe for Ray): seconds, GB/s, the engine's
              weights checked equal (goal at 0.5B: <= 0.1 s)
  hand-over   the colocated engine's sleep (its GPU memory released for the update)
              and wake-up, seconds, and its answers unchanged after
  grpo        the tiny model on the copy task: supervised warm-up, then GRPO through
              the in-process loop (LocalLoop) on the GPU: the reward must rise
  tests/gpu   pytest on tests/gpu with this interpreter: its summary line (the whole
              output in $OUT/tests_gpu.log)
  one row per path it cannot test there, with the reason

    python benchmarks/gpu_check.py [--quick] [--out DIR]     # on the GPU machine
    python benchmarks/gpu_check.py --cpu-smoke --as-gpu-machine
        # here: the same code paths, small, on CPU, with only that machine's packages
        # importable (tests/unit/test_gpu_check.py runs it)

Exit status: 0 when every check passed, 1 when one failed, 2 without a GPU (and without
--cpu-smoke).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = Path(__file__).with_name("gpu_check_config.json")

# What the check and tests/gpu import of ratchet: all of it must import on that machine.
RATCHET_MODULES = (
    "ratchet.models.tiny",
    "ratchet.tasks.generate",
    "ratchet.workers.batch",
    "ratchet.workers.policy_update",
    "ratchet.workers.engines.hf",
    "ratchet.workers.local_loop",
    "ratchet.workers.prompts",
    "ratchet.workers.warmup",
    "ratchet.workers.weight_sync.cuda_ipc",
    "ratchet.workers.weight_sync.device_sync",
    "ratchet.workers.weight_sync.colocated_process",
)

# The paths that one H200 without Ray or vLLM cannot exercise, and why.
NOT_TESTABLE = (
    ("NCCL between trainer ranks, and the NCCL trainer -> engine broadcast", "needs two GPUs: NCCL cannot join two processes on one GPU"),
    (
        "vLLM engine on CUDA (sleep/wake, weight reload)",
        "vllm is not installed there and its wheel (~400 MB) cannot travel (64 MiB a call)",
    ),
    ("SGLang engine", "sglang is not installed there and is too large to carry"),
    (
        "the sync through Ray actors (TrainerWorker, RolloutWorker)",
        "Ray is not there and its wheel (79 MB) cannot travel; the same IPC code runs here without Ray",
    ),
    ("QLoRA (trainer.lora.quantize=4bit)", "bitsandbytes is not installed there and its CUDA wheel is too large to carry"),
)


# --------------------------------------------------------------------------- config


class ConfigView:
    """Read-only attribute access over a nested dict: what ratchet's workers read of a
    `RunConfig`, for a machine without pydantic."""

    def __init__(self, data: dict):
        self._data = data

    def __getattr__(self, name: str):
        try:
            value = self._data[name]
        except KeyError:
            raise AttributeError(f"config has no field {name!r} (regenerate {SNAPSHOT.name} with --write-config-snapshot)") from None
        return ConfigView(value) if isinstance(value, dict) else value


def _merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


SNAPSHOT_BASE = {"model": {"path": "MODEL"}, "data": {"train_files": "DATA"}}


def snapshot_dict() -> dict:
    """The validated defaults (needs pydantic), plus the derived flags the workers read."""
    from ratchet.config.schema import RunConfig

    cfg = RunConfig.model_validate(SNAPSHOT_BASE)
    return {**cfg.model_dump(mode="json"), "uses_critic": cfg.uses_critic, "uses_partial_rollouts": cfg.uses_partial_rollouts}


def run_config(overrides: dict):
    """A validated `RunConfig` where pydantic is installed; else a `ConfigView` of the
    snapshot with `overrides` merged (algorithm and loop as in the snapshot: GRPO, sync)."""
    try:
        from ratchet.config.schema import RunConfig
    except ImportError:
        return ConfigView(_merge(json.loads(SNAPSHOT.read_text()), overrides))
    return RunConfig.model_validate(_merge(SNAPSHOT_BASE, overrides))


# --------------------------------------------------------------------------- sizes

# Llama-shaped models at Qwen2.5's sizes (Qwen2 adds q/k/v biases; a Qwen2 config would make
# transformers replace the tokenizer class the tiny tokenizer is saved as).
SHAPES = {
    "0.5B": {"hidden": 896, "intermediate": 4864, "layers": 24, "heads": 14, "kv_heads": 2, "vocab": 151936},
    "1.5B": {"hidden": 1536, "intermediate": 8960, "layers": 28, "heads": 12, "kv_heads": 2, "vocab": 151936},
    "smoke": {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 2, "kv_heads": 1, "vocab": 512},
}


@dataclass(frozen=True)
class Sizes:
    shapes: tuple[str, ...]  # generate and sync at each
    trainer_shapes: tuple[str, ...]
    gen_prompts: int
    gen_n: int
    gen_prompt_len: int
    gen_new_tokens: int
    train_rows: int
    train_prompt_len: int
    train_response_len: int
    train_micro_batch: int
    train_steps: int  # timed, after one warm-up update
    syncs: int  # timed, after one warm-up sync
    grpo_warmup_steps: int
    grpo_steps: int
    budget_s: float  # the check's own time; a check not started by then is skipped
    sync_bucket_mb: float | None = None  # None: trainer.sync_bucket_mb's default, as runs sync


# GRPO: 10 supervised warm-up steps, as the demo does: enough for the answer's format, far
# from the answers themselves (40 steps already copy 96% of the digits: nothing left to learn).
FULL = Sizes(("0.5B", "1.5B"), ("0.5B", "1.5B"), 64, 4, 64, 512, 16, 512, 1536, 4, 3, 3, 10, 100, 400.0)
QUICK = Sizes(("0.5B",), ("0.5B",), 64, 4, 64, 512, 16, 512, 1536, 4, 2, 2, 10, 40, 170.0)
# Small buckets: the smoke model (~70k parameters) still travels in several, two in flight.
SMOKE = Sizes(("smoke",), ("smoke",), 4, 2, 6, 8, 8, 8, 8, 4, 1, 1, 5, 3, 600.0, sync_bucket_mb=0.02)

# The goals (docs/gpu.md says where they come from).
GOAL_TRAINER_TOKENS_S = 20_000  # at 0.5B; prime-rl reports 11.9k tokens/s on one H100 for Qwen3-0.6B
GOAL_SYNC_S = 0.1  # at 0.5B; verl's sync of Qwen3-0.6B on one node takes 0.59 s
# The GRPO row's pass mark: the mean reward of the last 10 steps over the first 10's. On
# CPU (this very code, bf16 mixed precision too) the rise over seeds 0-5 was 0.110-0.244
# in 100 steps and 0.061-0.095 in 40 (AMD EPYC, torch 2.13): the marks sit 2-3x below the
# smallest, outside that spread.
GOAL_GRPO_RISE = {100: 0.05, 40: 0.02}

# Dense bf16 peak FLOP/s by device name, for MFU.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}


def peak_flops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)


# --------------------------------------------------------------------------- the table


@dataclass
class Row:
    check: str
    result: str
    goal: str = ""
    status: str = "info"  # PASS, FAIL, info, skipped, not testable
    detail: str = ""


@dataclass
class Report:
    header: str
    out: Path | None = None
    rows: list[Row] = field(default_factory=list)

    @property
    def failures(self) -> int:
        return sum(r.status == "FAIL" for r in self.rows)

    def add(self, check: str, result: str, *, goal: str = "", status: str = "info", detail: str = "") -> None:
        row = Row(check, result, goal, status, detail)
        self.rows.append(row)
        print(
            f"[gpu_check] {status:>5}  {check}: {result}" + (f" (goal {goal})" if goal else "") + (f"; {detail}" if detail else ""),
            flush=True,
        )
        self.write()

    def markdown(self) -> str:
        lines = [f"**{self.header}**", "", "| check | result | goal | status | detail |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r.check} | {r.result} | {r.goal} | {r.status} | {r.detail} |" for r in self.rows]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.md").write_text(self.markdown())
        (self.out / "gpu_check.json").write_text(json.dumps({"header": self.header, "rows": [asdict(r) for r in self.rows]}, indent=1))

    def print(self, seconds: float) -> None:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            print(f"\n{self.header} ({seconds:.0f} s)")
            for r in self.rows:
                print(f"  {r.status:>12}  {r.check:<44} {r.result:>28}  {r.goal:<14} {r.detail}")
            return
        table = Table(title=f"{self.header} ({seconds:.0f} s)")
        for col in ("check", "result", "goal", "status", "detail"):
            table.add_column(col, overflow="fold")
        for r in self.rows:
            table.add_row(r.check, r.result, r.goal, r.status, r.detail)
        Console(width=220).print(table)


# --------------------------------------------------------------------------- models


def llama_config(shape: str):
    from transformers import LlamaConfig

    s = SHAPES[shape]
    return LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def build_random_model(out: Path, shape: str, device: str) -> Path:
    """A randomly initialised model of `shape` (built on `device`, saved in bf16) with the
    tiny digit tokenizer (its ids are below every vocabulary here; generated ids beyond
    it are never decoded)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ratchet.models.tiny import build_tokenizer

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(llama_config(shape), dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    del model
    return out


def matmul_params(model) -> int:
    """Parameters that take part in a matmul per token: all but an untied input
    embedding (a lookup); a tied one counts once, as the output head."""
    total = sum(p.numel() for p in model.parameters())  # a tied weight once (DTensor numel is global)
    if not model.config.tie_word_embeddings:
        total -= model.get_input_embeddings().weight.numel()
    return total


def train_flops_per_token(model, seq_len: int) -> float:
    """Model FLOPs of one trained token: 6 x matmul parameters, plus causal attention
    (QK^T and AV, forward and backward: 6 x layers x hidden x sequence). The recomputed
    forward of activation checkpointing and the no-grad forward for the old log-probs are
    not counted: MFU here is the useful work."""
    c = model.config
    return 6 * matmul_params(model) + 6 * c.num_hidden_layers * c.hidden_size * seq_len


# --------------------------------------------------------------------------- checks


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _free_cuda() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_imports(report: Report) -> bool:
    import importlib

    failed = []
    for name in RATCHET_MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - each failure named in the row
            failed.append(f"{name}: {type(e).__name__}: {e}")
    if failed:
        report.add("imports", f"{len(failed)} of {len(RATCHET_MODULES)} modules fail", status="FAIL", detail="; ".join(failed))
        return False
    report.add(
        "imports",
        f"{len(RATCHET_MODULES)} modules",
        status="PASS",
        detail="ratchet from " + str(Path(sys.modules["ratchet"].__file__).parent),
    )
    return True


def check_generate(report: Report, model: Path, shape: str, device: str, sizes: Sizes) -> None:
    """HFEngine as a run calls it: one seed per prompt, n samples each."""
    import torch

    from ratchet.workers.engines.base import SamplingParams
    from ratchet.workers.engines.hf import HFEngine

    dtype = "bfloat16" if device == "cuda" else "float32"
    engine = HFEngine(str(model), dtype=dtype)
    if engine.device.type != device:
        raise RuntimeError(f"HFEngine placed its model on {engine.device.type}, not {device}")
    g = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (sizes.gen_prompt_len,), generator=g).tolist() for _ in range(sizes.gen_prompts)]
    params = SamplingParams(
        n=sizes.gen_n, temperature=1.0, max_new_tokens=sizes.gen_new_tokens, seed=0, prompt_seeds=tuple(range(len(prompts)))
    )
    engine.generate(prompts[:2], SamplingParams(n=1, max_new_tokens=4, seed=0, prompt_seeds=(0, 1)))  # kernels, allocator
    _sync(device)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    _sync(device)
    seconds = time.perf_counter() - t0
    produced = sum(len(gen.token_ids) for group in out for gen in group)
    rows = sizes.gen_prompts * sizes.gen_n
    report.add(
        f"generate, HFEngine, {shape}",
        f"{produced / seconds:,.0f} tokens/s",
        goal="baseline",
        detail=f"{rows} rows x {sizes.gen_new_tokens} new tokens ({produced} made) in {seconds:.1f} s, {dtype}, a seed per prompt, {device}",
    )
    del engine, out
    _free_cuda()


def synthetic_batch(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    import torch

    from ratchet.workers.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    return RolloutBatch(
        prompt_ids=torch.randint(3, vocab, (rows, prompt_len), generator=g),
        prompt_mask=torch.ones(rows, prompt_len, dtype=torch.long),
        response_ids=torch.randint(3, vocab, (rows, response_len), generator=g),
        response_mask=torch.ones(rows, response_len),
        rollout_logprobs=torch.full((rows, response_len), -10.0),
        policy_version=torch.zeros(rows, response_len, dtype=torch.long),
        prompt_index=torch.arange(rows) // 4,
        samples=[{}] * rows,
    )


def build_trainer(model: Path, device: str, sizes: Sizes):
    from ratchet.workers.policy_update import PolicyTrainer

    trainer = {
        "device": device, "mixed_precision": "bf16", "activation_checkpointing": True,
        "micro_batch_size": sizes.train_micro_batch, "lr": 1e-6,
    }  # fmt: skip
    if sizes.sync_bucket_mb is not None:
        trainer["sync_bucket_mb"] = sizes.sync_bucket_mb
    cfg = run_config(
        {
            "model": {"path": str(model)},
            "data": {"train_files": "unused.jsonl"},
            "trainer": trainer,
            "rollout": {"max_response_length": sizes.train_response_len},
        }
    )
    return PolicyTrainer(str(model), cfg, shard=True)


def check_trainer(report: Report, trainer, shape: str, device: str, device_name: str, sizes: Sizes) -> None:
    import torch

    from ratchet.workers.batch import ScoredStep

    backend = torch.distributed.get_backend()
    seq = sizes.train_prompt_len + sizes.train_response_len
    batch = synthetic_batch(sizes.train_rows, sizes.train_prompt_len, sizes.train_response_len, trainer.model.config.vocab_size)
    rewards = torch.rand(sizes.train_rows, generator=torch.Generator().manual_seed(1))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, metrics = [], {}
    for _ in range(1 + sizes.train_steps):
        _sync(device)
        t0 = time.perf_counter()
        metrics = trainer.train_step(ScoredStep(batch, rewards, None), kl_coef=0.0).metrics
        _sync(device)
        times.append(time.perf_counter() - t0)
        bad = {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}
        if bad:
            raise RuntimeError(f"non-finite training metrics: {bad}")
    step_s = sum(times[1:]) / sizes.train_steps
    tokens_s = sizes.train_rows * seq / step_s
    peak = peak_flops(device_name)
    mfu = f", MFU {tokens_s * train_flops_per_token(trainer.model, seq) / peak:.1%}" if peak and device == "cuda" else ""
    memory = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if device == "cuda" else ""
    goal, status = "", "info"
    if shape == "0.5B":
        goal, status = f">= {GOAL_TRAINER_TOKENS_S:,} tok/s", "PASS" if tokens_s >= GOAL_TRAINER_TOKENS_S else "FAIL"
    report.add(
        f"trainer update, {shape}",
        f"{tokens_s:,.0f} tokens/s{mfu}",
        goal=goal,
        status=status,
        detail=(
            f"FSDP2 world 1 ({backend}), bf16, act. ckpt, {sizes.train_rows} x {seq} tokens, micro-batch {sizes.train_micro_batch}: "
            f"{step_s:.2f} s/update{memory}; {matmul_params(trainer.model) / 1e6:.0f}M matmul params, grad_norm {metrics['grad_norm']:.3f}"
        ),
    )


def check_sync(report: Report, engine, trainer, shape: str, engine_dtype: str, sizes: Sizes) -> None:
    """The trainer's weights into the engine process by IPC handles, in the engine's
    dtype: one warm-up sync, then `sizes.syncs` timed ones; the engine's weights must
    equal the trainer's."""
    from ratchet.workers.weight_sync.colocated_process import weights_digest
    from ratchet.workers.weight_sync.trainer_side import sync_plan

    bucket_mb = trainer.cfg.trainer.sync_bucket_mb
    first = engine.sync_from(trainer.model, engine_dtype=engine_dtype, bucket_mb=bucket_mb, version=1)
    timed = [engine.sync_from(trainer.model, engine_dtype=engine_dtype, bucket_mb=bucket_mb, version=2 + i) for i in range(sizes.syncs)]
    best = min(timed, key=lambda s: s.seconds)
    entries, manifest = sync_plan(trainer.model, engine_dtype=engine_dtype, bucket_mb=bucket_mb, version=0)
    want, got = weights_digest(entries, manifest), engine.digest()
    wrong = [k for k, v in want.items() if k in got and got[k] != v] + sorted(set(got) - set(want) - {a for a, _ in manifest.aliases})
    goal, status = "", "PASS"
    if shape == "0.5B":
        goal = f"<= {GOAL_SYNC_S} s"
        status = "PASS" if best.seconds <= GOAL_SYNC_S and not wrong else "FAIL"
    elif wrong:
        status = "FAIL"
    how = "CUDA IPC handles" if trainer.device.type == "cuda" else "shared memory (the CPU's stand-in for CUDA IPC)"
    report.add(
        f"weight sync to an engine process, {shape}",
        f"{best.seconds:.3f} s, {best.gb_per_s:.1f} GB/s",
        goal=goal,
        status=status,
        detail=(
            f"{best.bytes / 2**20:,.1f} MiB of {engine_dtype} in {best.buckets} buckets of <= {bucket_mb:g} MB, {how}, "
            f"at most {best.window_peak} shared at once; first sync {first.seconds:.3f} s; best of {len(timed)}: "
            + ("the engine's weights equal the trainer's" if not wrong else f"{len(wrong)} tensors differ, first {wrong[:3]}")
        ),
    )


def check_hand_over(report: Report, engine, device: str) -> None:
    """The colocated engine frees the GPU for the update and takes it back; it answers
    the same after."""
    probe = [[1, 5, 6, 7, 8, 9, 17], [1, 3, 4, 17]]
    before = engine.greedy(probe, 16)
    slept = engine.sleep()
    woke = engine.wake_up()
    after = engine.greedy(probe, 16)
    same = before == after
    if device != "cuda":
        report.add("engine hand-over (sleep, wake up)", "nothing to free on CPU", status="PASS" if same else "FAIL",
                   detail=f"sleep {slept.seconds * 1e3:.2f} ms, wake {woke.seconds * 1e3:.2f} ms; answers " + ("unchanged" if same else "CHANGED"))  # fmt: skip
        return
    released = slept.allocated_before - slept.allocated_after
    # Everything goes (the weights, cuBLAS's workspaces, the cache); the weights come back.
    ok = same and slept.allocated_after < 0.05 * slept.weight_bytes and woke.allocated_after >= woke.weight_bytes
    report.add(
        "engine hand-over (sleep, wake up)",
        f"released {released / 2**30:.2f} GiB in {slept.seconds:.2f} s, back in {woke.seconds:.2f} s",
        status="PASS" if ok else "FAIL",
        detail=(
            f"engine process GPU memory {slept.allocated_before / 2**30:.2f} -> {slept.allocated_after / 2**30:.2f} -> "
            f"{woke.allocated_after / 2**30:.2f} GiB (weights, {slept.weight_bytes / 2**30:.2f} GiB, to host memory and back; "
            "cuBLAS's workspaces released too); greedy answers " + ("unchanged" if same else "CHANGED")
        ),
    )


def check_grpo(report: Report, work: Path, device: str, sizes: Sizes) -> None:
    """Warm the tiny model up on the copy task (supervised, on CPU), then GRPO through
    LocalLoop with the trainer (bf16, act. ckpt) and the HF engine on `device`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ratchet.models.tiny import build_tiny_model
    from ratchet.tasks.generate import make_rows
    from ratchet.workers.engines.hf import HFEngine
    from ratchet.workers.local_loop import LocalLoop
    from ratchet.workers.prompts import PromptSet
    from ratchet.workers.warmup import supervised_warmup

    data = work / "copy.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_rows("copy", 2000, seed=0, min_len=4, max_len=4)))
    base = build_tiny_model(work / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    t0 = time.perf_counter()
    losses = supervised_warmup(
        model, tokenizer, PromptSet(str(data), tokenizer), steps=sizes.grpo_warmup_steps, lr=3e-3, batch_size=64, seed=0
    )
    warmed = work / "tiny-warm"
    model.save_pretrained(warmed, safe_serialization=True)
    tokenizer.save_pretrained(warmed)
    warm_s = time.perf_counter() - t0
    cfg = run_config(
        {
            "model": {"path": str(warmed)},
            "data": {"train_files": str(data)},
            "rollout": {"n": 8, "max_response_length": 6, "temperature": 1.0},
            "trainer": {"device": device, "lr": 1e-3, "micro_batch_size": 128, "mixed_precision": "bf16", "activation_checkpointing": True},
            "loop": {"prompts_per_step": 16, "steps": sizes.grpo_steps},
            "algorithm": {"kl": {"coef": 0.0}},
            "resources": {"torch_threads": torch.get_num_threads()},  # LocalLoop sets it; the CPU engine uses them
        }
    )  # fmt: skip
    engine = HFEngine(str(warmed))  # built here: the snapshot config has no engine options; on the GPU when there is one
    loop = LocalLoop(cfg, engine=engine)
    rewards, step_times = [], []
    for step in range(sizes.grpo_steps):
        t0 = time.perf_counter()
        rewards.append(loop.step(step)["reward_mean"])
        step_times.append(time.perf_counter() - t0)
    k = min(10, len(rewards))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    rise = GOAL_GRPO_RISE.get(sizes.grpo_steps)
    status = "info" if rise is None else ("PASS" if last - first >= rise else "FAIL")
    report.add(
        "GRPO via LocalLoop (tiny model, copy task)",
        f"reward {first:.3f} -> {last:.3f} (first, last {k} steps)",
        goal="" if rise is None else f"rise >= {rise}",
        status=status,
        detail=(
            f"{sizes.grpo_steps} steps of 16 prompts x 8, trainer on {loop.trainer.device.type} (bf16, act. ckpt), HF engine on "
            f"{engine.device.type}, {sum(step_times) / len(step_times):.3f} s/step; warm-up {sizes.grpo_warmup_steps} SFT steps "
            f"in {warm_s:.1f} s (loss {losses[0]:.2f} -> {losses[-1]:.2f}); per step: {' '.join(f'{r:.2f}' for r in rewards)}"
        ),
    )
    del loop, engine
    _free_cuda()


SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", re.M)


def check_gpu_tests(report: Report, device: str, timeout_s: float) -> None:
    """pytest on tests/gpu in this very interpreter set-up (flags, sys.path)."""
    cmd = [sys.executable, *(["-S"] if sys.flags.no_site else []), "-m", "pytest", "tests/gpu", "-p", "no:cacheprovider", "-q", "-rfEs"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*SOURCE_PATHS, os.environ.get("PYTHONPATH", "")])}
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        report.add("tests/gpu", f"timed out after {timeout_s:.0f} s", status="FAIL")
        return
    text = out.stdout + out.stderr
    if report.out is not None:  # the whole output, tracebacks included: the table has room for the FAILED lines only
        report.out.mkdir(parents=True, exist_ok=True)
        (report.out / "tests_gpu.log").write_text(text)
    found = SUMMARY.findall(text)
    summary = found[-1] if found else f"no summary (exit {out.returncode})"
    failed = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
    if out.returncode != 0:
        print(text[-6000:], flush=True)
    ran = "passed" in summary
    status = "PASS" if out.returncode == 0 and (ran or device != "cuda") else "FAIL"
    report.add(
        "tests/gpu",
        summary,
        status=status,
        detail="; ".join(failed[:5]) if failed else ("" if device == "cuda" else "gpu-marked: skipped without a GPU"),
    )


# --------------------------------------------------------------------------- main


SOURCE_PATHS: list[str] = []  # ratchet's source tree and the repository (tests/), as put on sys.path


def prepare_interpreter(src: Path) -> None:
    """ratchet from the source tree, tests/ importable, nothing fetched from the network."""
    SOURCE_PATHS[:] = [str(src.resolve()), str(ROOT)]
    for path in reversed(SOURCE_PATHS):
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(1, path)
    for var, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(var, value)


def as_gpu_machine(argv: list[str]) -> int:
    """Run this check again with only the GPU machine's packages importable (gpu_machine.py)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import gpu_machine

    with tempfile.TemporaryDirectory(prefix="ratchet-gpu-machine-") as tmp:
        site = Path(tmp) / "site"
        linked = gpu_machine.build_site(site)
        print(f"[gpu_check] as the GPU machine: {len(linked)} distributions importable, ratchet from the source tree", flush=True)
        args = [str(Path(__file__).resolve()), *[a for a in argv if a != "--as-gpu-machine"]]
        return gpu_machine.run_as_gpu_machine(args, site, cwd=ROOT).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="0.5B only, a shorter GRPO run: about 3 minutes")
    ap.add_argument("--cpu-smoke", action="store_true", help="every check, small, on CPU (gloo, shared memory)")
    ap.add_argument("--as-gpu-machine", action="store_true", help="run with only the GPU machine's packages importable")
    ap.add_argument("--only", nargs="*", choices=["imports", "generate", "trainer", "sync", "grpo", "tests"], help="run only these checks")
    ap.add_argument(
        "--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None, help="write the table here ($OUT)"
    )
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="the ratchet source tree to check")
    ap.add_argument("--budget-s", type=float, default=None, help="skip the checks not started by then (default: by mode)")
    ap.add_argument("--write-config-snapshot", action="store_true", help=f"rewrite {SNAPSHOT.name} from the schema (needs pydantic)")
    args = ap.parse_args(argv)
    if args.as_gpu_machine:
        return as_gpu_machine(argv)
    prepare_interpreter(args.src)
    if args.write_config_snapshot:
        SNAPSHOT.write_text(json.dumps(snapshot_dict(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {SNAPSHOT}")
        return 0
    import torch
    import transformers

    if not args.cpu_smoke and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device is visible (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda}); run it on a GPU machine, or "
            "with --cpu-smoke to exercise the same code paths on CPU",
            file=sys.stderr,
        )
        return 2
    device = "cpu" if args.cpu_smoke else "cuda"
    sizes = SMOKE if args.cpu_smoke else (QUICK if args.quick else FULL)
    budget = args.budget_s if args.budget_s is not None else sizes.budget_s
    torch.set_num_threads(1 if args.cpu_smoke else min(8, os.cpu_count() or 1))
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (smoke)"
    try:
        import pydantic  # noqa: F401

        config_source = "RunConfig (pydantic)"
    except ImportError:
        config_source = f"{SNAPSHOT.name} (no pydantic)"
    mode = "cpu smoke" if args.cpu_smoke else ("quick" if args.quick else "full")
    header = (
        f"ratchet GPU check ({mode}): {device_name}, torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
        f"{transformers.__version__}, Python {sys.version.split()[0]}, config from {config_source}"
    )
    print(f"[gpu_check] {header}", flush=True)
    report = Report(header, out=args.out)
    only = set(args.only or ("imports", "generate", "trainer", "sync", "grpo", "tests"))
    started = time.perf_counter()

    def run(name: str, fn, *fn_args):
        """fn(*fn_args), or None with a FAIL row when it raised (the other checks go on)."""
        if time.perf_counter() - started > budget:
            report.add(name, f"not started: past the {budget:.0f} s budget", status="skipped")
            return None
        try:
            return fn(*fn_args)
        except Exception as e:  # noqa: BLE001 - one failed check must not hide the others' numbers
            message = str(e).splitlines()[0][:300] if str(e) else ""
            report.add(name, "FAILED", status="FAIL", detail=f"{type(e).__name__}: {message}")
            _free_cuda()
            return None

    if not check_imports(report) or only == {"imports"}:
        report.print(time.perf_counter() - started)
        return 1 if report.failures else 0
    with tempfile.TemporaryDirectory(prefix="ratchet-gpu-check-") as tmp:
        work = Path(tmp)
        engine = None
        if "sync" in only:
            from ratchet.workers.weight_sync.colocated_process import ColocatedEngine

            engine = ColocatedEngine(threads=1, timeout_s=240)  # starts now: its imports overlap the model building
        try:
            for shape in sizes.shapes:
                model = run(f"build {shape} model", build_random_model, work / shape, shape, device)
                if model is None:
                    continue
                if "generate" in only:
                    run(f"generate, HFEngine, {shape}", check_generate, report, model, shape, device, sizes)
                if shape not in sizes.trainer_shapes or not only & {"trainer", "sync"}:
                    continue
                trainer = run(f"trainer, {shape}", build_trainer, model, device, sizes)
                if trainer is not None and "trainer" in only:
                    run(f"trainer update, {shape}", check_trainer, report, trainer, shape, device, device_name, sizes)
                if trainer is not None and engine is not None:
                    engine_dtype = "bfloat16" if device == "cuda" else "float32"
                    if run(f"engine process loads {shape}", engine.load, str(model), engine_dtype) is not None:
                        run(f"weight sync to an engine process, {shape}", check_sync, report, engine, trainer, shape, engine_dtype, sizes)
                        if shape == sizes.shapes[0]:
                            run("engine hand-over (sleep, wake up)", check_hand_over, report, engine, device)
                del trainer
                _free_cuda()
                if torch.distributed.is_initialized():
                    torch.distributed.destroy_process_group()  # the next trainer joins a group of its own
        finally:
            if engine is not None:
                engine.close()
        if "grpo" in only:
            run("GRPO via LocalLoop (tiny model, copy task)", check_grpo, report, work, device, sizes)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if "tests" in only:
        left = budget - (time.perf_counter() - started)
        run("tests/gpu", check_gpu_tests, report, device, max(90.0, left + 60.0))
    for path, reason in NOT_TESTABLE:
        report.add(path, "not tested", status="not testable", detail=reason)
    passed = sum(r.status == "PASS" for r in report.rows)
    report.print(time.perf_counter() - started)
    print(
        f"gpu_check: {passed} passed, {report.failures} failed, "
        f"{sum(r.status == 'skipped' for r in report.rows)} skipped, {len(NOT_TESTABLE)} not testable here "
        f"({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
