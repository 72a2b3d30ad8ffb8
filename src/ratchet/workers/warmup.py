"""Supervised warm-up: a few seconds of next-token training on the task's answers.

Pure RL from random weights does not learn the digit tasks (no sample ever scores, so
there is no signal); a short warm-up teaches the answer format and a little of the task,
and RL takes it from there.
"""

from __future__ import annotations

import random

import torch

from .prompts import PromptSet
from .results import WarmupResult


def supervised_warmup(model, tokenizer, prompts: PromptSet, *, steps: int, lr: float, batch_size: int, seed: int) -> list[float]:
    """Train `model` in place on prompt -> ground truth + EOS; returns the loss per step."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    model.train()
    losses = []
    for _ in range(steps):
        idx = [rng.randrange(len(prompts)) for _ in range(batch_size)]
        seqs, starts = [], []
        for i in idx:
            answer = tokenizer(prompts.sample_info(i)["ground_truth"], add_special_tokens=False)["input_ids"]
            p = prompts.token_ids[i]
            seqs.append(p + answer + [eos])
            starts.append(len(p))
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        attn = torch.zeros_like(ids)
        for r, (s, st) in enumerate(zip(seqs, starts)):
            ids[r, : len(s)] = torch.tensor(s)
            attn[r, : len(s)] = 1
            labels[r, st : len(s)] = torch.tensor(s[st:])
        loss = model(input_ids=ids, attention_mask=attn, labels=labels, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


def warmup_policy(cfg, base_model_path: str, run_uri: str) -> WarmupResult:
    """Warm up the configured model and store it as `RunLayout.WARMUP_MODEL` in the run folder.

    Idempotent: a retried call finds the committed model (its manifest) and returns it."""
    import time

    from ratchet.storage.object_store import ObjectStore
    from ratchet.storage.layout import RunLayout

    from .hf_io import MANIFEST, save_hf
    from .runtime import configure_worker_process

    configure_worker_process(cfg.resources.torch_threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # after configure_worker_process: see hf_imports.py

    run = ObjectStore(run_uri)
    model_key, losses_key = RunLayout.WARMUP_MODEL, RunLayout.WARMUP_LOSSES
    if run.exists(f"{model_key}/{MANIFEST}") and run.exists(losses_key):
        stored = run.get_json(losses_key)
        return WarmupResult(run.uri(model_key), stored["loss_first"], stored["loss_last"], seconds=0.0)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(base_model_path)
    model = AutoModelForCausalLM.from_pretrained(base_model_path)
    prompts = PromptSet.from_config(cfg.data, cfg.data.train_files, tokenizer)
    w = cfg.warmup
    losses = supervised_warmup(model, tokenizer, prompts, steps=w.steps, lr=w.lr, batch_size=w.batch_size, seed=cfg.seed)
    summary = {"loss_first": losses[0], "loss_last": losses[-1]}
    uri = save_hf(model, tokenizer, run, model_key)
    run.put_json(losses_key, summary)
    return WarmupResult(uri, losses[0], losses[-1], seconds=time.perf_counter() - t0)
