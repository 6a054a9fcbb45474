"""A policy loss fused with the vocab-parallel output layer: hidden states -> loss, three matmuls, no [T, V].

    loss = sum over chunks of whole sequences of loss_fn(sequences, logp [k, s], entropy [k, s] or None)

``loss_fn`` is the caller's loss restricted to a slice of the micro batch's sequences, and must be a sum of
per-sequence terms (a fixed normaliser is fine; a mean over the chunk is not): then d loss / d logp is known per
chunk, the logits' gradient is formed while they are in the buffer, and backward only scales the gradients it
already has (see ``_sequence_loss_function``). GSPO, GSPO-token and GRPO in Megatron's per-token-loss mode all
are: each micro batch returns a sum over its sequences (or tokens), with KL and entropy terms per sequence.

Use it for the update pass; the old/reference log-prob passes (no gradient) use ``vocab_parallel_logprobs``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from . import _tp_comm as comm
from ._sequence_loss_function import VocabParallelSequenceLoss
from .logprob import _check_inputs, _chunk_size, select_backend

__all__ = ["SequenceLoss", "vocab_parallel_sequence_loss"]

LossFn = Callable[[slice, torch.Tensor, "torch.Tensor | None"], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


class SequenceLoss(NamedTuple):
    loss: torch.Tensor  # scalar, differentiable w.r.t. hidden and weight
    logp: torch.Tensor  # [b, s], detached
    entropy: torch.Tensor | None  # [b, s], detached (None without with_entropy)
    extras: dict[str, torch.Tensor]  # loss_fn's extras over all chunks


def vocab_parallel_sequence_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: LossFn,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    sequence_parallel: bool = False,
    vocab_size: int | None = None,
    backend: str = "auto",
) -> SequenceLoss:
    """The loss ``loss_fn`` gives the target tokens' log-probs (and entropies), fused with the output layer.

    hidden: [s, b, H] final hidden states in Megatron's layout, b sequences of s positions (with
        ``sequence_parallel``, this rank's block of s); weight: [V/tp, H]; targets: [s, b] global token ids.
        tp_group, temperature, sequence_parallel, vocab_size: as ``vocab_parallel_logprobs``.
    loss_fn(sequences, logp, entropy) -> (scalar loss, extras): called once per chunk with a slice of the b
        sequences and their log-probs [k, s] (entropy [k, s] when ``with_entropy``, else None), with autograd on.
        Every TP rank calls it with the same values; it may run collectives of its own (same order everywhere).
        extras: a dict of detached tensors; [k, ...] ones are concatenated over chunks, scalars summed.
    chunk_size: tokens per chunk (None: ``auto_chunk_size``). torch backend: a chunk holds chunk_size // s whole
        sequences; sequences longer than chunk_size run in two passes (recomputing their logits), like the log-prob
        op. triton backend: the statistics of all tokens come first (no buffer), then ``loss_fn`` once for all b
        sequences, then the gradient in chunks of chunk_size tokens (four GEMMs; see ``_triton_functions``).
    backend: as ``vocab_parallel_logprobs`` ("auto": Triton kernels for bf16/fp16 CUDA inputs).

    Returns SequenceLoss(loss, logp [b, s], entropy [b, s] or None, extras). Only the loss is differentiable
    (w.r.t. hidden and weight); its backward needs no recomputation.
    """
    tp, rank = comm.group_size(tp_group), comm.group_rank(tp_group)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise ValueError(f"hidden must be [s, b, H] (sequences along dim 1), got {getattr(hidden, 'shape', hidden)}")
    shard_rows = _check_inputs(
        hidden, weight, targets, tp, rank, temperature, chunk_size, sequence_parallel, vocab_size
    )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    backend = select_backend(backend, hidden.device, hidden.dtype, weight.dtype)
    # The torch backend's one-pass chunks hold the logits and, with entropy, a second buffer for the statistics.
    chunk_size = _chunk_size(chunk_size, backend, hidden, shard_rows, with_entropy)
    collected: list = []
    function = VocabParallelSequenceLoss
    if backend == "triton":
        from ._triton_functions import TritonVocabParallelSequenceLoss as function  # imports triton
    loss, logp, entropy = function.apply(
        hidden, weight, targets, loss_fn, collected, tp_group, float(temperature), bool(with_entropy),
        int(chunk_size), rank * weight.shape[0], shard_rows, bool(sequence_parallel) and tp > 1,
    )
    return SequenceLoss(loss, logp.t(), entropy.t() if with_entropy else None, _merge(collected))


def _merge(collected: list) -> dict[str, torch.Tensor]:
    """Chunks' extras in sequence order: per-sequence tensors concatenated, scalars summed."""
    if not collected:
        return {}
    out = {}
    for key in collected[0][1]:
        values = [extras[key] for _, extras in collected]
        out[key] = torch.stack(values).sum(0) if values[0].dim() == 0 else torch.cat(values)
    return out
