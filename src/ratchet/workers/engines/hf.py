"""Hugging Face transformers engine: batched sampling with `model.generate`.

Partial rollouts: a logits processor runs between decode steps and lets a pending weight
update land there, so a generation in flight continues with the new weights instead of
being thrown away. Tokens from then on carry the new version; the KV cache of the earlier
tokens was computed by the old weights and is kept (as AReaL and verl's partial rollouts
do), which the stored per-token behaviour log-probs and versions account for.
"""

from __future__ import annotations

import warnings
from typing import Iterable

import numpy as np
import torch

from .base import Generation, SamplingParams, WeightSwap


class _SwapPoint:
    """A logits processor that only offers the weights a chance to change after each decode
    step and remembers where they did: [(first new-token index, version), ...]."""

    def __init__(self, swap: WeightSwap, version: int):
        self.swap, self.changes, self.step = swap, [(0, version)], 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.step += 1  # these scores (old weights) pick token step-1; the next forward is new
        version = self.swap()
        if version is not None:
            self.changes.append((self.step, version))
        return scores

    def versions(self, length: int) -> list[int]:
        out = []
        for i, (start, version) in enumerate(self.changes):
            end = self.changes[i + 1][0] if i + 1 < len(self.changes) else length
            out += [version] * max(0, min(end, length) - start)
        return out


class _Sampler:
    """The last logits processor: the draw itself. HF then generates with `do_sample=False`
    and picks the one token left possible, the drawn one. Drawing here records each drawn
    token's log-prob as it is drawn, one number per row and step, where HF's own
    `output_scores` keeps every step's [rows, vocabulary] logits to the end (256 rows x a
    152k vocabulary x 512 steps: 80 GB in float32, and as much again to stack them).

    `seeds`: None is greedy (the most likely token); one seed draws every row from one
    stream (HF's own sampling: softmax of the processed scores, `torch.multinomial`, so a
    seed gives the tokens HF's sampler gave); one seed per prompt draws the `n` rows of
    prompt i from a stream of `seeds[i]` alone, so that a prompt's samples do not depend
    on which other prompts share the call, which is what lets a batch be split over engine
    replicas unchanged. The streams live on the scores' device: on a GPU no logits cross
    to the host."""

    def __init__(self, seeds: tuple[int, ...] | None, *, per_prompt: bool):
        self.seeds, self.per_prompt = seeds, per_prompt
        self.generators: list[torch.Generator] | None = None
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = scores.float().log_softmax(-1)
        if self.seeds is None:
            tokens = logp.argmax(-1, keepdim=True)
        else:
            if self.generators is None:
                self.generators = [torch.Generator(device=scores.device).manual_seed(int(s)) for s in self.seeds]
            probs = logp.exp() if self.per_prompt else scores.float().softmax(-1)  # HF's sampler: softmax
            rows = scores.shape[0] // len(self.generators)  # n per prompt, or every row for one stream
            tokens = torch.cat([torch.multinomial(probs[i * rows : (i + 1) * rows], 1, generator=g) for i, g in enumerate(self.generators)])
        self.logprobs.append(logp.gather(-1, tokens).squeeze(-1))
        return torch.full_like(scores, float("-inf")).scatter_(-1, tokens, 0.0)


def release_cuda_workspaces() -> None:
    """Give back what this process's CUDA allocator still holds once the weights are off
    the GPU: cuBLAS's per-stream workspaces (32 MiB each on Hopper, allocated through the
    caching allocator and kept for the process's life: the 0.03 GiB the GPU check found
    left after sleep), then the cached blocks."""
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # absent from CPU builds
    if clear_workspaces is not None:
        torch.cuda.synchronize()  # a workspace may still be in use by a queued matmul
        clear_workspaces()
    torch.cuda.empty_cache()


