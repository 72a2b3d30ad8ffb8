"""The lent GPU machine's Python packages, and a local environment in which only those
are importable: where `gpu_check.py --as-gpu-machine` runs the check before it ever
reaches that machine, so that an import the machine cannot satisfy fails here, in CI.

The machine (../shared/DESIGN.md and the device tool's page of it, read 2026-11-17) has
Python 3.12, torch 2.11 + CUDA 13 and the distributions in `GPU_MACHINE_DISTRIBUTIONS`;
nothing else, and no network.
`build_site` makes a folder of symbolic links to this virtualenv's copies of those
distributions and of everything they require (what pip installed beside them there
too), and nothing more; `python -S` with that folder and `src/` on PYTHONPATH then sees
the standard library, those packages and ratchet's source tree, and no installed
ratchet, pydantic, Ray or Temporal. A distribution that is not installed here is left
out (it is only missing from the emulation, which never makes it stricter than needed).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What that machine has installed (distribution names as pip spells them; the device
# tool's list of the image's packages, read 2026-11-17: python3 is Python 3.12.3 with torch
# 2.11.0+cu130 and transformers 5.17.0).
GPU_MACHINE_DISTRIBUTIONS = (
    "absl-py", "accelerate", "aiofiles", "aiohappyeyeballs", "aiohttp", "aiosignal", "annotated-doc", "anyio",
    "attrs", "botorch", "build", "certifi", "charset-normalizer", "chex", "click", "cloudpickle", "cmake",
    "colorama", "contourpy", "coverage", "cuda-bindings", "cuda-core", "cuda-pathfinder", "cuda-toolkit",
    "cupy-cuda13x", "cycler", "cython", "diffrax", "e3nn", "einops", "equinox", "etils", "execnet", "filelock",
    "flatbuffers", "flax", "fonttools", "formulaic", "frozenlist", "fsspec", "gpytorch", "grpcio", "h11",
    "h5py", "hf-xet", "httpcore", "httpx", "huggingface-hub", "humanize", "hypothesis", "idna", "imageio",
    "iniconfig", "interface-meta", "jax", "jax-cuda13-pjrt", "jax-cuda13-plugin", "jaxlib", "jaxtyping",
    "jinja2", "joblib", "kiwisolver", "lazy-loader", "lightning", "lightning-utilities", "linear-operator",
    "lineax", "llvmlite", "lxml", "markdown", "markdown-it-py", "markupsafe", "matplotlib", "mdurl", "meson",
    "ml-dtypes", "mpi4py", "mpmath", "msgpack", "multidict", "multipledispatch", "mypy-extensions", "nanobind",
    "narwhals", "networkx", "ninja", "numba", "numba-cuda", "numpy", "numpyro", "nvidia-cublas",
    "nvidia-cuda-cupti", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cudnn-cu13", "nvidia-cufft",
    "nvidia-cufile", "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse", "nvidia-cusparselt-cu13",
    "nvidia-ml-py", "nvidia-nccl-cu13", "nvidia-nvjitlink", "nvidia-nvshmem-cu13", "nvidia-nvtx", "onnx",
    "onnx-ir", "onnxruntime", "onnxscript", "opencv-python-headless", "optax", "opt-einsum", "opt-einsum-fx",
    "optimistix", "orbax-checkpoint", "packaging", "pandas", "pathspec", "patsy", "peft", "pillow", "pip",
    "pluggy", "portalocker", "prometheus-client", "propcache", "protobuf", "psutil", "pyarrow", "pybind11",
    "py-cpuinfo", "pygments", "pyparsing", "pyproject-hooks", "pyre-extensions", "pytest", "pytest-benchmark",
    "pytest-cov", "pytest-mock", "pytest-timeout", "pytest-xdist", "python-dateutil", "pytorch-lightning",
    "pyyaml", "regex", "requests", "rich", "sacrebleu", "safetensors", "scikit-build-core", "scikit-image",
    "scikit-learn", "scipy", "seaborn", "sentencepiece", "sentence-transformers", "setuptools", "shellingham",
    "simplejson", "six", "sortedcontainers", "statsmodels", "sympy", "tabulate", "tensorboard",
    "tensorboard-data-server", "tensorstore", "threadpoolctl", "tifffile", "tiktoken", "timm", "tokenizers",
    "toolz", "torch", "torchaudio", "torchdiffeq", "torch-geometric", "torchmetrics", "torchvision", "tqdm",
    "transformers", "treescope", "triton", "typer", "typing-extensions", "typing-inspect", "urllib3", "uvloop",
    "wadler-lindig", "werkzeug", "wheel", "wrapt", "xarray", "xxhash", "yarl", "zipp",
)  # fmt: skip

# What it does not have and ratchet uses elsewhere: the check must never need these.
ABSENT_ON_GPU_MACHINE = (
    "pydantic", "omegaconf", "tenacity", "ray", "temporalio", "sqlalchemy", "alembic", "mlflow", "wandb", "optuna",
    "vllm", "sglang", "bitsandbytes", "s3fs", "minio", "gguf", "moto",
)  # fmt: skip


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed() -> dict[str, metadata.Distribution]:
    found: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonical(name), dist)
    return found


def _requirements(dist: metadata.Distribution) -> list[str]:
    """The names `dist` requires without extras, for this interpreter."""
    from packaging.requirements import Requirement

    out = []
    for line in dist.requires or ():
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(canonical(req.name))
    return out


def machine_closure(names=GPU_MACHINE_DISTRIBUTIONS) -> dict[str, metadata.Distribution]:
    """The installed distributions among `names` and everything they require, recursively,
    except the ones the machine is known to lack: a newer release here may require one of
    them (typer 0.29 requires pydantic), the machine's older one did not."""
    installed = _installed()
    absent = {canonical(n) for n in ABSENT_ON_GPU_MACHINE}
    todo = [canonical(n) for n in names]
    closure: dict[str, metadata.Distribution] = {}
    while todo:
        name = todo.pop()
        if name in closure or name not in installed or name in absent:
            continue
        closure[name] = installed[name]
        todo.extend(_requirements(installed[name]))
    return closure


