"""Hugging Face transformers engine: batched sampling with `model.generate`."""

from __future__ import annotations

import warnings
from typing import Mapping

import numpy as np
import torch

from .base import Generation, SamplingParams


class HFEngine:
    def __init__(self, model_path: str, *, dtype: str = "float32"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.eval()
        self.pad_id = self.tokenizer.pad_token_id
        self.eos_id = self.tokenizer.eos_token_id

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        n = 1 if params.greedy else params.n
        # A private RNG stream seeded per call: the same (seed, prompts) give the same samples,
        # and the process's global generator is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(params.seed)
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
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
            )
        new = out.sequences[:, width:]
        # `scores` are the processed logits the sampler drew from (temperature, top-p applied).
        logprobs = torch.stack(out.scores, dim=1).float().log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        results: list[list[Generation]] = []
        for row in range(new.shape[0]):
            tokens = new[row].tolist()
            end = tokens.index(self.eos_id) + 1 if self.eos_id in tokens else len(tokens)
            gen = Generation(token_ids=tokens[:end], logprobs=logprobs[row, :end].tolist())
            if row % n == 0:
                results.append([])
            results[-1].append(gen)
        if params.greedy and params.n > 1:
            results = [group * params.n for group in results]
        return results

    def load_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        with warnings.catch_warnings():
            # Arrays from Ray's object store are read-only; load_state_dict copies them anyway.
            warnings.simplefilter("ignore", UserWarning)
            state = {k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        # Tied embeddings: lm_head.weight may be absent from the trainer's export.
        missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise ValueError(f"weight names do not match the engine's model: missing={missing[:5]} unexpected={unexpected[:5]}")
