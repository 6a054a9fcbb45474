"""The fused vocab-parallel sequence loss: logits -> per-token log-probs -> the caller's loss -> gradients, per chunk.

Why: the log-prob op (``_logprob_function``) cannot know its upstream gradient until the whole loss is built, so
its backward recomputes every chunk's logits: four [T, H] x [H, V_shard] matmuls where the naive path runs three.
A policy loss, though, is a sum of independent per-sequence terms once its normaliser is fixed (Megatron's
per-token-loss mode fixes it: each micro batch returns a *sum* over sequences). So for a chunk of whole sequences
the loss, and with it d loss / d logp and d loss / d entropy, is known as soon as the chunk's statistics are: the
gradient w.r.t. the chunk's logits is formed from the logits still in the buffer, and the matmuls for the hidden
and weight gradients run right away. Three matmuls, no [T, V] tensor, and backward is a scalar multiply.

A sequence longer than a chunk cannot be held whole: it runs in two passes over sub-chunks (statistics, its loss,
then recomputed logits and gradients), the log-prob op's cost, for that sequence only.

Collectives over the TP group: per chunk, one all-gather of its [c, 4] statistics (the loss needs the combined
log-sum-exp before the gradient can be formed); the hidden all-gather (sequence parallel) in forward and the hidden
gradient all-reduce / reduce-scatter in backward, as the log-prob op. The loss function may run its own (e.g. the
CP reduction of sequence sums): every rank calls it for the same sequences in the same order.
"""

from __future__ import annotations

import torch

from . import _tp_comm as comm
from ._logprob_function import _chunk_buffer, _chunk_logits, compute_dtype
from ._shard_softmax import (
    STAT_MAX, combine_shard_stats, logits_grad_, logprob_grad_from_exp_, logprob_grad_unsigned_, shard_stats_,
)


class _Accumulator:
    """The hidden gradient [T, H] (sequence-major rows) and the weight-shard gradient, filled chunk by chunk."""

    def __init__(self, h: torch.Tensor, w: torch.Tensor, weight: torch.Tensor, need_hidden: bool, need_weight: bool):
        self.h, self.w, self.shard_rows = h, w, w.shape[0]
        self.grad_h = torch.zeros_like(h) if need_hidden else None
        self.grad_w = torch.zeros(weight.shape, dtype=h.dtype, device=h.device) if need_weight else None

    def add(self, g: torch.Tensor, rows: slice, sign: float | torch.Tensor = 1.0) -> None:
        """Add the contribution of ``g`` = sign * d loss / d x for the chunk's ``rows`` [c, V_shard]."""
        if self.grad_h is not None:
            out = self.grad_h[rows]
            torch.mm(g, self.w, out=out)
            if not (isinstance(sign, float) and sign == 1.0):
                out.mul_(sign)
        if self.grad_w is not None:
            h = self.h[rows]
            if isinstance(sign, torch.Tensor):
                h = h * sign
            self.grad_w[: self.shard_rows].addmm_(g.T, h, alpha=sign if isinstance(sign, float) else 1.0)


