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


class _PerPromptSampler:
    """The last logits processor when each prompt has its own seed: it draws the tokens of
    prompt i's n rows from a generator seeded with `seeds[i]` alone, records their log-probs
    under the processed distribution, and leaves only the drawn token possible, so that
    greedy selection takes it. A prompt's samples then do not depend on which other prompts
    share the call, which is what lets a batch be split over engine replicas unchanged
    (HF's own sampler draws every row from one global stream)."""

    def __init__(self, seeds: tuple[int, ...], n: int):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.n = n
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = scores.float().log_softmax(-1)
        probs = logp.exp()
        # The generators live on the CPU (one stream per prompt, whatever the device), so
        # the draw does too; a few KB per decode step.
        cpu_probs = probs.cpu()
        tokens = torch.cat(
            [torch.multinomial(cpu_probs[i * self.n : (i + 1) * self.n], 1, generator=g) for i, g in enumerate(self.generators)]
        ).to(scores.device)
        self.logprobs.append(logp.gather(-1, tokens).squeeze(-1))
        return torch.full_like(scores, float("-inf")).scatter_(-1, tokens, 0.0)


class HFEngine:
    supports_partial_rollout = True

    def __init__(self, model_path: str, *, dtype: str = "float32"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        # The GPU when this process sees one (a Ray actor given num_gpus), else the CPU.
        self.model.to("cuda" if torch.cuda.is_available() else "cpu")
        self.model.eval()
        self.pad_id = self.tokenizer.pad_token_id
        self.eos_id = self.tokenizer.eos_token_id

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, version: int = 0, weight_swap: WeightSwap | None = None
    ) -> list[list[Generation]]:
        from transformers import LogitsProcessorList

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        n = 1 if params.greedy else params.n
        swap_point = _SwapPoint(weight_swap or (lambda: None), version)
        if params.prompt_seeds is not None and not params.greedy:
            return self._generate_per_prompt(ids, mask, params, swap_point)
        # A private RNG stream seeded per call: the same (seed, prompts) give the same samples,
        # and the process's global generator is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(params.seed)
            out = self.model.generate(
                input_ids=ids.to(self.model.device),
                attention_mask=mask.to(self.model.device),
                do_sample=not params.greedy,
                temperature=None if params.greedy else params.temperature,
                top_p=None if params.greedy else params.top_p,
                top_k=None,
                max_new_tokens=params.max_new_tokens,
                num_return_sequences=n,
                eos_token_id=self.eos_id,
                pad_token_id=self.pad_id,
                output_scores=True,
                return_dict_in_generate=True,
                logits_processor=LogitsProcessorList([swap_point]),
            )
        new = out.sequences[:, width:].cpu()
        # `scores` are the processed logits the sampler drew from (temperature, top-p applied).
        logprobs = torch.stack(out.scores, dim=1).float().log_softmax(-1).cpu().gather(-1, new.unsqueeze(-1)).squeeze(-1)
        versions = swap_point.versions(new.shape[1])
        results: list[list[Generation]] = []
        for row in range(new.shape[0]):
            tokens = new[row].tolist()
            end = tokens.index(self.eos_id) + 1 if self.eos_id in tokens else len(tokens)
            gen = Generation(token_ids=tokens[:end], logprobs=logprobs[row, :end].tolist(), versions=versions[:end])
            if row % n == 0:
                results.append([])
            results[-1].append(gen)
        if params.greedy and params.n > 1:
            results = [group * params.n for group in results]
        return results

    def _generate_per_prompt(self, ids, mask, params: SamplingParams, swap_point: _SwapPoint) -> list[list[Generation]]:
        """Sampling with a seed per prompt (`params.prompt_seeds`): the same warpers as
        HF's sampling (temperature, then top-p), then `_PerPromptSampler` draws."""
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

        if len(params.prompt_seeds) != ids.shape[0]:
            raise ValueError(f"{len(params.prompt_seeds)} prompt seeds for {ids.shape[0]} prompts")
        n, width = params.n, ids.shape[1]
        sampler = _PerPromptSampler(params.prompt_seeds, n)
        processors = [swap_point]
        if params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(params.top_p))
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
        return results

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