class HFEngine:
    supports_partial_rollout = True

    def __init__(self, model_path: str, *, dtype: str = "float32"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        # The GPU when this process sees one (a Ray actor given num_gpus), else the CPU.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device)
        self.model.eval()
        self.asleep = False
        self.pad_id = self.tokenizer.pad_token_id
        self.eos_id = self.tokenizer.eos_token_id

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, version: int = 0, weight_swap: WeightSwap | None = None
    ) -> list[list[Generation]]:
        """Left-padded prompts, each repeated `n` times (once when greedy), generated in one
        `model.generate` call; the draw is `_Sampler`'s (its docstring: which seeds give
        which streams). Sampling applies HF's own warpers in HF's order (temperature, then
        top-p), after the weight-swap point."""
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

        if self.asleep:
            raise RuntimeError("the HF engine is asleep (its weights are in host memory): call wake_up() before generate")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        n = 1 if params.greedy else params.n
        swap_point = _SwapPoint(weight_swap or (lambda: None), version)
        processors = [swap_point]
        if params.greedy:
            seeds = None
        else:
            if params.prompt_seeds is not None and len(params.prompt_seeds) != len(prompts):
                raise ValueError(f"{len(params.prompt_seeds)} prompt seeds for {len(prompts)} prompts")
            seeds = params.prompt_seeds if params.prompt_seeds is not None else (params.seed,)
            if params.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(params.temperature))
            if params.top_p < 1.0:
                processors.append(TopPLogitsWarper(params.top_p))
        sampler = _Sampler(seeds, per_prompt=params.prompt_seeds is not None)
        out = self.model.generate(
            input_ids=ids.repeat_interleave(n, dim=0).to(self.model.device),
            attention_mask=mask.repeat_interleave(n, dim=0).to(self.model.device),
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            logits_processor=LogitsProcessorList([*processors, sampler]),
        )
        new = out.sequences[:, width:].cpu()
        logprobs = torch.stack(sampler.logprobs, dim=1).cpu()
        versions = swap_point.versions(new.shape[1])
        results: list[list[Generation]] = []
        for row in range(new.shape[0]):
            tokens = new[row].tolist()
            end = tokens.index(self.eos_id) + 1 if self.eos_id in tokens else len(tokens)
            if row % n == 0:
                results.append([])
            results[-1].append(Generation(token_ids=tokens[:end], logprobs=logprobs[row, :end].tolist(), versions=versions[:end]))
        if params.greedy and params.n > 1:
            results = [group * params.n for group in results]
        return results

    def sleep(self) -> None:
        """Colocated placement: hand the GPU to the trainer. The weights move to host
        memory, cuBLAS's workspaces and the allocator's cache are released (generation's
        KV cache is freed after every call anyway), so the device keeps nothing of this
        engine; `wake_up` moves them back. Nothing on a CPU, where there is no device
        memory to free."""
        if self.device.type != "cuda" or self.asleep:
            return
        self.model.to("cpu")
        release_cuda_workspaces()
        self.asleep = True

    def wake_up(self) -> None:
        if not self.asleep:
            return
        self.model.to(self.device)
        self.asleep = False

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> None:
        # Every parameter must arrive. A tied lm_head.weight (the embedding's storage under
        # a second name) may arrive too and is skipped: the embedding alone decides it.
        params = dict(self.model.named_parameters())
        aliases = set(self.model.state_dict()) - set(params)
        loaded: set[str] = set()
        unexpected: list[str] = []
        with torch.no_grad(), warnings.catch_warnings():
            # Arrays from Ray's object store are read-only; copy_ reads them without writing.
            warnings.simplefilter("ignore", UserWarning)
            for name, array in weights:
                target = params.get(name)
                if target is None:
                    if name not in aliases:
                        unexpected.append(name)
                    continue
                # numpy from the object store, or a tensor already on the device (CUDA IPC).
                source = array if isinstance(array, torch.Tensor) else torch.from_numpy(np.asarray(array))
                target.copy_(source.to(device=target.device, dtype=target.dtype))
                loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing or unexpected:
            raise ValueError(f"weight names do not match the engine's model: missing={missing[:5]} unexpected={unexpected[:5]}")