class VocabParallelSequenceLoss(torch.autograd.Function):
    """(hidden [s_local, b, H], weight [V_shard, H], targets [s, b]) -> (loss, logp [s, b], entropy [s, b] or empty).

    Non-tensor arguments: loss_fn (sequences: slice, logp [k, s], entropy [k, s] or None) -> scalar loss of those
    sequences; collected (a list the forward appends each chunk's (sequences, loss_fn extras) to); group,
    temperature, with_entropy, chunk_size, vocab_start, shard_rows, sequence_parallel as in VocabParallelLogprob.
    Only the loss is differentiable.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, loss_fn, collected, group, temperature, with_entropy, chunk_size,
                vocab_start, shard_rows, sequence_parallel):
        cdtype = compute_dtype(hidden.dtype)
        full = comm.gather_rows(hidden, group) if sequence_parallel else hidden  # [s, b, H]
        s, b = full.shape[0], full.shape[1]
        h = full.transpose(0, 1).to(cdtype).contiguous().view(b * s, -1)  # sequence-major: a sequence is s rows
        w = weight[:shard_rows].to(cdtype)
        local_targets = (targets.t() - vocab_start).reshape(-1)
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        acc = _Accumulator(h, w, weight, need_hidden, need_weight)
        run = _Chunks(h, w, local_targets, loss_fn, collected, group, temperature, with_entropy, s, acc)
        logp = h.new_empty(b * s)
        entropy = h.new_empty(b * s) if with_entropy else h.new_empty(0)
        loss = h.new_zeros(())
        if s <= chunk_size:
            per_chunk = chunk_size // s
            buffers = run.buffers(min(b, per_chunk) * s)
            for first in range(0, b, per_chunk):
                loss += run.one_pass(slice(first, min(b, first + per_chunk)), logp, entropy, buffers)
        else:
            buffers = run.buffers(chunk_size)
            for sequence in range(b):
                loss += run.two_passes(sequence, chunk_size, logp, entropy, buffers)
        del buffers

        ctx.save_for_backward(*(t for t in (acc.grad_h, acc.grad_w) if t is not None))
        ctx.args = (need_hidden, need_weight, group, sequence_parallel, hidden.dtype, weight.dtype, s, b)
        logp = logp.view(b, s).t().contiguous()
        entropy = entropy.view(b, s).t().contiguous() if with_entropy else entropy
        ctx.mark_non_differentiable(logp, entropy)
        return loss, logp, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        need_hidden, need_weight, group, sequence_parallel, hidden_dtype, weight_dtype, s, b = ctx.args
        saved = list(ctx.saved_tensors)
        grad_h = saved.pop(0) if need_hidden else None
        grad_w = saved.pop(0) if need_weight else None
        # The gradients were formed in forward for a loss gradient of 1; an exact 1 (no loss scaling) needs no
        # pass over the [V_shard, H] weight gradient. Out of place otherwise: the saved tensors stay as they were.
        unit = bool(grad_loss == 1)
        if grad_h is not None:
            grad_h = grad_h.view(b, s, -1).transpose(0, 1) * grad_loss  # back to [s, b, H]
            if sequence_parallel:
                grad_h = comm.reduce_scatter_rows(grad_h, group)
            else:
                grad_h = comm.all_reduce_sum_(grad_h, group)
            grad_h = grad_h.to(hidden_dtype)
        if grad_w is not None:
            grad_w = (grad_w if unit else grad_w * grad_loss).to(weight_dtype)
        return (grad_h, grad_w) + (None,) * 10


class _Chunks:
    """One forward's state: inputs in compute dtype, the loss function, and the gradient accumulator."""

    def __init__(self, h, w, local_targets, loss_fn, collected, group, temperature, with_entropy, s, acc):
        self.h, self.w, self.targets = h, w, local_targets
        self.loss_fn, self.collected, self.group = loss_fn, collected, group
        self.temperature, self.with_entropy, self.s, self.acc = temperature, with_entropy, s, acc
        self.need_grad = acc.grad_h is not None or acc.grad_w is not None

    def buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunk's logits buffer, and with entropy a second one (the statistics consume their input)."""
        z = _chunk_buffer(self.h, self.w, rows)
        return z, (torch.empty_like(z) if self.with_entropy else None)

    def _stats(self, z: torch.Tensor, rows: slice, spare: torch.Tensor | None) -> torch.Tensor:
        """This shard's [c, 4] statistics of chunk ``z``. Without entropy ``z`` becomes exp(z - m_r); with it, z
        is left as is (for logits_grad_) and the statistics consume a copy in ``spare``."""
        stats = z.new_empty(z.shape[0], 4)
        if self.with_entropy:
            work = spare[: z.shape[0]]
            work.copy_(z)
            shard_stats_(work, self.targets[rows], True, stats)
        else:
            shard_stats_(z, self.targets[rows], False, stats)
        return stats

    def _combine(self, stats: torch.Tensor):
        return combine_shard_stats(comm.gather_rows(stats, self.group).view(-1, *stats.shape))

    def _loss_and_grads(self, sequences: slice, logp: torch.Tensor, entropy: torch.Tensor | None):
        """The caller's loss for ``sequences`` and its gradients w.r.t. their log-probs and entropies [k * s]."""
        k = sequences.stop - sequences.start
        leaves = [logp.view(k, self.s).detach().requires_grad_(self.need_grad)]
        if entropy is not None:
            leaves.append(entropy.view(k, self.s).detach().requires_grad_(self.need_grad))
        with torch.enable_grad():
            loss, extras = self.loss_fn(sequences, *leaves, *([None] if entropy is None else []))
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError(f"loss_fn must return (scalar tensor, extras), got a loss of {loss!r}")
            grads = [None] * len(leaves)
            if self.need_grad and loss.requires_grad:
                grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        self.collected.append((sequences, extras))
        grads = [g.reshape(-1) if g is not None else None for g in grads]
        return loss.detach().to(logp.dtype), grads[0], (grads[1] if entropy is not None else None)

    def one_pass(self, sequences: slice, logp_out, entropy_out, buffers) -> torch.Tensor:
        """Whole sequences in one chunk: logits once, statistics, loss, gradients from the same logits."""
        rows = slice(sequences.start * self.s, sequences.stop * self.s)
        z = _chunk_logits(self.h, self.w, rows, self.temperature, buffers[0])
        stats = self._stats(z, rows, buffers[1])
        lse, target_logit, entropy = self._combine(stats)
        logp_out[rows] = target_logit - lse
        if self.with_entropy:
            entropy_out[rows] = entropy
        loss, g_logp, g_entropy = self._loss_and_grads(
            sequences, logp_out[rows], entropy_out[rows] if self.with_entropy else None
        )
        if not self.need_grad:
            return loss
        g_logp = g_logp if g_logp is not None else torch.zeros_like(lse)
        if self.with_entropy:
            g_entropy = g_entropy if g_entropy is not None else torch.zeros_like(lse)
            g = logits_grad_(z, self.targets[rows], lse, entropy, g_logp, g_entropy, self.temperature)
            self.acc.add(g, rows)
        else:
            g = logprob_grad_from_exp_(z, self.targets[rows], stats[:, STAT_MAX], lse, g_logp / self.temperature)
            self.acc.add(g, rows, sign=-1.0)
        return loss

    def two_passes(self, sequence: int, chunk_size: int, logp_out, entropy_out, buffers) -> torch.Tensor:
        """A sequence longer than a chunk: statistics over its sub-chunks, its loss, then recomputed logits."""
        start, stop = sequence * self.s, (sequence + 1) * self.s
        parts = [slice(i, min(stop, i + chunk_size)) for i in range(start, stop, chunk_size)]
        stats = torch.cat([self._stats(_chunk_logits(self.h, self.w, r, self.temperature, buffers[0]), r,
                                       buffers[1]) for r in parts])
        lse, target_logit, entropy = self._combine(stats)
        whole = slice(start, stop)
        logp_out[whole] = target_logit - lse
        if self.with_entropy:
            entropy_out[whole] = entropy
        loss, g_logp, g_entropy = self._loss_and_grads(
            slice(sequence, sequence + 1), logp_out[whole], entropy_out[whole] if self.with_entropy else None
        )
        if not self.need_grad:
            return loss
        g_logp = g_logp if g_logp is not None else torch.zeros_like(lse)
        for r in parts:
            z = _chunk_logits(self.h, self.w, r, self.temperature, buffers[0])
            local = slice(r.start - start, r.stop - start)
            if g_entropy is None:
                g, sign = logprob_grad_unsigned_(z, self.targets[r], lse[local], g_logp[local] / self.temperature)
                self.acc.add(g, r, sign=sign)
            else:
                g = logits_grad_(z, self.targets[r], lse[local], entropy[local], g_logp[local], g_entropy[local],
                                 self.temperature)
                self.acc.add(g, r)
        return loss
