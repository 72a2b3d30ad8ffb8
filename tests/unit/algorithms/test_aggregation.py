"""Loss aggregation modes by hand, and their loss/gradient invariance under micro-batching and across 2 gloo ranks."""

from __future__ import annotations

import math
import socket

import pytest
import torch

from ratchet.algorithms import LOSS_AGGREGATIONS, POLICY_LOSSES
from ratchet.algorithms.policy_losses import LossParams
from ratchet.algorithms.aggregation import Normaliser, masked_mean

from ...tensor_checks import close, lengths_mask

torch.set_num_threads(1)


# ----------------------------------------------------------------------------------- modes by hand

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
AGG_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])

# masked sum = 1 + 2 + 4 = 7; 3 tokens; 2 sequences
AGG_NORM = Normaliser(tokens=3.0, sequences=2.0, max_response_length=3)
AGG_EXPECTED = {
    "token-mean": 7 / 3,
    "seq-mean-token-sum": 7 / 2,
    "seq-mean-token-mean": ((1 + 2) / 2 + 4 / 1) / 2,  # 2.75
    "seq-mean-token-sum-norm": 7 / (2 * 3),
    "token-sum": 7.0,  # no normaliser at all
}


def test_all_aggregation_modes_registered():
    assert LOSS_AGGREGATIONS.names() == sorted(AGG_EXPECTED)


@pytest.mark.parametrize("mode", sorted(AGG_EXPECTED))
def test_aggregation_by_hand(mode):
    value = LOSS_AGGREGATIONS.get(mode)(LOSS, AGG_MASK, AGG_NORM)
    assert value.item() == pytest.approx(AGG_EXPECTED[mode], abs=1e-6)


def test_seq_mean_token_mean_empty_response_contributes_zero():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    value = LOSS_AGGREGATIONS.get("seq-mean-token-mean")(LOSS, mask, Normaliser(tokens=2, sequences=2))
    assert value.item() == pytest.approx(((1 + 2) / 2 + 0) / 2)  # 0.75
    assert math.isfinite(value.item())


def test_aggregation_empty_batch_is_zero_not_nan():
    mask = torch.zeros(2, 3)
    for mode in AGG_EXPECTED:
        value = LOSS_AGGREGATIONS.get(mode)(LOSS, mask, Normaliser(tokens=0, sequences=0, max_response_length=3))
        assert value.item() == 0.0, mode


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    assert masked_mean(x, mask).item() == pytest.approx((1 + 3 + 4) / 3)
    assert masked_mean(x, torch.zeros(2, 2)).item() == 0.0


# ------------------------------------------------------------------------------- global normaliser

# A 4-row batch whose halves have very different token counts (5 and 1 tokens): averaging
# per micro-batch would weigh the short half's token 5x more.
BIG_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [10.0, 11.0, 12.0]])
BIG_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])

# full batch: tokens 6, sequences 4; masked sum 1+2+3+4+5+7 = 22
BIG_NORM = Normaliser(tokens=6.0, sequences=4.0, max_response_length=3)
BIG_EXPECTED = {
    "token-mean": 22 / 6,
    "seq-mean-token-sum": 22 / 4,
    "seq-mean-token-mean": ((1 + 2 + 3) / 3 + (4 + 5) / 2 + 7 / 1 + 0) / 4,  # (2 + 4.5 + 7) / 4 = 3.375
    "seq-mean-token-sum-norm": 22 / (4 * 3),
    "token-sum": 22.0,
}


@pytest.mark.parametrize("mode", sorted(BIG_EXPECTED))
def test_global_normaliser_makes_micro_batches_sum_to_full_batch(mode):
    agg = LOSS_AGGREGATIONS.get(mode)
    full = agg(BIG_LOSS, BIG_MASK, BIG_NORM)
    halves = agg(BIG_LOSS[:2], BIG_MASK[:2], BIG_NORM) + agg(BIG_LOSS[2:], BIG_MASK[2:], BIG_NORM)
    assert full.item() == pytest.approx(BIG_EXPECTED[mode], abs=1e-6)
    assert halves.item() == pytest.approx(BIG_EXPECTED[mode], abs=1e-6)
    # strided split (how trainer ranks take rows) is the same
    strided = agg(BIG_LOSS[0::2], BIG_MASK[0::2], BIG_NORM) + agg(BIG_LOSS[1::2], BIG_MASK[1::2], BIG_NORM)
    assert strided.item() == pytest.approx(BIG_EXPECTED[mode], abs=1e-6)


