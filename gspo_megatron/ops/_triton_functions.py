"""The log-prob op and the fused sequence loss on CUDA: bf16 operands, fp32 statistics, Triton epilogues.

Same arguments, outputs and collectives as the torch Functions (``_logprob_function``, ``_sequence_loss_function``);
what differs is how a shard's numbers are made (``_triton_kernels``):

- The hidden states and the weight shard stay in their dtype (no fp32 copies): bf16 GEMMs accumulating in fp32.
- Forward: one kernel computes every token's shard statistics [T, 4] straight from the GEMM tiles. No logits
  buffer, so no chunks: the whole input in one launch, whatever the sequence length.
- Gradient: per chunk of tokens, one kernel recomputes the logits tile and writes d/dx in bf16 into a [chunk, V_shard]
  buffer (sized from free memory: ``logprob.auto_chunk_size``), then cuBLAS runs G @ W and G.T @ h. The weight
  gradient accumulates in fp32 when there is more than one chunk; with one chunk it is the GEMM's bf16 output, as
  in the naive bf16 path.
- The fused sequence loss therefore runs four GEMMs (statistics, gradient tile, two gradient GEMMs) where the torch
  path runs three, but no sequence is ever split into two passes and no fp32 logits exist: the statistics of all
  sequences come first, then the caller's loss on all of them at once, then the gradient chunks.

Outputs are fp32; input gradients come back in the inputs' dtype, reduced over TP in that dtype (as Megatron's
bf16 path reduces its activation gradients).
"""

from __future__ import annotations

import torch

from . import _tp_comm as comm
from . import _triton_kernels as kernels
from ._sequence_loss_function import VocabParallelSequenceLoss, _Chunks
from ._shard_softmax import combine_shard_stats

__all__ = ["TritonVocabParallelLogprob", "TritonVocabParallelSequenceLoss"]


class _Gradients:
    """The hidden gradient [T, H] (operand dtype) and the weight-shard gradient, filled chunk by chunk."""

    def __init__(self, h, w, weight, need_hidden: bool, need_weight: bool, chunks: int):
        self.h, self.w, self.accumulate = h, w, chunks > 1
        self.grad_h = torch.empty_like(h) if need_hidden else None
        self.grad_w = None
        if need_weight:  # padding rows (past w's) keep a zero gradient
            dtype = torch.promote_types(h.dtype, torch.float32) if self.accumulate else h.dtype
            self.grad_w = torch.zeros(weight.shape, dtype=dtype, device=h.device)

    def add(self, g: torch.Tensor, rows: slice) -> None:
        if self.grad_h is not None:
            torch.mm(g, self.w, out=self.grad_h[rows])
        if self.grad_w is not None:
            shard = self.grad_w[: self.w.shape[0]]
            if self.accumulate:
                shard += torch.mm(g.T, self.h[rows])
            else:
                torch.mm(g.T, self.h[rows], out=shard)


