"""A supervised pipeline stage's training (SFT or DPO), one chunk of steps at a time, in one
process: run as a Ray task by the activity `supervised_chunk` (activities/supervised.py),
or called in-process by tests. No Ray, no Temporal here.

A chunk is a pure function of its inputs: steps [start, end) start from checkpoint
`step-<start>` of the stage's run folder (or from the stage's starting model at step 0),
draw their batches from the data order (data/order.epoch_order of the seed; position p of
the stream is row order[p % rows] of epoch p // rows), and commit checkpoint `step-<end>`
(the policy as a Hugging Face folder, AdamW's state as safetensors, the manifest last). A
chunk retried after a crash recomputes the same steps from the same checkpoint and commits
the same checkpoint again; a stage resumed later goes on from the last committed one. The
last chunk also writes `final/model` (a model folder with its manifest), which the next
stage starts from.

DPO's reference is the stage's starting model, frozen (loaded again by each chunk: a
~1 s read for a small model, and no state to keep between chunks); SimPO needs none.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet.storage.checkpoint_store import CheckpointStore
from ratchet.storage.metrics_log import MetricsLog
from ratchet.storage.object_store import ObjectStore
from ratchet.storage.layout import RunLayout

log = logging.getLogger(__name__)

HF_DIR = "hf"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
STAGE_CONFIG = "stage.json"  # in the stage's run folder: the stage's own config (config.json is an RL run's)


@dataclass(frozen=True)
class ChunkRequest:
    run_uri: str  # the stage's run folder
    stage: dict[str, Any]  # the stage's config (config/schema.py SftStage or DpoStage), as JSON
    stage_index: int
    model_uri: str  # the stage's starting model (a local folder or a model folder in the store)
    start: int
    end: int
    seed: int = 0
    torch_threads: int = 1


@dataclass(frozen=True)
class ChunkResult:
    start: int
    end: int
    checkpoint: str
    train: dict[str, float]  # means over the chunk's steps
    eval_before: dict[str, float] = field(default_factory=dict)  # at step 0 only: the starting model
    eval_after: dict[str, float] = field(default_factory=dict)
    model_uri: str = ""  # final/model, once the last step is trained
    seconds: float = 0.0


def checkpoint_name(step: int) -> str:
    return RunLayout.checkpoint_name(step)


def run_chunk(req: ChunkRequest) -> ChunkResult:
    """Train steps [req.start, req.end) of the stage and commit checkpoint `step-<end>`."""
    import torch

    from ratchet.config.schema import stage_model

    from .runtime import configure_worker_process

    t0 = time.perf_counter()
    configure_worker_process(req.torch_threads)
    stage = stage_model(req.stage)
    run = ObjectStore(req.run_uri)
    torch.manual_seed(req.seed * 1_000_003 + req.start)
    with tempfile.TemporaryDirectory(prefix="ratchet-stage-") as tmp:
        trainer = _StageTrainer(stage, req, Path(tmp))
        before = trainer.evaluate() if req.start == 0 else {}
        losses: list[dict[str, float]] = []
        for step in range(req.start, req.end):
            m = trainer.step(step)
            losses.append(m)
            MetricsLog(run).write(step, {"stage": req.stage_index, "kind": stage.kind, **{f"train/{k}": v for k, v in m.items()}})
        after = trainer.evaluate()
        if after:
            MetricsLog(run).write(req.end - 1, {**_read_line(run, req.end - 1), **{f"eval/{k}": v for k, v in after.items()}})
        name = checkpoint_name(req.end)
        local = trainer.save(Path(tmp) / "out")
        CheckpointStore(run).commit(name, local, {"step": req.end, "kind": stage.kind, "stage": req.stage_index})
        model_uri = ""
        if req.end >= stage.steps:
            from .hf_io import upload_hf_folder

            model_uri = upload_hf_folder(local / HF_DIR, run, RunLayout.FINAL_MODEL)
    train = {k: sum(m[k] for m in losses) / len(losses) for k in losses[0]} if losses else {}
    return ChunkResult(req.start, req.end, name, train, before, after, model_uri, time.perf_counter() - t0)


def _read_line(run: ObjectStore, step: int) -> dict:
    for line in MetricsLog(run).read():
        if line["step"] == step:
            return {k: v for k, v in line.items() if k not in ("step", "time_unix", "time_utc")}
    return {}


class _StageTrainer:
    """The policy, its optimizer, the data and (DPO) the reference for one chunk."""

    def __init__(self, stage, req: ChunkRequest, tmp: Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ratchet.config.loader import ConfigError
        from ratchet.data.conversations import SupervisedDataError

        from .hf_io import local_hf_path

        self.stage, self.req = stage, req
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        start_model = local_hf_path(req.model_uri)
        self.tokenizer = AutoTokenizer.from_pretrained(start_model)
        policy_dir, opt_state = start_model, None
        if req.start > 0:
            restored = tmp / "restored"
            CheckpointStore(ObjectStore(req.run_uri)).download(checkpoint_name(req.start), restored)
            policy_dir, opt_state = str(restored / HF_DIR), restored
        self.model = AutoModelForCausalLM.from_pretrained(policy_dir).to(self.device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=stage.lr, weight_decay=stage.weight_decay, betas=tuple(stage.betas))
        if opt_state is not None:
            _load_optimizer(self.optimizer, opt_state)
        self.reference = None
        if stage.kind == "dpo" and _pref_loss(stage).needs_reference:
            self.reference = AutoModelForCausalLM.from_pretrained(start_model).to(self.device).eval()
            self.reference.requires_grad_(False)
        try:
            self.train_rows = self._encode(stage.data.train_files)
            self.eval_rows = self._encode(stage.data.eval_files)[: stage.eval_size] if stage.data.eval_files else []
        except SupervisedDataError as exc:
            raise ConfigError([(f"stages.{req.stage_index}.data", str(exc))]) from None

    # -- data ------------------------------------------------------------------------------

    def _encode(self, path: str) -> list:
        from ratchet.data.conversations import encode_conversation, encode_pair, read_conversations, read_preferences

        d, limit = self.stage.data, self.stage.max_length
        seqs: list[tuple]  # (conversation,) for SFT, (chosen, rejected) for DPO
        if self.stage.kind == "sft":
            rows = [encode_conversation(self.tokenizer, m) for m in read_conversations(path, d.messages_key)]
            seqs = [(r,) for r in rows]
        else:
            seqs = [encode_pair(self.tokenizer, p) for p in read_preferences(path, d.prompt_key, d.chosen_key, d.rejected_key)]
        from ratchet.data.conversations import SupervisedDataError

        for i, seq in enumerate(seqs):
            longest = max(len(e.input_ids) for e in seq)
            if longest > limit:
                raise SupervisedDataError(
                    f"{path}: row {i} is {longest} tokens long, over the stage's max_length={limit}; raise it or drop the row"
                )
        return seqs

    def _rows(self, step: int) -> list:
        from ratchet.data.order import epoch_order

        n, b = len(self.train_rows), self.stage.batch_size
        out = []
        for p in range(step * b, (step + 1) * b):
            order = epoch_order(self.req.seed, p // n, n)
            out.append(self.train_rows[order[p % n]])
        return out

    def _batch(self, encoded: list):
        import torch

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        width = max(len(e.input_ids) for e in encoded)
        ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        mask = torch.zeros_like(ids)
        for r, e in enumerate(encoded):
            n = len(e.input_ids)
            ids[r, :n] = torch.tensor(e.input_ids)
            attn[r, :n] = 1
            mask[r, :n] = torch.tensor(e.loss_mask)
        return ids.to(self.device), attn.to(self.device), mask.to(self.device)

    def _logprobs(self, model, encoded: list):
        from ratchet.algorithms.sft import token_logprobs

        ids, attn, mask = self._batch(encoded)
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        return token_logprobs(logits, ids), mask

    # -- losses ----------------------------------------------------------------------------

    def _sft(self, rows: list):
        from ratchet.algorithms.sft import sft_loss

        lp, mask = self._logprobs(self.model, [r[0] for r in rows])
        loss = sft_loss(lp, mask)
        return loss, {"loss": loss.item(), "tokens": float(mask.sum())}

    def _dpo(self, rows: list):
        import torch

        from ratchet.algorithms.preference import PrefInputs, PrefParams, preference_metrics
        from ratchet.algorithms.sft import sequence_logprobs

        seqs = [r[0] for r in rows] + [r[1] for r in rows]
        lp, mask = self._logprobs(self.model, seqs)
        sums, counts = sequence_logprobs(lp, mask)
        b = len(rows)
        ref_c = ref_r = None
        if self.reference is not None:
            with torch.no_grad():
                rlp, _ = self._logprobs(self.reference, seqs)
                ref_sums, _ = sequence_logprobs(rlp, mask)
            ref_c, ref_r = ref_sums[:b], ref_sums[b:]
        s = self.stage
        params = PrefParams(beta=s.beta, label_smoothing=s.label_smoothing, simpo_gamma=s.simpo_gamma)
        out = _pref_loss(s).fn(PrefInputs(sums[:b], sums[b:], counts[:b], counts[b:], ref_c, ref_r), params)
        metrics = preference_metrics(out)
        # The policy's own preference, whatever the loss: does it give the chosen completion
        # more log-likelihood per token than the rejected one?
        per_token = (sums / counts.clamp(min=1)).detach()
        metrics["logp_accuracy"] = float((per_token[:b] > per_token[b:]).float().mean())
        return out.losses.mean(), metrics

    def _loss(self, rows: list):
        return self._sft(rows) if self.stage.kind == "sft" else self._dpo(rows)

    def step(self, step: int) -> dict[str, float]:
        import torch

        from ratchet.errors import NonFiniteError

        loss, metrics = self._loss(self._rows(step))
        if not torch.isfinite(loss):
            raise NonFiniteError(f"stage {self.req.stage_index} ({self.stage.kind}) step {step}: the loss is {float(loss)}; lower lr")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.stage.grad_clip))
        self.optimizer.step()
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics over eval_files: SFT the token-mean loss, DPO the preference
        metrics; token-weighted / pair-weighted over batches of batch_size."""
        import torch

        if not self.eval_rows:
            return {}
        self.model.eval()
        totals: dict[str, float] = {}
        weight_sum = 0.0
        with torch.no_grad():
            for i in range(0, len(self.eval_rows), self.stage.batch_size):
                rows = self.eval_rows[i : i + self.stage.batch_size]
                _, m = self._loss(rows)
                w = m.pop("tokens", None) if self.stage.kind == "sft" else float(len(rows))
                for k, v in m.items():
                    totals[k] = totals.get(k, 0.0) + v * w
                weight_sum += w
        self.model.train()
        return {k: v / weight_sum for k, v in totals.items()}

    # -- checkpoint ------------------------------------------------------------------------

    def save(self, out: Path) -> Path:
        from safetensors.torch import save_file

        from .hf_io import write_hf_folder

        out.mkdir(parents=True)
        write_hf_folder(self.model, self.tokenizer, out / HF_DIR)
        sd = self.optimizer.state_dict()
        tensors = {f"{idx}.{k}": v.detach().cpu().contiguous() for idx, st in sd["state"].items() for k, v in st.items()}
        save_file(tensors, str(out / OPTIMIZER_TENSORS))
        (out / OPTIMIZER_META).write_text(json.dumps({"param_groups": sd["param_groups"]}))
        return out


def _pref_loss(stage):
    from ratchet.catalog.algorithms import PREFERENCE_LOSSES

    return PREFERENCE_LOSSES.get(stage.loss)


def _load_optimizer(optimizer, folder: Path) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(folder / OPTIMIZER_TENSORS))
    groups = json.loads((folder / OPTIMIZER_META).read_text())["param_groups"]
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": groups})