def test_local_token_mean_would_differ_which_is_why_the_normaliser_is_global():
    # halves with local normalisers: (1+2+3+4+5)/5 = 3 and 7/1 = 7; mean 5 != 22/6
    agg = LOSS_AGGREGATIONS.get("token-mean")
    local = (agg(BIG_LOSS[:2], BIG_MASK[:2], Normaliser(5, 2)) + agg(BIG_LOSS[2:], BIG_MASK[2:], Normaliser(1, 2))) / 2
    assert local.item() == pytest.approx(5.0)
    assert local.item() != pytest.approx(22 / 6)


@pytest.mark.parametrize("mode", sorted(BIG_EXPECTED))
def test_global_normaliser_makes_micro_batch_gradients_sum_to_full_batch(mode):
    agg = LOSS_AGGREGATIONS.get(mode)
    # loss_ij = w_j * x_ij**2, a parameter shared by all rows
    x = BIG_LOSS / 4

    def grad(rows_list):
        w = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
        for rows in rows_list:
            agg(w * x[rows].square(), BIG_MASK[rows], BIG_NORM).backward()
        return w.grad.clone()

    full = grad([slice(0, 4)])
    accumulated = grad([slice(0, 2), slice(2, 4)])
    torch.testing.assert_close(accumulated, full, atol=1e-6, rtol=0)
    if mode == "token-mean":
        # d/dw_j = sum over masked tokens of column j of x^2 / 6
        # x = loss / 4: col 0 masked rows 0,1,2 -> (1 + 16 + 49) / 16 = 66 / 16
        #               col 1 masked rows 0,1   -> (4 + 25) / 16 = 29 / 16
        #               col 2 masked row 0      -> 9 / 16
        close(full, [66 / 16 / 6, 29 / 16 / 6, 9 / 16 / 6], atol=1e-6)


# --------------------------------------------------------------- invariance with every policy loss

B, T, D, V = 8, 5, 4, 6
LENGTHS = [5, 3, 1, 4, 2, 5, 0, 3]  # one empty response


def problem():
    """A tiny 'language model': logits = x @ W, W shared by every token, in float64."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    w0 = torch.randn(D, V, generator=g, dtype=torch.float64) * 0.5
    mask = lengths_mask(LENGTHS, T).double()
    with torch.no_grad():
        lp0 = (x @ w0).log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    old = lp0 + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # some tokens get clipped
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) * mask
    norm = Normaliser(tokens=float(mask.sum()), sequences=float(B), max_response_length=T)
    return x, tokens, w0, mask, old, adv, norm


def shard_loss(w, rows, mode, loss_name="ppo_clip"):
    x, tokens, _, mask, old, adv, norm = problem()
    logprob = (x[rows] @ w).log_softmax(-1).gather(-1, tokens[rows].unsqueeze(-1)).squeeze(-1)
    out = POLICY_LOSSES.get(loss_name)(logprob, old[rows], adv[rows], mask[rows], LossParams(0.2, 0.28))
    return LOSS_AGGREGATIONS.get(mode)(out.loss, mask[rows], norm)


def loss_and_grad(row_sets, mode, loss_name="ppo_clip"):
    w = problem()[2].clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for rows in row_sets:
        loss = shard_loss(w, rows, mode, loss_name)
        loss.backward()
        total = total + loss.detach()
    return total, w.grad.clone()


@pytest.mark.parametrize("loss_name", ["ppo_clip", "dual_clip", "gspo", "cispo"])
@pytest.mark.parametrize("mode", sorted(LOSS_AGGREGATIONS.names()))
def test_one_vs_four_micro_batches_same_loss_and_gradient(mode, loss_name):
    full_loss, full_grad = loss_and_grad([torch.arange(B)], mode, loss_name)
    micro_loss, micro_grad = loss_and_grad([torch.arange(i, i + 2) for i in range(0, B, 2)], mode, loss_name)
    assert full_grad.abs().sum() > 0
    torch.testing.assert_close(micro_loss, full_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(micro_grad, full_grad, atol=1e-6, rtol=0)


def _gloo_worker(rank: int, world: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for mode in LOSS_AGGREGATIONS.names():
            w = problem()[2].clone().requires_grad_(True)
            loss = shard_loss(w, torch.arange(rank, B, world), mode)  # strided rows, as the trainer
            loss.backward()
            grad, total = w.grad.clone(), loss.detach().clone()
            dist.all_reduce(grad, op=dist.ReduceOp.SUM)
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            results[mode] = (total, grad)
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="no gloo")
def test_one_vs_two_gloo_ranks_same_loss_and_gradient(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "rank0.pt"
    mp.spawn(_gloo_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    results = torch.load(out)
    assert sorted(results) == LOSS_AGGREGATIONS.names()
    for mode, (total, grad) in results.items():
        full_loss, full_grad = loss_and_grad([torch.arange(B)], mode)
        torch.testing.assert_close(total, full_loss, atol=1e-6, rtol=0, msg=mode)
        torch.testing.assert_close(grad, full_grad, atol=1e-6, rtol=0, msg=mode)