def _top_level_entries(dist: metadata.Distribution) -> set[tuple[str, ...]]:
    """The paths (relative to site-packages) to link for `dist`: its top-level modules and
    packages, its .dist-info folder; inside a namespace package (no __init__.py, shared
    by several distributions: google/), the distribution's own subfolders."""
    entries: set[tuple[str, ...]] = set()
    base = Path(dist.locate_file(""))
    for f in dist.files or ():
        parts = Path(f).parts
        if not parts or parts[0] == ".." or parts[0] == "__pycache__" or parts[0].endswith(".pth"):
            continue
        top = parts[0]
        if len(parts) > 1 and not (base / top / "__init__.py").exists() and not top.endswith((".dist-info", ".data", ".libs")):
            entries.add((top, parts[1]))  # a namespace package: link its members one by one
        else:
            entries.add((top,))
    return entries


def build_site(dest: Path, names=GPU_MACHINE_DISTRIBUTIONS) -> list[str]:
    """Fill `dest` with links to the machine's distributions (as installed here); returns
    the distribution names linked."""
    dest.mkdir(parents=True, exist_ok=True)
    closure = machine_closure(names)
    for dist in closure.values():
        base = Path(dist.locate_file(""))
        for entry in sorted(_top_level_entries(dist)):
            source, target = base.joinpath(*entry), dest.joinpath(*entry)
            if not source.exists() or target.exists() or target.is_symlink():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(source)
    return sorted(closure)


def machine_env(site: Path, *, src: Path = ROOT / "src", extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a `python -S` that sees only `site`, ratchet's source and the
    repository (tests/ as a package), like the machine's interpreter with PYTHONPATH=src."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = os.pathsep.join([str(src), str(ROOT), str(site)])
    env["PYTHONNOUSERSITE"] = "1"
    env.update(extra or {})
    return env


def run_as_gpu_machine(args: list[str], site: Path, **kwargs) -> subprocess.CompletedProcess:
    """`python -S args...` in the machine's package set (`site` from `build_site`)."""
    env = machine_env(site, extra=kwargs.pop("extra_env", None))
    return subprocess.run([sys.executable, "-S", *args], env=env, **kwargs)
