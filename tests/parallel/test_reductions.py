"""Sequence sums, and GSPO over context-parallel ranks equal to the unsplit computation.

The CP check runs at the op level: each of CP=2 ranks holds Megatron's load-balanced slice of every
sequence (chunks r and 2*cp-1-r of 2*cp), reduces its per-sequence partial sums as scalars, and computes
the loss. Megatron's local attention cannot run CP, so the model-level CP path needs TransformerEngine.
"""

from __future__ import annotations

import torch

from gspo_megatron.algo import gspo_loss, gspo_loss_from_sums, masked_log_ratio_sums
from gspo_megatron.parallel.context import token_index
from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.parallel.reductions import all_reduce_sequence_sums, broadcast_from_last_stage, sequence_sums

B = 3


def rollout(T: int):
    g = torch.Generator().manual_seed(T)
    logprobs = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logprobs + 1e-3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 2:] = True
    mask[1, T // 2 :] = True  # response only in the second half: rank 0 holds part of it via chunk 3
    mask[2, 1 : T - 3] = True
    advantages = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    return logprobs, old, mask, advantages




def test_padded_and_packed_sums_agree():
    values = torch.randn(3, 5, dtype=torch.float64)
    mask = torch.rand(3, 5) > 0.4
    values[~mask] = float("-inf")  # masked garbage must not leak
    sums, counts = sequence_sums(values, mask)
    lengths = torch.tensor([5, 5, 5])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    psums, pcounts = sequence_sums(values.reshape(-1), mask.reshape(-1), cu)
    torch.testing.assert_close(psums, sums, rtol=0, atol=1e-14)
    torch.testing.assert_close(pcounts, counts, rtol=0, atol=0)
    expected = [sum(v for v, m in zip(values[i].tolist(), mask[i].tolist()) if m) for i in range(3)]
    torch.testing.assert_close(sums, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-14)


def test_packed_sums_of_uneven_sequences():
    values = torch.arange(7, dtype=torch.float64)
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    sums, counts = sequence_sums(values, mask, torch.tensor([0, 3, 3, 7]))
    assert sums.tolist() == [3.0, 0.0, 3.0 + 5.0 + 6.0] and counts.tolist() == [2.0, 0.0, 3.0]


def test_bad_cu_seqlens_is_named():
    import pytest

    with pytest.raises(ValueError, match="cu_seqlens"):
        sequence_sums(torch.zeros(4), torch.ones(4), torch.tensor([0, 3]))


def _cp_gspo(lengths):
    from megatron.core import parallel_state as ps

    group, cp, rank = ps.get_context_parallel_group(), ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    sent = []
    real_all_reduce = torch.distributed.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return real_all_reduce(tensor, *args, **kwargs)

    torch.distributed.all_reduce = counting_all_reduce
    out = {}
    try:
        for T in lengths:
            logprobs, old, mask, advantages = rollout(T)
            index = token_index(T, cp, rank)
            local = logprobs[:, index].clone().requires_grad_()
            sent.clear()
            sums, counts = masked_log_ratio_sums(local, old[:, index], mask[:, index])
            sums, counts = all_reduce_sequence_sums(sums, counts, group)
            terms = gspo_loss_from_sums(sums, counts, advantages, eps_low=0.2, eps_high=0.2)
            terms.loss.backward()
            out[T] = {
                "loss": terms.loss.detach(),
                "seq_log_ratio": terms.seq_log_ratio.detach(),
                "grad": local.grad,
                "index": index,
                "bytes": sum(sent),
            }
    finally:
        torch.distributed.all_reduce = real_all_reduce
    return out


def test_cp2_sequence_ratio_loss_and_grads_equal_unsplit():
    lengths = (16, 64)
    results = run_on_ranks(_cp_gspo, 2, Layout(context=2), lengths)
    for T in lengths:
        logprobs, old, mask, advantages = rollout(T)
        logprobs.requires_grad_()
        # eps 0.2 so no sequence is clipped and every gradient entry is non-trivial.
        loss, _ = gspo_loss(logprobs, old, advantages, mask, eps_low=0.2, eps_high=0.2)
        loss.backward()
        expected_ratio = torch.stack([(logprobs - old)[i][mask[i]].mean() for i in range(B)]).detach()
        grad = torch.zeros_like(logprobs)
        for rank in results:
            r = rank[T]
            torch.testing.assert_close(r["loss"], loss.detach(), rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(r["seq_log_ratio"], expected_ratio, rtol=1e-12, atol=1e-14)
            grad[:, r["index"]] += r["grad"]
            # O(1) per sequence: one [2, B] float64 all-reduce, whatever T.
            assert r["bytes"] == 2 * B * 8, r["bytes"]
        torch.testing.assert_close(grad, logprobs.grad, rtol=1e-12, atol=1e-14)
        assert (grad[mask] != 0).all() and (grad[~mask] == 0).all()


def _pp_broadcast():
    from megatron.core import parallel_state as ps

    last = ps.is_pipeline_last_stage()
    tensors = {"seq_logprob": torch.tensor([-1.5, -2.0]), "count": torch.tensor([3, 4])} if last else None
    return broadcast_from_last_stage(tensors, ps.get_pipeline_model_parallel_group())


def test_pp_broadcast_reaches_every_stage():
    for got in run_on_ranks(_pp_broadcast, 2, Layout(pipeline=2)):
        torch.testing.assert_close(got["seq_logprob"], torch.tensor([-1.5, -2.0]), rtol=0, atol=0)
        assert got["count"].tolist() == [3, 4]
