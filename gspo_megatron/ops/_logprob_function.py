"""The chunked vocab-parallel log-prob autograd Function (torch path; the reference for any kernel).

Memory: forward and backward hold one or two [chunk, V_shard] logit buffers at a time, never [T, V] (plus, for
inputs below fp32, fp32 copies of the hidden [T, H] and weight shard [V_shard, H] while they run).
Saved for backward: the (gathered) hidden [T, H], the weight shard, the targets and per-token lse/entropy [T];
backward recomputes each chunk's logits instead of storing them (one extra matmul, the price of O(chunk x V)).
One [chunk, V_shard] buffer is allocated per pass and reused by every chunk.

Collectives over the TP group, per call (not per chunk, since the shard statistics combine exactly at the end,
see _shard_softmax): forward, one all-gather of the [T, 4] statistics (plus the hidden all-gather under sequence
parallelism); backward, one all-reduce (reduce-scatter under sequence parallelism) of the hidden gradient [T, H].
The weight-shard gradient is local.
"""

from __future__ import annotations

import torch

from . import _tp_comm as comm
from ._shard_softmax import combine_shard_stats, logits_grad_, logprob_grad_unsigned_, shard_stats_


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Logits and softmax statistics in fp32 at least (float64 stays float64, for gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, rows: slice, temperature: float,
                  buffer: torch.Tensor) -> torch.Tensor:
    """Tempered logits z = hidden[rows] @ weight.T / temperature: [c, V_shard], both already in compute dtype.

    Written into ``buffer`` [chunk, V_shard], reused by every chunk: a fresh allocation per chunk would fault in
    (and zero) chunk x V_shard x 4 bytes of new pages each time on CPU. The temperature rides on the GEMM's alpha.
    """
    h = hidden[rows]
    z = buffer[: h.shape[0]]
    if temperature == 1.0:
        return torch.mm(h, weight.T, out=z)
    return z.addmm_(h, weight.T, beta=0.0, alpha=1.0 / temperature)


def _chunk_buffer(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int) -> torch.Tensor:
    return hidden.new_empty(max(1, min(chunk_size, hidden.shape[0])), weight.shape[0])


class VocabParallelLogprob(torch.autograd.Function):
    """(hidden [T_local, H], weight [V_shard, H], targets [T]) -> log p(target) [T] (and entropy [T]).

    Non-tensor arguments: group (TP group or None), temperature, with_entropy, chunk_size, vocab_start (the
    global id of this shard's first row), shard_rows (rows of the shard that are real vocabulary; padding rows
    past it get no logit and zero gradient), sequence_parallel (hidden is this rank's block of T/tp tokens).
    Returns logp, or (logp, entropy) when with_entropy.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, group, temperature, with_entropy, chunk_size, vocab_start,
                shard_rows, sequence_parallel):
        cdtype = compute_dtype(hidden.dtype)
        full = comm.gather_rows(hidden, group) if sequence_parallel else hidden  # [T, H]
        h, w = full.to(cdtype), weight[:shard_rows].to(cdtype)
        local_targets = targets - vocab_start
        stats = torch.empty(full.shape[0], 4, dtype=cdtype, device=full.device)
        buffer = _chunk_buffer(h, w, chunk_size)
        for start in range(0, full.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            shard_stats_(_chunk_logits(h, w, rows, temperature, buffer), local_targets[rows], with_entropy, stats[rows])
        del buffer
        lse, target_logit, entropy = combine_shard_stats(comm.gather_rows(stats, group).view(-1, *stats.shape))
        logp = target_logit - lse
        ctx.save_for_backward(full, weight, targets, lse, entropy if with_entropy else lse.new_empty(0))
        ctx.args = (group, temperature, with_entropy, chunk_size, vocab_start, shard_rows, sequence_parallel)
        ctx.set_materialize_grads(False)
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        full, weight, targets, lse, entropy = ctx.saved_tensors
        group, temperature, with_entropy, chunk_size, vocab_start, shard_rows, sequence_parallel = ctx.args
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        none = (None,) * 8  # targets and the seven non-tensor arguments
        if grad_logp is None and grad_entropy is None:
            return (None, None, *none)
        cdtype = compute_dtype(full.dtype)
        h, w = full.to(cdtype), weight[:shard_rows].to(cdtype)
        local_targets = targets - vocab_start
        grad_logp = grad_logp.to(cdtype) if grad_logp is not None else None
        grad_entropy = grad_entropy.to(cdtype) if grad_entropy is not None else None
        grad_h = torch.empty_like(h) if need_hidden else None
        grad_w = torch.zeros(weight.shape, dtype=cdtype, device=weight.device) if need_weight else None
        buffer = _chunk_buffer(h, w, chunk_size)
        for start in range(0, h.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            z = _chunk_logits(h, w, rows, temperature, buffer)
            if grad_entropy is None:  # the policy update: one exp pass, the sign goes on the [c, H] side
                g, sign = logprob_grad_unsigned_(z, local_targets[rows], lse[rows], grad_logp[rows] / temperature)
                if need_hidden:
                    torch.mm(g, w, out=grad_h[rows]).mul_(sign)
                if need_weight:
                    grad_w[:shard_rows].addmm_(g.T, h[rows] * sign)
                continue
            g = logits_grad_(
                z,
                local_targets[rows],
                lse[rows],
                entropy[rows] if with_entropy else None,
                grad_logp[rows] if grad_logp is not None else None,
                grad_entropy[rows],
                temperature,
            )  # [c, V_shard], d/d logits
            if need_hidden:
                torch.mm(g, w, out=grad_h[rows])
            if need_weight:
                grad_w[:shard_rows].addmm_(g.T, h[rows])
        del buffer
        if need_hidden:
            # Every TP rank holds part of the vocabulary: the hidden gradient is the sum of the shards' parts.
            if sequence_parallel:
                grad_h = comm.reduce_scatter_rows(grad_h, group)
            else:
                grad_h = comm.all_reduce_sum_(grad_h, group)
            grad_h = grad_h.to(full.dtype)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return (grad_h, grad_w, *none)