def _chunk_count(tokens: int, chunk_size: int) -> int:
    return max(1, -(-tokens // chunk_size))


def _logits_gradients(grads: _Gradients, local_targets, lse, entropy, grad_logp, grad_entropy, temperature,
                      chunk_size: int) -> None:
    """Accumulate d loss / d x (x = h @ w.T) times h and w into ``grads``, chunk by chunk (see the module docstring).

    grad_logp / grad_entropy: [T] upstream gradients of the log-probs and entropies (None: zero).
    """
    h, w = grads.h, grads.w
    tokens = h.shape[0]
    a = (-grad_logp / temperature).float() if grad_logp is not None else lse.new_zeros(tokens)
    b = (-grad_entropy / temperature).float() if grad_entropy is not None else None
    buffer = h.new_empty(max(1, min(chunk_size, tokens)), w.shape[0])
    for start in range(0, tokens, chunk_size):
        rows = slice(start, min(tokens, start + chunk_size))
        g = kernels.logits_grad(h[rows], w, local_targets[rows], lse[rows], entropy[rows] if b is not None else None,
                                a[rows], b[rows] if b is not None else None, temperature,
                                buffer[: rows.stop - rows.start])
        grads.add(g, rows)


def _statistics(h, w, local_targets, temperature, with_entropy, group):
    """(lse, target logit, entropy) [T] fp32 over the whole vocabulary: this shard's kernel, combined over TP."""
    stats = kernels.shard_stats(h, w, local_targets, temperature, with_entropy)
    return combine_shard_stats(comm.gather_rows(stats, group).view(-1, *stats.shape))


class TritonVocabParallelLogprob(torch.autograd.Function):
    """``_logprob_function.VocabParallelLogprob`` with the Triton kernels: same arguments, outputs, saved tensors."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, group, temperature, with_entropy, chunk_size, vocab_start,
                shard_rows, sequence_parallel):
        full = comm.gather_rows(hidden, group) if sequence_parallel else hidden  # [T, H]
        h, w = full.contiguous(), weight[:shard_rows]
        lse, target_logit, entropy = _statistics(h, w, targets - vocab_start, temperature, with_entropy, group)
        logp = target_logit - lse
        ctx.save_for_backward(h, weight, targets, lse, entropy if with_entropy else lse.new_empty(0))
        ctx.args = (group, temperature, with_entropy, chunk_size, vocab_start, shard_rows, sequence_parallel)
        ctx.set_materialize_grads(False)
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        h, weight, targets, lse, entropy = ctx.saved_tensors
        group, temperature, with_entropy, chunk_size, vocab_start, shard_rows, sequence_parallel = ctx.args
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        none = (None,) * 8
        if grad_logp is None and grad_entropy is None:
            return (None, None, *none)
        grads = _Gradients(h, weight[:shard_rows], weight, need_hidden, need_weight,
                           _chunk_count(h.shape[0], chunk_size))
        _logits_gradients(grads, targets - vocab_start, lse, entropy, grad_logp, grad_entropy, temperature,
                          chunk_size)
        grad_h = grads.grad_h
        if need_hidden:
            grad_h = (comm.reduce_scatter_rows if sequence_parallel else comm.all_reduce_sum_)(grad_h, group)
        grad_w = grads.grad_w.to(weight.dtype) if need_weight else None
        return (grad_h, grad_w, *none)


class TritonVocabParallelSequenceLoss(VocabParallelSequenceLoss):
    """``_sequence_loss_function.VocabParallelSequenceLoss`` with the Triton kernels (its backward as is)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, loss_fn, collected, group, temperature, with_entropy, chunk_size,
                vocab_start, shard_rows, sequence_parallel):
        full = comm.gather_rows(hidden, group) if sequence_parallel else hidden  # [s, b, H]
        s, b = full.shape[0], full.shape[1]
        h = full.transpose(0, 1).contiguous().view(b * s, -1)  # sequence-major: a sequence is s rows
        w = weight[:shard_rows]
        local_targets = (targets.t() - vocab_start).reshape(-1)
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grads = _Gradients(h, w, weight, need_hidden, need_weight, _chunk_count(b * s, chunk_size))
        lse, target_logit, entropy = _statistics(h, w, local_targets, temperature, with_entropy, group)
        logp = target_logit - lse
        run = _Chunks(h, w, local_targets, loss_fn, collected, group, temperature, with_entropy, s, grads)
        loss, g_logp, g_entropy = run._loss_and_grads(slice(0, b), logp, entropy if with_entropy else None)
        if run.need_grad and (g_logp is not None or g_entropy is not None):
            _logits_gradients(grads, local_targets, lse, entropy, g_logp, g_entropy, temperature, chunk_size)
        elif run.need_grad:  # the loss does not depend on the log-probs
            for grad in (grads.grad_h, grads.grad_w):
                if grad is not None:
                    grad.zero_()

        ctx.save_for_backward(*(t for t in (grads.grad_h, grads.grad_w) if t is not None))
        ctx.args = (need_hidden, need_weight, group, sequence_parallel, hidden.dtype, weight.dtype, s, b)
        logp = logp.view(b, s).t().contiguous()
        entropy = entropy.view(b, s).t().contiguous() if with_entropy else lse.new_empty(0)
        ctx.mark_non_differentiable(logp, entropy)
        return loss, logp, entropy
